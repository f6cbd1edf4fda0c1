"""Bad input over real gRPC, for every RPC of the three services.

Hypothesis generates malformed requests -- wrong dtypes, shapes and byte
lengths; huge, negative, NaN and infinite numbers; text that is no move
string; impossible boards; empty and oversized batches -- and, through a
generic channel with no serializer, raw bytes that are not a valid protobuf
message or hold invalid UTF-8 in a string field. Every answer must be OK or a
clear status (INVALID_ARGUMENT, NOT_FOUND, ... per RPC, never UNKNOWN or
INTERNAL), and the server must answer the next valid call. Figures (inputs
tried per RPC and their outcomes) go to ``runs/reliability/bad_input.json``.
"""
from __future__ import annotations

import collections
import itertools

import grpc
import numpy as np
import onnx
import onnx.helper as oh
import pytest
from conftest import loopback_config
from fuzz import strategies as S
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tandem.v1 import (
    reward_pb2,
    reward_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)

from loadtest.reliability_figures import BadInputFigures, RpcOutcomes, save_figures
from reward_service import server as reward_server
from scheduler.main import start as start_scheduler
from search_service import server as search_server
from tandem import tensors
from tandem.device import cpu_only

C = grpc.StatusCode
NEVER = {C.UNKNOWN, C.INTERNAL}
MAX_MESSAGE_BYTES = 1 << 20
MAX_BATCH = 64
TIMEOUT_S = 10.0
EXAMPLES = 250  # per property; the whole file stays well under a minute on 2 cores
PROPS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                        HealthCheck.data_too_large, HealthCheck.large_base_example])

SEARCH = "/tandem.v1.SearchService/"
REWARD = "/tandem.v1.RewardService/"
SCHED = "/tandem.v1.Scheduler/"

# What each RPC may answer to bad input (besides OK).
ALLOWED = {
    "Search": {C.INVALID_ARGUMENT, C.NOT_FOUND},
    "ListGames": {C.INVALID_ARGUMENT},
    "Evaluate": {C.INVALID_ARGUMENT, C.NOT_FOUND, C.RESOURCE_EXHAUSTED},
    "ModelMetadata": {C.INVALID_ARGUMENT, C.NOT_FOUND},
    "ListModels": {C.INVALID_ARGUMENT},
    "Register": {C.INVALID_ARGUMENT, C.ALREADY_EXISTS, C.RESOURCE_EXHAUSTED},
    "WatchAssignments": {C.INVALID_ARGUMENT, C.NOT_FOUND, C.RESOURCE_EXHAUSTED},
    "ReportLoad": {C.INVALID_ARGUMENT, C.NOT_FOUND},
    "Status": {C.INVALID_ARGUMENT},
}
FIGURES: dict[str, collections.Counter] = {rpc: collections.Counter() for rpc in ALLOWED}


