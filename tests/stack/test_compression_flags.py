"""Malformed compression in a gRPC request (issue 41, part 6), sent as raw
HTTP/2 frames to a real search service on loopback: gRPC core refuses each
with INTERNAL and a message naming what was wrong, and the server keeps
serving. The guard's handler is already running (it reads the message
itself), but core fails the call with its own status as it receives the
message, before handing it on, so nothing tandem sends can change it
(docs/reliability.md, "The status contract")."""
from __future__ import annotations

import gzip
import socket
import struct

import pytest
from conftest import loopback_config
from tandem.v1 import search_pb2, search_pb2_grpc

from search_service import server as search_server
from tandem.server import channel

pytest.importorskip("h2")  # the test extra's (pyproject.toml)
import h2.config  # noqa: E402
import h2.connection  # noqa: E402
import h2.events  # noqa: E402

SEARCH = "/tandem.v1.SearchService/Search"
REQUEST = search_pb2.SearchRequest(game="connect4", moves="4", simulations=8).SerializeToString()


@pytest.fixture(scope="module")
def served():
    cfg = loopback_config(search={"backend": "cpu"})
    service = search_server.start(cfg, follow_scheduler=False)
    yield cfg.search.address
    service.stop()


def _call(address: str, body: bytes, flag: int, encoding: str | None) -> dict[str, str]:
    """One unary call as raw HTTP/2: a message with compressed-flag byte ``flag``
    under ``grpc-encoding`` ``encoding`` (None: no header); the response's headers and trailers."""
    host, port = address.rsplit(":", 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", SEARCH), (":authority", address),
               ("content-type", "application/grpc"), ("te", "trailers")]
    conn.send_headers(1, headers + ([("grpc-encoding", encoding)] if encoding is not None else []))
    conn.send_data(1, struct.pack(">BI", flag, len(body)) + body, end_stream=True)
    got: dict[str, str] = {}
    with socket.create_connection((host.strip("[]"), int(port)), timeout=30) as sock:
        sock.sendall(conn.data_to_send())
        while data := sock.recv(65536):
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    got.update(dict(event.headers))
                if isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    return got
            sock.sendall(conn.data_to_send())
    return got


@pytest.mark.parametrize("flag, encoding, body, message", [
    (1, None, REQUEST, "Compression bit set but no encoding configured"),
    (1, "identity", REQUEST, "Compression bit set but no encoding configured"),
    (0, "bogus", REQUEST, "Error parsing 'grpc-encoding' metadata"),
    (1, "bogus", REQUEST, "Error parsing 'grpc-encoding' metadata"),
    (1, "gzip", REQUEST, "Decompression failed due to zlib error"),
])
def test_malformed_compression_gets_a_named_internal_from_grpc_core_and_the_server_serves_on(
        served, flag, encoding, body, message):
    answer = _call(served, body, flag, encoding)
    assert (answer.get("grpc-status"), answer.get("grpc-message")) == ("13", message), answer
    assert _call(served, gzip.compress(REQUEST), 1, "gzip").get("grpc-status") == "0"  # well-formed gzip: served
    with channel(served) as ch:
        assert search_pb2_grpc.SearchServiceStub(ch).Search(
            search_pb2.SearchRequest(game="connect4", moves="4", simulations=8), timeout=30).simulations == 8
