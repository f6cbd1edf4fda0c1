"""RewardService over real gRPC on loopback, with the shipped ONNX model."""
from __future__ import annotations

import grpc
import numpy as np
import onnx
import onnx.helper as oh
import pytest
from conftest import loopback_config
from tandem.v1 import reward_pb2, reward_pb2_grpc

from reward_service import server as reward_server
from tandem import tensors
from tandem.server import channel
from tandem.deadline import Deadline

MODEL = "connect4_value"


def _float_model(path) -> str:
    """A real ONNX model with a float input (to test NaN/Inf handling): y = mean(x, axis=1)."""
    node = oh.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=0)
    graph = oh.make_graph(
        [node], "mean",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N"])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)
    return str(path)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    mean_path = _float_model(tmp_path_factory.mktemp("models") / "mean.onnx")
    models = [
        {"name": MODEL, "path": "reward_service/models/connect4_value.onnx", "max_batch_size": 64},
        {"name": "mean_reject", "path": mean_path},
    ]
    cfg = loopback_config(reward={"models": models, "execution_provider": "auto"})
    service = reward_server.start(cfg, follow_scheduler=False)
    # A second server with nonfinite_inputs: pass.
    cfg_pass = loopback_config(reward={"models": [{"name": "mean_pass", "path": mean_path}], "nonfinite_inputs": "pass"})
    service_pass = reward_server.start(cfg_pass, follow_scheduler=False)
    ch, ch_pass = channel(cfg.reward.address), channel(cfg_pass.reward.address)
    yield reward_pb2_grpc.RewardServiceStub(ch), reward_pb2_grpc.RewardServiceStub(ch_pass)
    ch.close()
    ch_pass.close()
    service.stop()
    service_pass.stop()


def boards(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    return (rng.random((n, 2, 6, 7)) < 0.2).astype(np.uint8)


def evaluate(stub, array, name="board", model=MODEL, **kw):
    return stub.Evaluate(reward_pb2.EvaluateRequest(model=model, inputs=[tensors.to_proto(name, array)], **kw), timeout=10)


def test_metadata_reports_the_provider_in_use(stubs):
    stub, _ = stubs
    meta = stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL))
    assert meta.execution_provider in meta.available_providers
    assert [(i.name, i.dtype, list(i.shape)) for i in meta.inputs] == [("board", reward_pb2.DATA_TYPE_UINT8, [-1, 2, 6, 7])]
    assert {o.name for o in meta.outputs} == {"value", "policy_logits"}
    assert len(meta.version) == 12 and meta.max_batch_size == 64
    assert stub.ListModels(reward_pb2.ListModelsRequest()).models == [MODEL, "mean_reject"]


@pytest.mark.parametrize("n", [1, 8, 64])
def test_evaluate_batch(stubs, n):
    stub, _ = stubs
    reply = evaluate(stub, boards(n))
    out = {t.name: tensors.from_proto(t) for t in reply.outputs}
    assert out["value"].shape == (n, 1) and out["value"].dtype == np.float32
    assert np.all(np.abs(out["value"]) <= 1.0)
    assert out["policy_logits"].shape == (n, 7)
    assert reply.execution_provider.endswith("ExecutionProvider") and reply.compute_ms > 0


def test_batch_rows_are_independent(stubs):
    stub, _ = stubs
    b = boards(8)
    whole = tensors.from_proto(evaluate(stub, b, output_names=["value"]).outputs[0])
    single = np.concatenate([tensors.from_proto(evaluate(stub, b[i : i + 1], output_names=["value"]).outputs[0]) for i in range(8)])
    np.testing.assert_allclose(whole, single, atol=1e-5)


def _tensor(name="board", dtype=reward_pb2.DATA_TYPE_UINT8, shape=(1, 2, 6, 7), data=None):
    data = bytes(int(np.prod(shape)) * tensors.numpy_dtype(dtype).itemsize) if data is None else data
    return reward_pb2.Tensor(name=name, dtype=dtype, shape=shape, data=data)