def _mean_model(path) -> str:
    """A float-input model (so NaN/Inf inputs reach a real check): y = mean(x, axis=1), x float32 [N, 4]."""
    node = oh.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=0)
    graph = oh.make_graph([node], "mean", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N"])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)
    return str(path)


class Stack:
    def __init__(self, tmp):
        server = {"max_message_bytes": MAX_MESSAGE_BYTES}
        models = [{"name": "connect4_value", "path": "reward_service/models/connect4_value.onnx", "max_batch_size": MAX_BATCH},
                  {"name": "mean", "path": _mean_model(tmp / "mean.onnx"), "max_batch_size": MAX_BATCH}]
        self.cfg = cfg = loopback_config(
            reward={"models": models, "execution_provider": "cpu", "server": server},
            search={"backend": "cpu", "max_simulations": 64, "max_deadline_ms": 20, "parallel_sims": 4,
                    "max_sessions": 16, "server": server},
            scheduler={"lease_ttl_ms": 300, "gpu_memory_bytes": 1 << 30, "policy": "dynamic", "server": server},
        )
        self.reward = reward_server.start(cfg, follow_scheduler=False)
        self.search = search_server.start(cfg, follow_scheduler=False)
        self.scheduler = start_scheduler(cfg, device=cpu_only())
        opts = [("grpc.max_send_message_length", 8 * MAX_MESSAGE_BYTES)]
        self.channels = {name: grpc.insecure_channel(getattr(cfg, name).address, options=opts)
                         for name in ("search", "reward", "scheduler")}
        self.search_stub = search_pb2_grpc.SearchServiceStub(self.channels["search"])
        self.reward_stub = reward_pb2_grpc.RewardServiceStub(self.channels["reward"])
        self.sched_stub = scheduler_pb2_grpc.SchedulerStub(self.channels["scheduler"])

    def close(self):
        for ch in self.channels.values():
            ch.close()
        self.search.stop()
        self.reward.stop()
        self.scheduler.stop(grace_ms=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("bad_input"))
    yield s
    s.close()
    save_figures(BadInputFigures(
        examples_per_property=EXAMPLES,
        rpcs={rpc: RpcOutcomes(inputs=sum(c.values()), outcomes=dict(sorted(c.items()))) for rpc, c in FIGURES.items()},
    ))


# -- helpers ------------------------------------------------------------------------------------------
def _code(fn) -> tuple[C, str]:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return C.OK, ""


def _judge(rpc: str, code: C, details: str) -> None:
    FIGURES[rpc][code.name] += 1
    assert code not in NEVER, f"{rpc}: {code.name}: {details}"
    assert code == C.OK or code in ALLOWED[rpc], f"{rpc}: unexpected {code.name}: {details}"
    if code != C.OK:
        assert details, f"{rpc}: {code.name} without a message"


def _still_serving(stack: Stack, service: str) -> None:
    """The server answers the next valid call."""
    if service == "search":
        r = stack.search_stub.Search(search_pb2.SearchRequest(game="connect4", moves="4", simulations=4), timeout=TIMEOUT_S)
        assert r.simulations == 4
    elif service == "reward":
        board = tensors.to_proto("board", np.zeros((1, 2, 6, 7), np.uint8))
        r = stack.reward_stub.Evaluate(reward_pb2.EvaluateRequest(model="connect4_value", inputs=[board]), timeout=TIMEOUT_S)
        assert len(r.outputs) >= 1
    else:
        assert stack.sched_stub.Status(scheduler_pb2.StatusRequest(), timeout=TIMEOUT_S).policy == "dynamic"


def _raw_unary(stack: Stack, service: str, method: str, payload: bytes) -> tuple[C, str]:
    call = stack.channels[service].unary_unary(method)  # no serializers: bytes as they are
    return _code(lambda: call(payload, timeout=TIMEOUT_S))


def _first_of_stream(call) -> None:
    try:
        next(call)
    except StopIteration:
        pass
    finally:
        call.cancel()


# -- SearchService ---------------------------------------------------------------------------------------
@PROPS
@given(request=S.search_requests(max_simulations=64))
def test_search_bad_fields(stack, request):
    code, details = _code(lambda: stack.search_stub.Search(request, timeout=TIMEOUT_S))
    _judge("Search", code, details)
    _still_serving(stack, "search")


@PROPS
@given(payload=S.wire_bytes(S.search_requests(max_simulations=64)))
def test_search_raw_bytes(stack, payload):
    _judge("Search", *_raw_unary(stack, "search", SEARCH + "Search", payload))
    _still_serving(stack, "search")


@PROPS
@given(payload=S.wire_bytes(st.just(search_pb2.ListGamesRequest())))
def test_list_games_raw_bytes(stack, payload):
    code, details = _raw_unary(stack, "search", SEARCH + "ListGames", payload)
    _judge("ListGames", code, details)
    _still_serving(stack, "search")


# -- RewardService -----------------------------------------------------------------------------------------
_evaluate_requests = st.one_of(
    S.evaluate_requests(max_batch=MAX_BATCH, other_models=("mean",)),
    S.evaluate_requests(model="mean", input_name="x", spec_shape=(4,), dtype=reward_pb2.DATA_TYPE_FLOAT32,
                        max_batch=MAX_BATCH, outputs=("y",), other_models=("connect4_value",)),
)


@PROPS
@given(request=_evaluate_requests)
def test_evaluate_bad_tensors(stack, request):
    code, details = _code(lambda: stack.reward_stub.Evaluate(request, timeout=TIMEOUT_S))
    _judge("Evaluate", code, details)
    _still_serving(stack, "reward")


@PROPS
@given(payload=S.wire_bytes(_evaluate_requests))
def test_evaluate_raw_bytes(stack, payload):
    _judge("Evaluate", *_raw_unary(stack, "reward", REWARD + "Evaluate", payload))
    _still_serving(stack, "reward")


@settings(PROPS, max_examples=10)
@given(extra=st.integers(1, MAX_MESSAGE_BYTES))
@pytest.mark.slow
def test_evaluate_oversized_message_is_refused(stack, extra):
    """A message over ``max_message_bytes`` is refused by gRPC before it reaches our code."""
    n = (MAX_MESSAGE_BYTES + extra) // 84 + 1
    board = reward_pb2.Tensor(name="board", dtype=reward_pb2.DATA_TYPE_UINT8, shape=[n, 2, 6, 7], data=b"\0" * (n * 84))
    code, details = _code(lambda: stack.reward_stub.Evaluate(
        reward_pb2.EvaluateRequest(model="connect4_value", inputs=[board]), timeout=TIMEOUT_S))
    _judge("Evaluate", code, details)
    assert code == C.RESOURCE_EXHAUSTED
    _still_serving(stack, "reward")


@PROPS
@given(request=st.builds(reward_pb2.ModelMetadataRequest, model=st.one_of(S.text, S.long_text, st.just("connect4_value"))))
def test_model_metadata_bad_names(stack, request):
    code, details = _code(lambda: stack.reward_stub.ModelMetadata(request, timeout=TIMEOUT_S))
    _judge("ModelMetadata", code, details)
    _still_serving(stack, "reward")


@PROPS
@given(payload=S.wire_bytes(st.builds(reward_pb2.ModelMetadataRequest, model=S.mostly(st.just("mean"), S.text))))
def test_model_metadata_raw_bytes(stack, payload):
    _judge("ModelMetadata", *_raw_unary(stack, "reward", REWARD + "ModelMetadata", payload))
    _still_serving(stack, "reward")


@PROPS
@given(payload=S.wire_bytes(st.just(reward_pb2.ListModelsRequest())))
def test_list_models_raw_bytes(stack, payload):
    _judge("ListModels", *_raw_unary(stack, "reward", REWARD + "ListModels", payload))
    _still_serving(stack, "reward")


# -- Scheduler ----------------------------------------------------------------------------------------------
@PROPS
@given(request=S.register_requests())
def test_register_bad_fields(stack, request):
    code, details = _code(lambda: stack.sched_stub.Register(request, timeout=TIMEOUT_S))
    _judge("Register", code, details)
    _still_serving(stack, "scheduler")


@PROPS
@given(payload=S.wire_bytes(S.register_requests()))
def test_register_raw_bytes(stack, payload):
    _judge("Register", *_raw_unary(stack, "scheduler", SCHED + "Register", payload))
    _still_serving(stack, "scheduler")


_pids = itertools.count(1000)


def _live_lease(stack: Stack, instance: str) -> str:
    """A fresh lease, of a new instance (a live lease is never taken over; the old ones lapse)."""
    pid = next(_pids)
    return stack.sched_stub.Register(scheduler_pb2.RegisterRequest(
        kind=scheduler_pb2.SERVICE_KIND_SEARCH, instance=f"{instance}-{pid}", address="127.0.0.1:1",
        stream_priorities=[0], pid=pid), timeout=TIMEOUT_S).lease.lease_id


@PROPS
@given(lease_id=st.one_of(S.text, S.long_text, st.just("")), live=st.booleans(), n=st.integers(0, 3))
def test_watch_assignments_bad_leases(stack, lease_id, live, n):
    if live:
        lease_id = _live_lease(stack, f"watch-{n}") or lease_id
    call = stack.sched_stub.WatchAssignments(scheduler_pb2.WatchAssignmentsRequest(lease_id=lease_id), timeout=TIMEOUT_S)
    _judge("WatchAssignments", *_code(lambda: _first_of_stream(call)))
    _still_serving(stack, "scheduler")


@PROPS
@given(payload=S.wire_bytes(st.builds(scheduler_pb2.WatchAssignmentsRequest, lease_id=S.text)))
def test_watch_assignments_raw_bytes(stack, payload):
    call = stack.channels["scheduler"].unary_stream(SCHED + "WatchAssignments")(payload, timeout=TIMEOUT_S)
    _judge("WatchAssignments", *_code(lambda: _first_of_stream(call)))
    _still_serving(stack, "scheduler")


@PROPS
@given(report=S.load_reports(), live=st.booleans(), n=st.integers(0, 3))
def test_report_load_bad_fields(stack, report, live, n):
    if live:  # NaN, infinite and absurd figures against a real lease: sanitised, never refused
        report.lease_id = _live_lease(stack, f"load-{n}") or report.lease_id
    code, details = _code(lambda: stack.sched_stub.ReportLoad(report, timeout=TIMEOUT_S))
    _judge("ReportLoad", code, details)
    status = stack.sched_stub.Status(scheduler_pb2.StatusRequest(), timeout=TIMEOUT_S)
    assert all(np.isfinite(s.urgency) and s.urgency >= 0 for s in status.services)


@PROPS
@given(payload=S.wire_bytes(S.load_reports()))
def test_report_load_raw_bytes(stack, payload):
    _judge("ReportLoad", *_raw_unary(stack, "scheduler", SCHED + "ReportLoad", payload))
    _still_serving(stack, "scheduler")


@PROPS
@given(payload=S.wire_bytes(st.just(scheduler_pb2.StatusRequest())))
def test_status_raw_bytes(stack, payload):
    _judge("Status", *_raw_unary(stack, "scheduler", SCHED + "Status", payload))
    _still_serving(stack, "scheduler")


# -- named cases the properties must cover -------------------------------------------------------------------
@pytest.mark.parametrize("service, method, payload", [
    ("search", SEARCH + "Search", b"\x12\x02\xff\xfe"),  # moves: invalid UTF-8
    ("search", SEARCH + "Search", b"\x0a\x01\xc0"),  # game: truncated UTF-8
    ("search", SEARCH + "ListGames", b"\xff\xff\xff\xff"),  # corrupt wire format
    ("reward", REWARD + "Evaluate", b"\x0a\x03\xed\xa0\x80"),  # model: a UTF-8 surrogate
    ("reward", REWARD + "Evaluate", b"\x12\x7f"),  # inputs: length past the end
    ("reward", REWARD + "ModelMetadata", b"\x0a\x02a\xfe"),
    ("reward", REWARD + "ListModels", b"\x08"),  # a tag with no value
    ("scheduler", SCHED + "Register", b"\x12\x01\xff"),  # instance: invalid UTF-8
    ("scheduler", SCHED + "ReportLoad", b"\x0a\x01\xff"),  # lease_id: invalid UTF-8
    ("scheduler", SCHED + "Status", b"\xff"),
])
def test_undecodable_requests_get_invalid_argument(stack, service, method, payload):
    code, details = _raw_unary(stack, service, method, payload)
    assert code == C.INVALID_ARGUMENT and details.startswith("request: not a valid message"), (code, details)
    _still_serving(stack, service)


def test_undecodable_watch_request_gets_invalid_argument(stack):
    call = stack.channels["scheduler"].unary_stream(SCHED + "WatchAssignments")(b"\x0a\x01\xff", timeout=TIMEOUT_S)
    code, details = _code(lambda: _first_of_stream(call))
    assert code == C.INVALID_ARGUMENT and "not a valid message" in details


def _board(shape, dtype=reward_pb2.DATA_TYPE_UINT8, data=None, name="board"):
    n = int(np.prod(shape)) if all(d >= 0 for d in shape) else 0
    return reward_pb2.Tensor(name=name, dtype=dtype, shape=shape, data=b"\0" * n if data is None else data)


_NAN4 = np.array([[0, np.nan, 1, 2]], np.float32).tobytes()
_INF4 = np.array([[np.inf, 0, 1, 2]], np.float32).tobytes()


@pytest.mark.parametrize("model, tensor, message", [
    ("connect4_value", _board([0, 2, 6, 7]), "empty batch"),
    ("connect4_value", _board([MAX_BATCH + 1, 2, 6, 7]), f"exceeds max_batch_size {MAX_BATCH}"),
    ("connect4_value", _board([1, 2, 6, 7], data=b"\0" * 83), "83 bytes"),
    ("connect4_value", _board([1, 2, 6, 7], reward_pb2.DATA_TYPE_FLOAT32, b"\0" * 336), "dtype: expected DATA_TYPE_UINT8"),
    ("connect4_value", _board([1, 2, 6, 7], 99), "dtype"),
    ("connect4_value", _board([1, 2, 7, 6]), "shape: expected"),
    ("connect4_value", _board([1, 84]), "shape: expected"),
    ("connect4_value", _board([-1, 2, 6, 7], data=b""), "negative dimension"),
    ("connect4_value", _board([2**40, 2, 6, 7], data=b""), "exceeds max_batch_size"),
    ("connect4_value", _board([1, 2, 6, 7], name="obs"), "has no input 'obs'"),
    ("mean", _board([1, 4], reward_pb2.DATA_TYPE_FLOAT32, _NAN4, name="x"), "NaN or Inf"),
    ("mean", _board([1, 4], reward_pb2.DATA_TYPE_FLOAT32, _INF4, name="x"), "NaN or Inf"),
], ids=["empty batch", "oversized batch", "short data", "float32 board", "unknown dtype", "transposed", "flat",
        "negative batch", "huge batch", "unknown input", "NaN", "Inf"])
def test_named_bad_tensors(stack, model, tensor, message):
    code, details = _code(lambda: stack.reward_stub.Evaluate(
        reward_pb2.EvaluateRequest(model=model, inputs=[tensor]), timeout=TIMEOUT_S))
    assert code == C.INVALID_ARGUMENT and message in details and details.startswith("inputs"), (code, details)
    _still_serving(stack, "reward")
