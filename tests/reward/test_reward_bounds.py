"""Every Evaluate is bounded in its own unit (issue 13, kind 2): repeated
fields by the model's own counts (checked before any per-item work), and the
bytes of the requests in flight by ``reward.max_bytes_in_flight``
(RESOURCE_EXHAUSTED past it; bulk may fill 3/4, the rest is for critical work)."""
from __future__ import annotations

import grpc
import pytest
from conftest import loopback_config
from tandem.v1 import reward_pb2, reward_pb2_grpc
from test_reward_service import boards, held

from reward_service import server as reward_server
from reward_service.admission import BULK_BYTES_FRACTION, INPUT_COPIES, OUTPUT_COPIES, ByteBudget, OverBudget
from tandem import tensors
from tandem.server import channel

MODEL = "connect4_value"
# Bytes in flight: a 100-board request (8.4 kB serialized) counts 3 x 8.4 kB + 2 x 100 rows x 32 B of
# outputs = 31.7 kB (reward_service/admission.py): two fit the limit, but not 3/4 of it (bulk's share).
LIMIT = 70_000
BULK, CRITICAL = reward_pb2.REQUEST_CLASS_BULK, reward_pb2.REQUEST_CLASS_CRITICAL


@pytest.fixture(scope="module")
def served():
    cfg = loopback_config(reward={"max_bytes_in_flight": LIMIT, "execution_provider": "cpu",
                                  "models": [{"name": MODEL, "path": "reward_service/models/connect4_value.onnx"}]})
    service = reward_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.reward.address)
    yield service, reward_pb2_grpc.RewardServiceStub(ch)
    ch.close()
    service.stop()


def _request(n: int, request_class=BULK, **kw) -> reward_pb2.EvaluateRequest:
    return reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", boards(n))],
                                      request_class=request_class, **kw)


def _call(stub, request):
    try:
        return stub.Evaluate(request, timeout=30)
    except grpc.RpcError as exc:
        return exc


@pytest.mark.parametrize("why, request_fields, message", [
    ("a thousand output names", dict(output_names=["value"] * 1000),
     "output_names: 1000 names, but model 'connect4_value' has 2 outputs"),
    # A large message of many entries is refused before it is parsed (tandem/guard.py).
    ("a million output names", dict(output_names=["value"] * 1_000_000),
     "request: more than 4096 fields in a"),
    ("a repeated output name", dict(output_names=["value", "value"]), "output_names: 'value' given twice"),
    ("six hundred inputs", dict(extra_inputs=600), "inputs: tensor 'board' given twice"),  # 62 kB: parsed
    ("a hundred thousand inputs", dict(extra_inputs=100_000), "request: more than 4096 fields in a"),
    ("a shape of a million dimensions", dict(shape=[1] * 1_000_000),
     "inputs['board'].shape: expected [-1, 2, 6, 7] (-1: any), got 1000000 dimensions"),
])
def test_repeated_fields_are_bounded_by_the_model(served, why, request_fields, message):
    _, stub = served
    request = _request(1)
    request.output_names.extend(request_fields.get("output_names", []))
    request.inputs.extend([request.inputs[0]] * request_fields.get("extra_inputs", 0))
    if "shape" in request_fields:
        del request.inputs[0].shape[:]
        request.inputs[0].shape.extend(request_fields["shape"])
    reply = _call(stub, request)
    assert isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in reply.details() and len(reply.details()) < 300
    assert not isinstance(_call(stub, _request(2)), grpc.RpcError)  # still serving


def test_bytes_in_flight_are_bounded_bulk_first(served):
    service, stub = served
    budget = service.servicer.budget
    with held(service, MODEL) as (pool, entered, _):
        first = pool.submit(_call, stub, _request(100))  # nothing in flight: admitted, held running
        assert entered.wait(10)
        assert budget.held == INPUT_COPIES * _request(100).ByteSize() + OUTPUT_COPIES * 100 * (1 + 7) * 4
        second = _call(stub, _request(100))  # two bulk requests would pass 3/4 of the limit
        assert isinstance(second, grpc.RpcError) and second.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_bytes_in_flight" in second.details() and f"limit of {int(LIMIT * BULK_BYTES_FRACTION)}" in second.details()
        critical = _call(stub, _request(100, CRITICAL))  # within the whole limit: served past the held bulk run
        assert not isinstance(critical, grpc.RpcError), critical
        assert tensors.from_proto(critical.outputs[0]).shape == (100, 1)
    assert not isinstance(first.result(), grpc.RpcError)
    assert budget.held == 0  # everything answered, nothing left counted
    alone = _call(stub, _request(300))  # counts more than the limit, but alone: served
    assert not isinstance(alone, grpc.RpcError) and alone.batch_size == 300


def test_byte_budget_releases_on_error():
    budget = ByteBudget(100)
    with pytest.raises(RuntimeError), budget.admit(90, critical=False):
        assert budget.held == 90
        with pytest.raises(OverBudget), budget.admit(20, critical=True):
            pass
        raise RuntimeError("the call failed")
    assert budget.held == 0
    with budget.admit(1000, critical=False):  # nothing in flight: admitted whatever its size
        assert budget.held == 1000
    unbounded = ByteBudget(0)
    with unbounded.admit(10**12, critical=False), unbounded.admit(10**12, critical=False):
        assert unbounded.held == 2 * 10**12


def test_a_request_grows_its_bytes_in_flight_within_the_limit():
    budget = ByteBudget(100)
    with budget.admit(40, critical=True) as first:
        first.grow(20)  # its outputs, once its rows are known
        assert budget.held == 60 and first.nbytes == 60
        with budget.admit(30, critical=True) as second:
            with pytest.raises(OverBudget, match="this one's 50 would pass the limit of 100"):
                second.grow(20)
            assert budget.held == 90  # the refused growth holds nothing
    assert budget.held == 0
    with budget.admit(90, critical=True) as alone:
        alone.grow(500)  # alone in flight: may hold any amount
        assert budget.held == 590


def test_cpu_sessions_share_one_arena_without_memory_patterns():
    """A CPU session's memory is the process's one ONNX Runtime arena, with no
    per-shape memory patterns: each session's own arena kept twice its largest
    run's working set per session for good (issue 41, 12 x 37 MiB batches:
    +1.3 GB resident; reward_service/session.py, shared_cpu_arena)."""
    from reward_service.session import ModelSession
    from tandem.config import ModelConfig, RewardConfig

    cfg = RewardConfig(execution_provider="cpu")
    for model in ("connect4_value", "frame_reward"):
        session = ModelSession(ModelConfig(name=model, path=f"reward_service/models/{model}.onnx"), cfg)
        for runner in session.lane_runners():
            options = runner.session.get_session_options()
            assert options.enable_mem_pattern is False
            assert options.get_session_config_entry("session.use_env_allocators") == "1"