BAD = [
    ("unknown model", dict(model="nope", inputs=[_tensor()]), grpc.StatusCode.NOT_FOUND, "model: no model named 'nope'"),
    ("wrong dtype", dict(inputs=[_tensor(dtype=reward_pb2.DATA_TYPE_FLOAT32)]), grpc.StatusCode.INVALID_ARGUMENT, "dtype: expected DATA_TYPE_UINT8"),
    ("unset dtype", dict(inputs=[_tensor(dtype=0, data=b"")]), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    ("wrong rank", dict(inputs=[_tensor(shape=(1, 84))]), grpc.StatusCode.INVALID_ARGUMENT, "shape: expected [-1, 2, 6, 7]"),
    ("wrong dim", dict(inputs=[_tensor(shape=(1, 2, 7, 6))]), grpc.StatusCode.INVALID_ARGUMENT, "shape: expected"),
    ("short data", dict(inputs=[_tensor(data=b"\0" * 83)]), grpc.StatusCode.INVALID_ARGUMENT, "83 bytes, but shape [1, 2, 6, 7]"),
    ("long data", dict(inputs=[_tensor(data=b"\0" * 85)]), grpc.StatusCode.INVALID_ARGUMENT, "85 bytes"),
    ("empty batch", dict(inputs=[_tensor(shape=(0, 2, 6, 7))]), grpc.StatusCode.INVALID_ARGUMENT, "empty batch"),
    ("batch too large", dict(inputs=[_tensor(shape=(65, 2, 6, 7))]), grpc.StatusCode.INVALID_ARGUMENT, "exceeds max_batch_size 64"),
    ("negative dim", dict(inputs=[_tensor(shape=(1, 2, -6, 7), data=b"")]), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
    ("missing input", dict(inputs=[]), grpc.StatusCode.INVALID_ARGUMENT, "missing input 'board'"),
    ("unknown input", dict(inputs=[_tensor(), _tensor(name="extra")]), grpc.StatusCode.INVALID_ARGUMENT, "no input 'extra'"),
    ("repeated input", dict(inputs=[_tensor(), _tensor()]), grpc.StatusCode.INVALID_ARGUMENT, "given twice"),
    ("unknown output", dict(inputs=[_tensor()], output_names=["q"]), grpc.StatusCode.INVALID_ARGUMENT, "no output 'q'"),
]


@pytest.mark.parametrize("why, fields, code, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_status_and_the_server_keeps_serving(stubs, why, fields, code, message):
    stub, _ = stubs
    fields.setdefault("model", MODEL)
    with pytest.raises(grpc.RpcError) as info:
        stub.Evaluate(reward_pb2.EvaluateRequest(**fields), timeout=10)
    assert info.value.code() == code
    assert message in info.value.details()
    assert evaluate(stub, boards(2)).outputs  # still serving


def test_evaluate_without_a_deadline(stubs):
    stub, _ = stubs
    for prio in (reward_pb2.REQUEST_CLASS_CRITICAL, reward_pb2.REQUEST_CLASS_BULK):
        reply = stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", boards(2))],
                                                         request_class=prio))  # no timeout: no deadline
        assert tensors.from_proto(reply.outputs[0]).shape[0] == 2


def test_metadata_of_unknown_model(stubs):
    stub, _ = stubs
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model="ghost"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_inputs_reject_or_pass(stubs, bad):
    stub, stub_pass = stubs
    x = np.ones((3, 4), np.float32)
    x[1, 2] = bad
    with pytest.raises(grpc.RpcError) as info:
        evaluate(stub, x, name="x", model="mean_reject")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN or Inf" in info.value.details()
    y = tensors.from_proto(evaluate(stub_pass, x, name="x", model="mean_pass").outputs[0])
    assert y[0] == 1.0 and y[2] == 1.0 and not np.isfinite(y[1])  # other rows unaffected


# -- the dynamic batcher behind Evaluate ------------------------------------------------------

import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from contextlib import contextmanager  # noqa: E402


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """A server whose queues are small, for tests that hold a model's worker."""
    mean_path = _float_model(tmp_path_factory.mktemp("models") / "mean.onnx")
    models = [
        {"name": MODEL, "path": "reward_service/models/connect4_value.onnx", "max_batch_size": 64},
        {"name": "mean", "path": mean_path},
    ]
    cfg = loopback_config(reward={"models": models, "execution_provider": "auto", "max_queue_size": 3,
                                  "max_queue_delay_us": 0, "nonfinite_inputs": "pass"})
    service = reward_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.reward.address)
    yield service, reward_pb2_grpc.RewardServiceStub(ch)
    ch.close()
    service.stop()


