"""The guard's walk over a large message's top-level fields (tandem/guard.py),
against protobuf's own encoding of real tandem and OIP messages."""
from __future__ import annotations

import numpy as np
import pytest
from tandem.v1 import reward_pb2, search_pb2

from tandem import tensors
from tandem.guard import _more_fields_than


@pytest.mark.parametrize("entries", [0, 1, 7, 8, 9, 300])
def test_the_walk_counts_top_level_fields_as_protobuf_encodes_them(entries):
    batch = search_pb2.SearchBatchRequest(searches=[search_pb2.SearchRequest(game="connect4", moves="44")] * entries)
    raw = batch.SerializeToString()
    assert _more_fields_than(raw, 8) == (entries > 8)
    # A large tensor is one field, stepped over whole.
    request = reward_pb2.EvaluateRequest(model="m", inputs=[tensors.to_proto("x", np.zeros((1 << 20,), np.uint8))],
                                         output_names=["v"] * entries)
    assert _more_fields_than(request.SerializeToString(), 8) == (2 + entries > 8)


def test_malformed_bytes_end_the_walk_for_the_parser_to_refuse():
    assert not _more_fields_than(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 5)  # a varint too long
    assert not _more_fields_than(b"\x0b", 5)  # a group start: not proto3
    assert not _more_fields_than(b"\x08", 5)  # cut short
