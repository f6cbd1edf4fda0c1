"""The guard's walk over a large message's fields, nested ones counted
(tandem/guard.py), against protobuf's own encoding of real tandem and OIP messages."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from tandem.v1 import reward_pb2, search_pb2
from tritonclient.grpc import service_pb2

from tandem import guard, tensors
from tandem.config import SearchConfig
from tandem.guard import LARGE_MESSAGE_BYTES, MAX_MESSAGE_FIELDS, _descriptor_of, _more_fields_than

P = service_pb2.InferParameter
INPUT = service_pb2.ModelInferRequest.InferInputTensor


def fields(message) -> int:
    """The fields protobuf writes for ``message``, nested ones counted (a
    packed scalar list, a string or bytes: one field; a map entry: itself,
    its key, its value and the value's own fields)."""
    count = 0
    for fd, value in message.ListFields():
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED  # older protobuf: label
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            for key in value:
                count += 3 + (fields(value[key]) if value_fd.message_type is not None else 0)
        elif repeated and fd.message_type is not None:
            count += sum(1 + fields(v) for v in value)
        elif repeated and fd.type not in (fd.TYPE_STRING, fd.TYPE_BYTES):
            count += 1  # packed
        elif repeated:
            count += len(value)
        else:
            count += 1 + (fields(value) if fd.message_type is not None else 0)
    return count


def counted(message) -> int:
    """What the walk counts in ``message`` (with its descriptor), found by
    bisecting on the limit."""
    raw, descriptor = message.SerializeToString(), message.DESCRIPTOR
    low, high = 0, 1 << 20
    while low < high:
        mid = (low + high) // 2
        if _more_fields_than(raw, mid, descriptor):
            low = mid + 1
        else:
            high = mid
    return low


def parameters(n: int) -> dict:
    return {f"p{i}": P(int64_param=i + 1) for i in range(n)}


def oip(n_parameters: int = 0, outputs: int = 0, contents: int = 84) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(
        model_name="m", inputs=[INPUT(name="board", datatype="UINT8", shape=[1, 2, 6, 7])],
        outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="value")] * outputs,
        raw_input_contents=[bytes(contents)])
    for name, p in parameters(n_parameters).items():
        request.inputs[0].parameters[name].CopyFrom(p)
    return request


@pytest.mark.parametrize("entries", [0, 1, 7, 8, 9, 300])
def test_the_walk_counts_top_level_fields_as_protobuf_encodes_them(entries):
    batch = search_pb2.SearchBatchRequest(searches=[search_pb2.SearchRequest(game="connect4", moves="44")] * entries)
    raw = batch.SerializeToString()
    assert _more_fields_than(raw, 8) == (entries > 8)
    # A large tensor is one field, stepped over whole.
    request = reward_pb2.EvaluateRequest(model="m", inputs=[tensors.to_proto("x", np.zeros((1 << 20,), np.uint8))],
                                         output_names=["v"] * entries)
    assert _more_fields_than(request.SerializeToString(), 8) == (2 + entries > 8)
    # With its type known, the tensor's own fields count too (name, dtype, shape, data), never its bytes.
    assert _more_fields_than(request.SerializeToString(), 8, request.DESCRIPTOR) == (6 + entries > 8)


@pytest.mark.parametrize("message", [
    oip(), oip(n_parameters=1), oip(n_parameters=300), oip(outputs=50, n_parameters=3),
    reward_pb2.EvaluateRequest(model="m", inputs=[tensors.to_proto("x", np.zeros((3, 4), np.float32))],
                               output_names=["a", "b"],
                               output_shared_memory={"a": reward_pb2.SharedMemoryRef(region="r", byte_size=8)}),
    search_pb2.SearchBatchRequest(searches=[search_pb2.SearchRequest(
        game="gomoku", moves="h8", board=search_pb2.Board(rows=2, columns=2, cells=b"\x01\x02\x00\x00"),
        simulations=5, session_id="s")] * 40),
], ids=["oip", "oip-1-parameter", "oip-300-parameters", "oip-outputs", "evaluate-map", "search-batch"])
def test_the_walk_counts_nested_fields_and_map_entries_as_protobuf_encodes_them(message):
    assert counted(message) == fields(message)