@contextmanager
def held(service, model, lane=reward_pb2.REQUEST_CLASS_BULK):
    """Holds the worker of the model's ``lane`` (default: the bulk lane) inside
    a run until the block ends; the other lane runs on. Yields the list of
    that lane's batches that run (recorded as they start)."""
    batcher = service.servicer.batchers[model]
    original, gate, entered, seen = batcher._run, threading.Event(), threading.Event(), []

    def run(batch):
        if batch.lane != lane:
            return original(batch)
        seen.append(batch)
        entered.set()
        gate.wait(20)
        return original(batch)

    batcher._run = run
    pool = ThreadPoolExecutor(max_workers=16)
    try:
        yield pool, entered, seen
    finally:
        gate.set()
        pool.shutdown(wait=True)
        batcher._run = original


def _call(stub, array, name="board", model=MODEL, timeout=20, **kw):
    """Evaluate, returning the RpcError instead of raising it."""
    try:
        request = reward_pb2.EvaluateRequest(model=model, inputs=[tensors.to_proto(name, array)], **kw)
        return stub.Evaluate(request, timeout=timeout)
    except grpc.RpcError as exc:
        return exc


def test_queued_requests_merge_and_bad_ones_are_refused_without_touching_them(batched):
    service, stub = batched
    b = boards(7)
    alone = [tensors.from_proto(evaluate(stub, b[i : i + 1], output_names=["value"]).outputs[0]) for i in range(3)]
    with held(service, MODEL) as (pool, entered, seen):
        blocker = pool.submit(_call, stub, b[3:4])
        assert entered.wait(10)
        good = [pool.submit(_call, stub, b[i : i + 1], output_names=["value"]) for i in range(3)]
        time.sleep(0.3)  # the three are queued behind the held run
        # Refused on arrival, while the worker is still held: validated before queueing.
        bad = _call(stub, b[:1].astype(np.float32))
        assert isinstance(bad, grpc.RpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    replies = [f.result() for f in good]
    assert all(not isinstance(r, grpc.RpcError) for r in replies), replies
    assert blocker.result().outputs
    for r, a in zip(replies, alone):
        np.testing.assert_allclose(tensors.from_proto(r.outputs[0]), a, atol=1e-5)
        assert r.batch_size == 3  # the three queued requests ran as one batch
    assert len(seen) == 2


def test_nan_rows_merged_with_others_leave_them_alone(batched):
    service, stub = batched
    x = np.ones((2, 4), np.float32)
    y = np.ones((2, 4), np.float32)
    y[0, 1] = np.nan
    with held(service, "mean") as (pool, entered, seen):
        pool.submit(_call, stub, x, name="x", model="mean")
        assert entered.wait(10)
        clean = pool.submit(_call, stub, x * 3, name="x", model="mean")
        dirty = pool.submit(_call, stub, y, name="x", model="mean")
        time.sleep(0.3)
    c, d = clean.result(), dirty.result()
    assert c.batch_size == 4
    assert tensors.from_proto(c.outputs[0]).tolist() == [3.0, 3.0]
    got = tensors.from_proto(d.outputs[0])
    assert np.isnan(got[0]) and got[1] == 1.0


def test_a_request_whose_deadline_passes_in_the_queue_is_not_run(batched):
    service, stub = batched
    marker = np.full((1, 4), 7.0, np.float32)
    with held(service, "mean") as (pool, entered, seen):
        pool.submit(_call, stub, np.ones((1, 4), np.float32), name="x", model="mean")
        assert entered.wait(10)
        late = _call(stub, marker, name="x", model="mean", timeout=0.3)
        assert isinstance(late, grpc.RpcError) and late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.2)
    ran = [r.feeds["x"] for batch in seen for r in batch.requests]
    assert not any((a == 7.0).all() for a in ran)
    assert service.servicer.batchers["mean"].stats()["expired"] >= 1
    assert evaluate(stub, marker, name="x", model="mean").outputs  # still serving


