"""The status contract (issue 13, kind 6): a failure answers the status its
service documents (protos/tandem/v1/*.proto), with a message that quotes the
client's input cut short -- never gRPC's RESOURCE_EXHAUSTED "metadata exceeds
limit" because the message echoed 20,000 characters, never UNKNOWN.

Each long-text case sends 20,000 characters in one string field of a real
request to a real server on loopback.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest
from conftest import loopback_config
from tandem.v1 import (
    reward_pb2,
    reward_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)

from reward_service import server as reward_server
from scheduler.main import start as start_scheduler
from search_service import server as search_server
from tandem import tensors
from tandem.device import cpu_only
from tandem.errors import MAX_DETAILS_CHARS, cap, quote
from tandem.server import build_server

C = grpc.StatusCode
LONG = "m" * 20_000
TIMEOUT_S = 10.0


def _error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def _assert_quoted(err: grpc.RpcError, code: C, starts: str) -> None:
    assert err.code() == code, (err.code(), err.details()[:200])
    assert err.details().startswith(starts), err.details()[:200]
    assert len(err.details()) <= MAX_DETAILS_CHARS and "20000 chars" in err.details(), err.details()[:200]


def test_quote_and_cap():
    assert quote("abc") == "'abc'" and quote(b"ab") == "b'ab'" and quote(7) == "'7'"
    assert quote("x" * 100) == f"{'x' * 64!r}... (100 chars)"
    assert cap("short") == "short" and cap(None) is None
    capped = cap("y" * 5000)
    assert len(capped) <= MAX_DETAILS_CHARS and capped.endswith("(5000 chars)")


@pytest.fixture(scope="module")
def reward():
    cfg = loopback_config()
    service = reward_server.start(cfg, follow_scheduler=False)
    ch = grpc.insecure_channel(cfg.reward.address)
    yield reward_pb2_grpc.RewardServiceStub(ch)
    ch.close()
    service.stop()


@pytest.fixture(scope="module")
def search():
    cfg = loopback_config(search={"backend": "cpu"})
    service = search_server.start(cfg, follow_scheduler=False)
    ch = grpc.insecure_channel(cfg.search.address)
    yield search_pb2_grpc.SearchServiceStub(ch)
    ch.close()
    service.stop()


def test_evaluate_an_unknown_long_model_name_is_not_found(reward):
    err = _error(lambda: reward.Evaluate(reward_pb2.EvaluateRequest(model=LONG), timeout=TIMEOUT_S))
    _assert_quoted(err, C.NOT_FOUND, "model: no model named 'mmm")
    err = _error(lambda: reward.ModelMetadata(reward_pb2.ModelMetadataRequest(model=LONG), timeout=TIMEOUT_S))
    _assert_quoted(err, C.NOT_FOUND, "model: no model named 'mmm")


def test_evaluate_long_tensor_and_output_names_are_invalid_argument(reward):
    spec = reward.ModelMetadata(reward_pb2.ModelMetadataRequest(model="connect4_value"), timeout=TIMEOUT_S).inputs[0]
    zeros = np.zeros([1 if d == -1 else d for d in spec.shape], tensors.numpy_dtype(spec.dtype))
    err = _error(lambda: reward.Evaluate(reward_pb2.EvaluateRequest(
        model="connect4_value", inputs=[tensors.to_proto(LONG, zeros)]), timeout=TIMEOUT_S))
    _assert_quoted(err, C.INVALID_ARGUMENT, "inputs: model 'connect4_value' has no input 'mmm")
    err = _error(lambda: reward.Evaluate(reward_pb2.EvaluateRequest(
        model="connect4_value", inputs=[tensors.to_proto(spec.name, zeros)], output_names=[LONG]), timeout=TIMEOUT_S))
    _assert_quoted(err, C.INVALID_ARGUMENT, "output_names: model 'connect4_value' has no output 'mmm")


def test_shared_memory_long_names_get_their_documented_status(reward):
    err = _error(lambda: reward.RegisterSharedMemory(reward_pb2.RegisterSharedMemoryRequest(
        client_id="c", name="r", byte_size=64, system=reward_pb2.SystemSharedMemory(key="/" + LONG)),
        timeout=TIMEOUT_S))
    assert err.code() in (C.INVALID_ARGUMENT, C.NOT_FOUND) and len(err.details()) <= MAX_DETAILS_CHARS
    assert err.details().startswith("system.key: ") and "chars)" in err.details()
    err = _error(lambda: reward.UnregisterSharedMemory(reward_pb2.UnregisterSharedMemoryRequest(
        client_id="c", name=LONG), timeout=TIMEOUT_S))
    _assert_quoted(err, C.NOT_FOUND, "region 'mmm")


def test_search_long_fields_get_their_documented_status(search):
    err = _error(lambda: search.Search(search_pb2.SearchRequest(game=LONG, simulations=8), timeout=TIMEOUT_S))
    _assert_quoted(err, C.NOT_FOUND, "game: unknown game 'mmm")
    for request, starts in (
        (search_pb2.SearchRequest(game="connect4", moves="4" * 20_000, simulations=8), "moves: "),
        (search_pb2.SearchRequest(game="connect4", moves="m" * 20_000, simulations=8), "moves: "),
        (search_pb2.SearchRequest(game="connect4", moves="4", session_id=LONG, simulations=8), "session_id: "),
    ):
        err = _error(lambda r=request: search.Search(r, timeout=TIMEOUT_S))
        assert err.code() == C.INVALID_ARGUMENT and err.details().startswith(starts), err.details()[:200]
        assert len(err.details()) <= MAX_DETAILS_CHARS


def test_scheduler_long_fields_get_their_documented_status():
    cfg = loopback_config()
    handle = start_scheduler(cfg, device=cpu_only())
    ch = grpc.insecure_channel(cfg.scheduler.address)
    stub = scheduler_pb2_grpc.SchedulerStub(ch)
    try:
        err = _error(lambda: stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=LONG), timeout=TIMEOUT_S))
        _assert_quoted(err, C.NOT_FOUND, "lease_id: unknown or expired lease 'mmm")
        err = _error(lambda: stub.Register(scheduler_pb2.RegisterRequest(
            kind=scheduler_pb2.SERVICE_KIND_SEARCH, instance="s", address=LONG), timeout=TIMEOUT_S))
        assert err.code() == C.INVALID_ARGUMENT and err.details().startswith("address: ")
    finally:
        ch.close()
        handle.stop(grace_ms=0)


# -- the guard: whatever a handler does ------------------------------------------------------------------------------
class _Careless:
    """Handlers that break the contract, to show the servers' guard holds it."""

    @staticmethod
    def echo_in_full(request: bytes, context):
        context.abort(C.NOT_FOUND, f"no such thing {request.decode()!r}")

    @staticmethod
    def raise_unmapped(request: bytes, context):
        raise ValueError(f"cannot handle {request.decode()}")

    @staticmethod
    def stream_then_fail(request: bytes, context):
        yield b"first"
        raise KeyError(request.decode())


