"""The reward service's GPU paths (CUDA execution provider, CuPy): IO binding
to device buffers with pinned staging, CUDA graphs per bucket, one session per
stream priority (and the critical lane's own), FP16, and the gRPC service on the GPU. Marked ``gpu``:
skipped where no CUDA GPU is visible (tests/conftest.py)."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from tandem.config import ModelConfig, RewardConfig

pytestmark = pytest.mark.gpu

FRAME = "reward_service/models/frame_reward.onnx"
VALUE = "reward_service/models/connect4_value.onnx"


@pytest.fixture(scope="module")
def cuda_ready():
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("cupy")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this ONNX Runtime build has no CUDA execution provider")
    return ort


def frames(n: int, seed: int = 0) -> np.ndarray:
    from training.frames import render_moves

    rng = np.random.default_rng(seed)
    moves = ["".join(str(c) for c in rng.integers(1, 8, int(rng.integers(0, 12)))) for _ in range(n)]
    ok = []
    for m in moves:
        try:
            render_moves([m])
            ok.append(m)
        except ValueError:
            ok.append("")
    return render_moves(ok, rng)


def session(path=FRAME, *, graph=True, precision="fp32", stream_priorities=(0, -5), buckets=(1, 2, 4, 8), **reward):
    from reward_service.session import ModelSession

    cfg = RewardConfig(execution_provider="cuda", stream_priorities=stream_priorities, **reward)
    return ModelSession(ModelConfig(name="m", path=path, batch_buckets=buckets, max_batch_size=64, cuda_graph=graph,
                                    precision=precision), cfg)


@pytest.fixture(scope="module")
def cpu_reference(cuda_ready):
    from reward_service.session import ModelSession

    cpu = ModelSession(ModelConfig(name="m", path=FRAME), RewardConfig(execution_provider="cpu"))
    x = frames(20, 1)
    return x, cpu.run({"frame": x})[0]["value"]


def test_graphs_io_binding_and_streams_are_on(cuda_ready):
    s = session()
    assert s.execution_provider == "CUDAExecutionProvider"
    assert s.runtime["io_binding"] == "device buffers, pinned host staging"
    assert s.runtime["cuda_graph"].startswith("on"), s.runtime
    assert s.stream_priorities == (0, -5) and s.runtime["stream_priorities"] == "0,-5"
    assert [r.device.stream_priority for r in s._runners] == [0, -5]
    rt = __import__("cupy").cuda.runtime
    if hasattr(rt, "streamGetPriority"):
        assert [rt.streamGetPriority(r.device.stream.ptr) for r in s._runners] == [0, -5]
    assert all(r.graphs for r in s._runners)
    slot = s._runners[0]._slots[8]
    import cupy

    assert isinstance(slot.dev_in["frame"], cupy.ndarray)
    # pinned staging: CUDA reports the host buffer as page-locked host memory
    attrs = cupy.cuda.runtime.pointerGetAttributes(slot.host_in["frame"].ctypes.data)
    assert attrs.type == getattr(cupy.cuda.runtime, "memoryTypeHost", 1)


@pytest.mark.parametrize("graph", [True, False])
def test_gpu_results_match_the_cpu_at_every_size_and_stream_priority(cpu_reference, graph):
    x, want = cpu_reference
    s = session(graph=graph)
    for stream_priority in (0, -5):
        assert s.set_stream_priority(stream_priority) == stream_priority
        for n in (1, 3, 8, 13, 20):  # 13 and 20: chunks of the largest bucket
            got = s.run({"frame": x[:n]})[0]["value"]
            assert got.shape == (n, 1)
            np.testing.assert_allclose(got, want[:n], atol=1e-3)


def test_padding_rows_never_leak_into_results(cpu_reference):
    x, want = cpu_reference
    s = session()
    s.run({"frame": np.full((8, 224, 224, 3), 255, np.uint8)})
    got = s.run({"frame": x[:5]})[0]["value"]  # bucket 8, 3 padding rows
    np.testing.assert_allclose(got, want[:5], atol=1e-3)
    assert not s._active._slots[8].dev_in["frame"][5:].any()


def test_the_critical_lane_has_its_own_runner_and_stream_at_the_greatest_stream_priority(cpu_reference):
    """The critical lane's runner is none of the bulk lane's: its own stream
    (at -5), graphs and buffers; with the bulk lane assigned -5 too, both run
    batches and agree with the CPU."""
    import cupy

    from reward_service.batcher import BULK, CRITICAL, Batch, Request

    x, want = cpu_reference
    s = session()
    crit = s._critical
    assert crit.stream_priority == -5 and s.critical_stream_priority == -5 and crit.graphs
    assert all(crit is not r for r in s._runners)
    assert crit.device.stream.ptr not in {r.device.stream.ptr for r in s._runners}
    assert crit._slots[8].dev_in["frame"].data.ptr not in {r._slots[8].dev_in["frame"].data.ptr for r in s._runners}
    rt = cupy.cuda.runtime
    if hasattr(rt, "streamGetPriority"):
        assert rt.streamGetPriority(crit.device.stream.ptr) == -5
    assert s.set_stream_priority(-5) == -5 and s._active is not crit
    for lane in (CRITICAL, BULK):
        batch = Batch([Request({"frame": x[:3]}, 3, lane)], 3, 4, [0], lane)
        np.testing.assert_allclose(s.run_batch(batch)["value"][:3], want[:3], atol=1e-3)
    assert s.runtime["lanes"].startswith("critical: own worker thread and sessions at stream priority -5")


def test_fp16_on_the_gpu_keeps_fp32_outputs_and_agrees(cpu_reference):
    from training.train_frame_reward import outcome_class

    x, want = cpu_reference
    s = session(precision="fp16")
    got = s.run({"frame": x})[0]["value"]
    assert got.dtype == np.float32
    assert np.abs(got - want).max() < 3e-2
    assert (outcome_class(got) == outcome_class(want)).mean() >= 0.95


def test_first_run_after_start_is_not_slow(cuda_ready):
    s = session(stream_priorities=(0,))
    x = frames(1)
    t = time.perf_counter()
    s.run({"frame": x})
    first = time.perf_counter() - t
    times = []
    for _ in range(50):
        t = time.perf_counter()
        s.run({"frame": x})
        times.append(time.perf_counter() - t)
    assert first <= 3 * float(np.median(times)) + 0.5e-3, (first, np.median(times))


def test_memory_limit_and_algo_search_are_applied(cuda_ready):
    s = session(VALUE, graph=False, stream_priorities=(0,), memory_pool_bytes=256 << 20,
                cudnn_conv_algo_search="HEURISTIC")
    assert s.runtime["cudnn_conv_algo_search"] == "HEURISTIC"
    # The model's pool, split over its per-bucket sessions (4 buckets).
    assert s.runtime["gpu_mem_limit_bytes"] == str(64 << 20)
    opts = s._runners[0].session.get_provider_options()["CUDAExecutionProvider"]
    assert opts["gpu_mem_limit"] == str(64 << 20) and opts["cudnn_conv_algo_search"] == "HEURISTIC"
    assert opts["arena_extend_strategy"] == "kSameAsRequested"
    assert opts["has_user_compute_stream"] == "1"


def test_grpc_service_on_the_gpu(cuda_ready):
    import grpc
    from conftest import loopback_config
    from tandem.v1 import reward_pb2, reward_pb2_grpc

    from reward_service import server as reward_server
    from tandem import tensors
    from tandem.server import channel

    models = [{"name": "frame_reward", "path": FRAME, "cuda_graph": True, "batch_buckets": [1, 2, 4, 8],
               "max_batch_size": 64}]
    cfg = loopback_config(reward={"models": models, "execution_provider": "cuda", "stream_priorities": [0, -5]})
    service = reward_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.reward.address)
    try:
        stub = reward_pb2_grpc.RewardServiceStub(ch)
        meta = stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model="frame_reward"))
        assert meta.execution_provider == "CUDAExecutionProvider" and meta.runtime["cuda_graph"].startswith("on")
        x = frames(3)
        reply = stub.Evaluate(reward_pb2.EvaluateRequest(model="frame_reward", inputs=[tensors.to_proto("frame", x)],
                                                         request_class=reward_pb2.REQUEST_CLASS_CRITICAL), timeout=10)
        v = tensors.from_proto(reply.outputs[0])
        assert v.shape == (3, 1) and reply.padded_batch_size == 4
        with pytest.raises(grpc.RpcError) as info:
            stub.Evaluate(reward_pb2.EvaluateRequest(
                model="frame_reward", inputs=[tensors.to_proto("frame", x.astype(np.float32))]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        service.servicer.set_stream_priority(-5)
        assert meta.runtime and stub.ModelMetadata(
            reward_pb2.ModelMetadataRequest(model="frame_reward")).runtime["stream_priority_in_use"] == "-5"
        again = stub.Evaluate(reward_pb2.EvaluateRequest(model="frame_reward", inputs=[tensors.to_proto("frame", x)]),
                              timeout=10)
        np.testing.assert_allclose(tensors.from_proto(again.outputs[0]), v, atol=1e-4)
    finally:
        ch.close()
        service.stop()


def test_every_bucket_of_every_runner_is_warmed_on_the_lane_thread_that_serves_it(cuda_ready):
    """Every bucket of every session is warmed on the thread that serves it
    before SERVING (the bundled models, as configured in
    deploy/config/tandem.yaml), the leaf channel's device-input path with
    it (``_BoundRunner.warm_up``): no autotuning, capture or allocation is
    left for a request. What that buys a first request is measured, not asserted
    here: bench/first_request.py."""
    import dataclasses

    from conftest import loopback_config
    from reward_service import server as reward_server
    from reward_service.batcher import BULK, LANES
    from tandem.config import load_config

    shipped = load_config().reward
    cfg = loopback_config(reward={"execution_provider": "cuda"})
    cfg = dataclasses.replace(cfg, reward=dataclasses.replace(shipped, address=cfg.reward.address, metrics_port=0,
                                                              execution_provider="cuda"))
    service = reward_server.start(cfg, follow_scheduler=False)
    try:
        sessions = service.servicer.sessions
        assert set(sessions) == {m.name for m in shipped.models}
        for name, session in sessions.items():
            threads = service.servicer.batchers[name].threads
            for lane, lane_name in LANES.items():
                runners = session.lane_runners(lane)
                assert runners, (name, lane_name)
                for runner in runners:
                    assert set(runner.warm_up_s) == set(runner.buckets), (name, lane_name, runner.warm_up_s)
                    assert runner.warmed_on == threads[lane_name].ident, (name, lane_name)
            # the bulk lane: a runner per stream priority the scheduler may assign
            assert len({r.stream_priority for r in session.lane_runners(BULK)}) == len(shipped.stream_priorities)
    finally:
        service.stop()


def test_the_shipped_value_model_runs_fp16_on_the_gpu_and_agrees_with_fp32(cuda_ready):
    """precision: auto -> FP16 body, FP32 head, NHWC, the bias fused into the
    convolutions: the answers the search uses (value sign, best column) agree
    with the FP32 model on the CPU."""
    from reward_service.session import ModelSession
    from tandem.config import DEFAULT_CONFIG, load_config
    from tandem.positions import load_set
    from training.connect4_encoding import encode_moves

    cfg = load_config(DEFAULT_CONFIG).reward
    shipped = next(m for m in cfg.models if m.name == "connect4_value")
    boards = np.stack([encode_moves(p.moves) for p in load_set("Test_L2_R1")[:256]]).astype(np.uint8)
    gpu = ModelSession(replace(shipped, batch_buckets=(256,)), replace(cfg, stream_priorities=(0,)))
    cpu = ModelSession(replace(shipped, batch_buckets=(256,)), replace(cfg, execution_provider="cpu"))
    assert gpu.precision == "fp16" and gpu.runtime["precision"].startswith("fp16"), gpu.runtime
    opts = gpu._runners[0].session.get_provider_options()["CUDAExecutionProvider"]
    assert opts["prefer_nhwc"] == "1" and opts["fuse_conv_bias"] == "1", opts
    assert gpu.runtime["conv_bias"].endswith("(fuse_conv_bias)")
    got, want = gpu.run({"board": boards})[0], cpu.run({"board": boards})[0]
    assert got["value"].dtype == np.float32 and got["policy_logits"].dtype == np.float32
    assert np.abs(got["value"] - want["value"]).max() < 2e-2
    assert (np.sign(got["value"]) == np.sign(want["value"])).mean() >= 0.99
    assert (got["policy_logits"].argmax(1) == want["policy_logits"].argmax(1)).mean() >= 0.98