def test_a_full_queue_sheds_with_resource_exhausted(batched):
    service, stub = batched
    one = np.ones((1, 4), np.float32)
    with held(service, "mean") as (pool, entered, seen):
        pool.submit(_call, stub, one, name="x", model="mean")
        assert entered.wait(10)
        queued = [pool.submit(_call, stub, one * (i + 2), name="x", model="mean") for i in range(3)]
        deadline = time.monotonic() + 5
        while service.servicer.batchers["mean"].stats()["queued"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = _call(stub, one, name="x", model="mean")
        assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in refused.details()
        # A critical request displaces the newest bulk one instead of being refused.
        crit = pool.submit(_call, stub, one * 9, name="x", model="mean",
                           request_class=reward_pb2.REQUEST_CLASS_CRITICAL)
        time.sleep(0.3)
    codes = [r.code() if isinstance(r, grpc.RpcError) else "ok" for r in (f.result() for f in queued)]
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 1 and codes.count("ok") == 2
    assert tensors.from_proto(crit.result().outputs[0]).tolist() == [9.0]
    assert service.servicer.batchers["mean"].stats()["queued"] == 0


def test_a_critical_evaluate_is_answered_while_a_bulk_batch_is_held_running(batched):
    """Critical work never waits behind bulk work: with the bulk lane held
    inside a run of a 64-board batch (and more bulk queued behind it), a
    critical Evaluate over gRPC is answered, run by the critical lane's thread."""
    service, stub = batched
    ran_on = []
    batcher = service.servicer.batchers[MODEL]
    with held(service, MODEL) as (pool, entered, seen):
        bulk = pool.submit(_call, stub, boards(64))
        assert entered.wait(10)
        queued = pool.submit(_call, stub, boards(2))
        inner = batcher._run

        def record(batch):
            ran_on.append((batch.lane, threading.current_thread().name))
            return inner(batch)

        batcher._run = record
        reply = _call(stub, boards(3), request_class=reward_pb2.REQUEST_CLASS_CRITICAL)
        assert not isinstance(reply, grpc.RpcError), reply
        assert tensors.from_proto(reply.outputs[0]).shape == (3, 1)
        assert not bulk.done() and not queued.done()  # the bulk lane is still held
    assert not isinstance(bulk.result(), grpc.RpcError) and not isinstance(queued.result(), grpc.RpcError)
    assert ran_on[0] == (reward_pb2.REQUEST_CLASS_CRITICAL, f"batcher-{MODEL}-critical")
    assert all(b.lane == reward_pb2.REQUEST_CLASS_BULK for b in seen)


def test_metadata_runtime_says_how_the_model_runs(batched):
    service, stub = batched
    meta = stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL))
    rt = dict(meta.runtime)
    assert rt["precision"] == "fp32" and int(rt["warm_up_ms"]) >= 0
    assert {"io_binding", "cuda_graph", "batch_buckets", "stream_priorities", "stream_priority_in_use",
            "lanes", "stream_priority_critical_lane", "stream_priority_bulk_lane"} <= set(rt)
    assert rt["lanes"].startswith("critical")
    if meta.execution_provider == "CPUExecutionProvider":
        assert rt["io_binding"].startswith("off: CPU") and rt["cuda_graph"].startswith("off")


def test_load_report_includes_queue_age(batched):
    service, _ = batched
    load = service.servicer.load()
    assert set(load) == {"queue_depth", "queue_age_ms", "requests_per_s", "critical_latency_ms"}
    assert load["queue_age_ms"] >= 0 and load["critical_latency_ms"] >= 0


# -- the IO-binding path, over host buffers on the CPU provider --------------------------------


def _sessions(**model_fields):
    from reward_service.session import ModelSession
    from tandem.config import ModelConfig, RewardConfig

    cfg = RewardConfig(execution_provider="cpu")
    m = ModelConfig(name=MODEL, path="reward_service/models/connect4_value.onnx", batch_buckets=(1, 2, 4, 8),
                    max_batch_size=64, **model_fields)
    return ModelSession(m, cfg), ModelSession(m, cfg, host_binding=True)


def test_bound_runner_matches_plain_runs_at_every_batch_size():
    plain, bound = _sessions()
    assert plain.buckets == () and bound.buckets == (1, 2, 4, 8)
    assert bound.runtime["io_binding"].startswith("host buffers")
    for n in (1, 2, 3, 5, 8, 9, 20):  # 9 and 20: larger than every bucket, run in chunks
        b = boards(n)
        want, _ = plain.run({"board": b})
        got, _ = bound.run({"board": b})
        for name in ("value", "policy_logits"):
            assert got[name].shape == want[name].shape
            np.testing.assert_allclose(got[name], want[name], atol=1e-5)