@pytest.fixture(scope="module")
def careless():
    cfg = loopback_config()

    def register(server):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Careless", {
            "EchoInFull": grpc.unary_unary_rpc_method_handler(_Careless.echo_in_full),
            "RaiseUnmapped": grpc.unary_unary_rpc_method_handler(_Careless.raise_unmapped),
            "StreamThenFail": grpc.unary_stream_rpc_method_handler(_Careless.stream_then_fail),
        }),))
        return "test.Careless"

    running = build_server("127.0.0.1:0", cfg.search.server, cfg, [register])
    ch = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    yield ch
    ch.close()
    running.server.stop(0)


def test_every_status_message_is_capped(careless):
    err = _error(lambda: careless.unary_unary("/test.Careless/EchoInFull")(LONG.encode(), timeout=TIMEOUT_S))
    assert err.code() == C.NOT_FOUND and err.details().startswith("no such thing 'mmm")
    assert len(err.details()) <= MAX_DETAILS_CHARS and err.details().endswith("chars)")


def test_an_unmapped_failure_is_internal_not_unknown(careless):
    err = _error(lambda: careless.unary_unary("/test.Careless/RaiseUnmapped")(LONG.encode(), timeout=TIMEOUT_S))
    assert err.code() == C.INTERNAL and err.details().startswith("/test.Careless/RaiseUnmapped: internal error (ValueError")
    assert len(err.details()) <= MAX_DETAILS_CHARS
    call = careless.unary_stream("/test.Careless/StreamThenFail")(LONG.encode(), timeout=TIMEOUT_S)
    assert next(call) == b"first"
    err = _error(lambda: next(call))
    assert err.code() == C.INTERNAL and "KeyError" in err.details() and len(err.details()) <= MAX_DETAILS_CHARS
    assert careless.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=TIMEOUT_S) is not None  # still serving