def test_nested_map_entries_share_one_budget_with_the_top_level():
    request = oip(n_parameters=10_000)
    raw = request.SerializeToString()
    assert len(raw) >= LARGE_MESSAGE_BYTES
    assert not _more_fields_than(raw, MAX_MESSAGE_FIELDS)  # counted at the top level only: 3 fields
    assert _more_fields_than(raw, MAX_MESSAGE_FIELDS, request.DESCRIPTOR)
    assert _more_fields_than(raw, MAX_MESSAGE_FIELDS, _descriptor_of(service_pb2.ModelInferRequest.FromString))


def test_bytes_strings_and_packed_scalars_are_one_field_whatever_their_size():
    request = oip(contents=8 << 20)
    request.id = "x" * (1 << 20)
    request.inputs[0].shape.extend([1] * 100_000)  # packed: one field
    raw = request.SerializeToString()
    assert len(raw) > 9 << 20
    assert counted(request) == fields(request) < 10
    assert not _more_fields_than(raw, MAX_MESSAGE_FIELDS, request.DESCRIPTOR)


def test_a_batch_of_the_most_searches_with_every_field_set_fits_the_budget():
    search = search_pb2.SearchRequest(
        game="gomoku", moves="h8i9" * 100, board=search_pb2.Board(rows=15, columns=15, cells=bytes(225)),
        simulations=800, deadline_ms=50.0, phase=1, session_id="s" * 36, evaluator=1, seed=7)
    batch = search_pb2.SearchBatchRequest(searches=[search] * SearchConfig().max_batch_searches)
    assert len(batch.SerializeToString()) >= LARGE_MESSAGE_BYTES  # walked
    assert counted(batch) == fields(batch) <= MAX_MESSAGE_FIELDS


def test_the_walk_takes_one_step_per_field_counted(monkeypatch):
    calls = 0
    varint = guard._varint

    def counting(raw, pos):
        nonlocal calls
        calls += 1
        return varint(raw, pos)

    monkeypatch.setattr(guard, "_varint", counting)
    request = oip(n_parameters=100_000)
    assert _more_fields_than(request.SerializeToString(), 4096, request.DESCRIPTOR)
    assert calls <= 2 * (4096 + 1)  # a key and at most one length or value per field


def test_the_descriptor_comes_from_a_generated_class_only():
    assert _descriptor_of(reward_pb2.EvaluateRequest.FromString) is reward_pb2.EvaluateRequest.DESCRIPTOR
    assert _descriptor_of(lambda raw: raw) is None
    assert _descriptor_of(None) is None


def test_malformed_bytes_end_the_walk_for_the_parser_to_refuse():
    assert not _more_fields_than(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 5)  # a varint too long
    assert not _more_fields_than(b"\x0b", 5)  # a group never ended
    assert not _more_fields_than(b"\x0c", 5)  # a group's end with no start
    assert not _more_fields_than(b"\x08", 5)  # cut short
    assert not _more_fields_than(b"\x0e", 5)  # no such wire type
    descriptor = service_pb2.ModelInferRequest.DESCRIPTOR
    tensor = INPUT(name="board").SerializeToString()  # b"\x0a\x05board"
    for raw in [
        b"\x2a\x10" + tensor,  # inputs: longer than the message
        b"\x2a\x05" + tensor,  # inputs: its name runs past the input's end
        b"\x2a\x01\x0b" + b"\x08\x01" * 10,  # a group left open at the input's end
    ]:
        assert not _more_fields_than(raw, 5, descriptor), raw
        with pytest.raises(DecodeError):
            service_pb2.ModelInferRequest.FromString(raw)


def test_groups_are_counted_not_walked_into():
    """The parser keeps a group as an unknown field, so one must not end the
    walk: every field after it, and inside it, is counted."""
    descriptor = service_pb2.ModelInferRequest.DESCRIPTOR
    flood = b"\x7b\x7c" + b"\x3a\x00" * 10  # an empty group (field 15), then 10 raw_input_contents
    service_pb2.ModelInferRequest.FromString(flood)  # the parser takes it
    assert _more_fields_than(flood, 11, descriptor) and not _more_fields_than(flood, 12, descriptor)
    # Inside a group a message field's number is not a message: its bytes are stepped over.
    inside = b"\x7b\x2a\x03\xff\xff\xff\x7c" + b"\x3a\x00" * 10
    service_pb2.ModelInferRequest.FromString(inside)
    assert _more_fields_than(inside, 12, descriptor) and not _more_fields_than(inside, 13, descriptor)