def test_bound_runner_zeroes_padding_rows_left_by_an_earlier_batch():
    _, bound = _sessions()
    bound.run({"board": np.ones((8, 2, 6, 7), np.uint8)})
    bound.run({"board": boards(5)})  # bucket 8 again, 3 padding rows
    slot = bound._active._slots[8]
    assert not slot.dev_in["board"][5:].any()
    out, _ = bound.run({"board": boards(5)})
    assert out["value"].shape == (5, 1)
    # outputs are copies: a later run does not change an earlier result
    first = out["value"].copy()
    bound.run({"board": np.ones((5, 2, 6, 7), np.uint8)})
    np.testing.assert_array_equal(out["value"], first)


def test_bound_runs_name_the_default_graph_id():
    """Each bucket's run options set ``gpu_graph_id``: ONNX Runtime's Python
    run_with_iobinding asks for it at every run, and one not set costs an
    exception turned into RuntimeError (µs of host time in every wave)."""
    _, bound = _sessions()
    for slot in bound._active._slots.values():
        assert slot.run_options.get_run_config_entry("gpu_graph_id") == "0"
        assert slot.run_options.get_run_config_entry("disable_synchronize_execution_providers") == "1"


def test_cuda_only_features_degrade_on_the_cpu():
    plain, _ = _sessions(cuda_graph=True)
    assert plain.execution_provider == "CPUExecutionProvider"
    assert plain.runtime["cuda_graph"] == "off: CPU execution provider"
    assert plain.runtime["stream_priorities"].startswith("off") and plain.stream_priorities == ()
    assert plain.set_stream_priority(-5) == 0  # nothing to switch to, nothing breaks


# -- the two lanes' runners and threads ------------------------------------------------------


def _recording(runner, log):
    """Wraps ``runner``'s run and warm_up (on the instance) to log (runner, thread name)."""
    run, warm_up = runner.run, runner.warm_up

    def recorded_run(batch):
        log.append((runner, threading.current_thread().name))
        return run(batch)

    def recorded_warm_up(inputs):
        log.append((runner, threading.current_thread().name))
        return warm_up(inputs)

    runner.run, runner.warm_up = recorded_run, recorded_warm_up


@pytest.mark.parametrize("binding", ["plain", "host-bound"])
def test_each_lane_warms_up_and_runs_its_runners_on_its_own_thread_only(binding):
    """A session behind a batcher, real threads: each lane's runner(s) are
    warmed up and run by that lane's worker thread only. Host-bound (the
    IO-binding path, buffers per runner): the critical lane owns a runner of
    its own. Plain (the CPU): both lanes share the one thread-safe runner."""
    from reward_service.batcher import Batcher

    plain, bound = _sessions()
    session = bound if binding == "host-bound" else plain
    crit, bulk = session.lane_runners(reward_pb2.REQUEST_CLASS_CRITICAL), session.lane_runners(
        reward_pb2.REQUEST_CLASS_BULK)
    if binding == "host-bound":
        assert len(crit) == 1 and not any(r is crit[0] for r in bulk)
        assert not set(map(id, crit[0]._slots[8].dev_in.values())) & set(map(id, bulk[0]._slots[8].dev_in.values()))
    else:
        assert crit == bulk  # one InferenceSession; its run() is thread-safe
    x = boards(5)
    want, _ = plain.run({"board": x})
    log = []
    for runner in session.lane_runners():
        _recording(runner, log)
    b = Batcher(session.run_batch, buckets=session.buckets, max_batch_size=64, name="lanes",
                warm_up=session.warm_up)
    try:
        warmed = list(log)
        assert {(id(r), t) for r, t in warmed} == {(id(crit[0]), "batcher-lanes-critical")} | {
            (id(r), "batcher-lanes-bulk") for r in bulk}
        for request_class in (reward_pb2.REQUEST_CLASS_CRITICAL, reward_pb2.REQUEST_CLASS_BULK) * 2:
            got = b.evaluate({"board": x}, 5, request_class, deadline=Deadline.after_s(10)).result()
            np.testing.assert_allclose(got["value"], want["value"], atol=1e-5)
    finally:
        b.close()
    ran = log[len(warmed):]
    assert len(ran) == 4
    for runner, thread in ran:
        if binding == "host-bound":
            assert thread == ("batcher-lanes-critical" if runner is crit[0] else "batcher-lanes-bulk")
    assert {t for _, t in ran} == {"batcher-lanes-critical", "batcher-lanes-bulk"}
    assert int(session.runtime["warm_up_ms"]) >= 0 and session.runtime["lanes"].startswith("critical")


def test_the_assignment_moves_the_bulk_lane_only():
    """Held (0, -5) as on the GPU (stand-in runners: only a GPU builds real
    ones): the critical lane always runs on its own runner at -5; the bulk
    lane follows the assignment, onto its own runner at -5 when assigned -5,
    never the critical lane's."""
    from types import SimpleNamespace

    from reward_service.batcher import Batch, Request
    from reward_service.session import ModelSession

    def runner(p):
        return SimpleNamespace(stream_priority=p, run=lambda batch: {"ran_at": np.full((batch.rows, 1), p)})

    session = object.__new__(ModelSession)
    session.name = MODEL
    session._runners = [runner(0), runner(-5)]
    session._critical = runner(-5)
    session._active = session._runners[0]

    def run(lane):
        req = Request({"board": boards(1)}, 1, lane)
        return session.run_batch(Batch([req], 1, 1, [0], lane))["ran_at"]

    critical, bulk = reward_pb2.REQUEST_CLASS_CRITICAL, reward_pb2.REQUEST_CLASS_BULK
    for assigned, bulk_at in ((0, 0), (-3, 0), (-5, -5), (-7, -5), (0, 0)):
        assert session.set_stream_priority(assigned) == bulk_at
        assert session._active is not session._critical
        assert (session.active_stream_priority, session.critical_stream_priority) == (bulk_at, -5)
        assert run(bulk).item() == bulk_at and run(critical).item() == -5
    assert session.lane_runners(critical) == [session._critical]
    assert session.lane_runners(bulk) == session._runners
    assert session.lane_runners() == [*session._runners, session._critical]


def test_precision_auto_is_fp32_on_the_cpu_and_fp16_on_cuda():
    from reward_service.session import ModelSession, resolve_precision
    from tandem.config import DEFAULT_CONFIG, load_config

    assert [resolve_precision("auto", cuda) for cuda in (True, False)] == ["fp16", "fp32"]
    assert [resolve_precision(p, True) for p in ("fp32", "fp16")] == ["fp32", "fp16"]  # an explicit choice stays
    cfg = load_config(DEFAULT_CONFIG).reward
    shipped = next(m for m in cfg.models if m.name == MODEL)
    assert shipped.precision == "auto" and shipped.prefer_nhwc and shipped.fuse_conv_bias
    from dataclasses import replace

    s = ModelSession(replace(shipped, batch_buckets=(1, 2)), replace(cfg, execution_provider="cpu"))
    assert s.precision == "fp32" and s.runtime["precision"] == "fp32"


def test_what_start_up_made_is_frozen_out_of_the_collectors_passes(stubs):
    """tandem/service.py freezes the start-up's objects (gc.freeze) before
    SERVING: a full collection while serving walks only what serving made."""
    import gc

    assert gc.get_freeze_count() > 0
    reply = evaluate(stubs[0], boards(2))  # and the server serves on
    assert tensors.from_proto(reply.outputs[0]).shape == (2, 1)


def test_precision_auto_is_fp32_where_onnx_runtime_falls_back_to_the_cpu(monkeypatch):
    """execution_provider auto on a host whose driver shows a GPU but where
    ONNX Runtime's CUDA provider does not load (here: its CUDA libraries are
    missing): the session falls back to the CPU, and "auto" serves fp32 there,
    not the FP16 model chosen for CUDA."""
    import onnxruntime as ort

    from reward_service import session as session_module
    from tandem.config import DEFAULT_CONFIG, load_config
    from tandem.gpu import cuda_device_count

    if "CUDAExecutionProvider" not in ort.get_available_providers() or cuda_device_count() > 0:
        pytest.skip("needs onnxruntime-gpu on a host without a GPU (its CUDA provider then fails to load)")
    monkeypatch.setattr(session_module, "cuda_device_count", lambda: 1)  # the driver's answer, as on a GPU host
    cfg = load_config(DEFAULT_CONFIG).reward
    shipped = next(m for m in cfg.models if m.name == MODEL)
    from dataclasses import replace

    s = session_module.ModelSession(replace(shipped, batch_buckets=(1, 2)), replace(cfg, execution_provider="auto"))
    assert s.execution_provider == "CPUExecutionProvider"
    assert s.precision == "fp32" and s.runtime["precision"] == "fp32", s.runtime
    fp32 = session_module.ModelSession(replace(shipped, precision="fp32", batch_buckets=(1, 2)),
                                       replace(cfg, execution_provider="cpu"))
    assert s.version == fp32.version  # ModelMetadata's version: the FP32 model's
