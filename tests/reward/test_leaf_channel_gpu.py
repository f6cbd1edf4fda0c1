"""The leaf channel with a CUDA IPC input region (tandem/leaf_channel.py,
reward_service/leaf_channel.py): the reward service in another process (a
CUDA IPC handle does not open in the process that made it), its answers equal
to Evaluate's at every bucket, from NumPy and from CuPy leaves, and a CUDA
search service whose value-model searches go by it. Marked ``gpu``.

    pytest -m gpu tests/reward/test_leaf_channel_gpu.py
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import time

import grpc
import numpy as np
import pytest
from conftest import loopback_config
from tandem.v1 import reward_pb2, reward_pb2_grpc, search_pb2, search_pb2_grpc

from tandem import tensors
from tandem.gpu import cupy_module
from tandem.leaf_channel import RUNTIME_KEY, LeafChannel
from tandem.server import channel
from tandem.deadline import Deadline

pytestmark = pytest.mark.gpu

MODEL = "connect4_value"




def random_boards(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2, (n, 2, 6, 7)).astype(np.uint8)


def test_a_cuda_region_answers_as_evaluate_at_every_bucket(gpu_reward):
    cfg, stub = gpu_reward
    runtime = stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL)).runtime
    assert runtime[f"{RUNTIME_KEY}_device"] == "0"
    lc = LeafChannel(stub, runtime[RUNTIME_KEY], MODEL, 1024, 0)
    cp = cupy_module()
    try:
        assert lc.kind == "cuda"
        for n in (1, 37, 256, 1024):
            obs = random_boards(n, n)
            got = lc.evaluate(obs, Deadline.after_s(30))
            from_device = lc.evaluate(cp.asarray(obs), Deadline.after_s(30))
            reply = stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", obs)],
                                                             request_class=reward_pb2.REQUEST_CLASS_CRITICAL))
            want = {t.name: tensors.from_proto(t) for t in reply.outputs}
            for name in ("value", "policy_logits"):
                assert got[name].shape == want[name].shape == (n, *want[name].shape[1:])
                np.testing.assert_allclose(got[name], want[name], atol=1e-4)
                np.testing.assert_array_equal(from_device[name], got[name])
            assert lc.bucket >= n
    finally:
        lc.close()


def test_a_cuda_search_service_sends_its_leaves_by_the_leaf_channel(gpu_reward):
    from search_service import server as search_server

    cfg, _ = gpu_reward
    search = search_server.start(cfg, follow_scheduler=False)
    try:
        # search.value_model_sims_per_warp (32): a value-model wave of 64 on 2 warps selecting in order,
        # rollouts one simulation per warp
        assert search.servicer.backend.split(64, value_model=True) == (2, 32)
        assert search.servicer.backend.split(64) == (64, 1)
        handoff = search.servicer.handoff
        assert handoff.wait_attached(30.0)
        assert handoff._leaf.channel.kind == "cuda"
        # The device channels, lent one per search: this search's waves went by one of them.
        assert handoff.wait_device_channels(30.0) == cfg.search.device_channels
        lent = {id(ev): ev.totals.calls for ev in handoff._device_free}
        with channel(cfg.search.address) as ch:
            stub = search_pb2_grpc.SearchServiceStub(ch)
            reply = stub.Search(search_pb2.SearchRequest(game="connect4", moves="4453", simulations=1000,
                                                         evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=60)
        assert reply.handoff == "leaf_channel" and reply.model_simulations == reply.simulations == 1000
        assert not reply.evaluation_failure
        assert sum(ev.totals.calls - lent[id(ev)] for ev in handoff._device_free) > 1
    finally:
        search.stop()


def test_device_waves_search_as_the_host_way_does(gpu_reward):
    """A search whose leaves and answers stay on the device (DeviceWaves: the
    selection kernel writes into the CUDA input region, the reward service's
    bound runner writes into the CUDA output region, the backup kernel reads
    it) values every simulation with the model, one wave per call, and builds
    the tree the host way builds (one warp per tree: the reference's order; the
    priors' float32 softmax may round apart by an ulp)."""
    from search_service.cuda.backend import CudaBackend
    from search_service.evaluators import DeviceWaves, LeafChannelEvaluator
    from search_service.games import connect4
    from search_service.mcts.backend import SearchParams

    _, stub = gpu_reward
    lc = LeafChannel.offered(stub, MODEL, 1024, 30)
    ev = LeafChannelEvaluator(lc, 30)
    try:
        assert lc.kind == "cuda" and DeviceWaves.fits(lc) and DeviceWaves(ev, None).ordered
        backend = CudaBackend(sims_per_warp=32)
        params = SearchParams(simulations=1000, deadline_ms=None, parallel_sims=32, evaluator="value_model", seed=3)
        root = connect4.parse_moves("4453")
        (host,), _ = backend.search(root, params, ev)
        calls = ev.totals.calls
        (dev,), _ = backend.search(root, params, ev, device_waves=DeviceWaves(ev, None))
        assert ev.totals.calls - calls == dev.extras["waves"] + 1  # the root, then one call per wave
        assert dev.model_simulations == dev.simulations == 1000 and not dev.evaluation_failure
        assert dev.action == host.action
        assert np.abs(dev.visit_counts - host.visit_counts).sum() <= 40, (dev.visit_counts, host.visit_counts)
    finally:
        lc.close()


def _serve_until_killed(cfg, ready) -> None:
    from reward_service import server as reward_server

    service = reward_server.start(cfg, follow_scheduler=False)  # held: a dropped service stops serving
    ready.set()
    time.sleep(3600)
    service.stop()


def test_a_reward_service_killed_mid_search_leaves_the_device_search_its_tree():
    """SIGKILL of the reward service while a device-wave search runs: the wave
    in flight fails (the socket breaks, or its outputs never come), is
    undone, and the search goes on in the same tree with rollouts and
    answers by its deadline, saying why."""
    from search_service.cuda.backend import CudaBackend
    from search_service.evaluators import DeviceWaves, LeafChannelEvaluator
    from search_service.games import connect4
    from search_service.mcts.backend import SearchParams

    if cupy_module() is None:
        pytest.skip("CuPy sees no GPU")
    cfg = loopback_config(search={"backend": "cuda"})
    spawn = mp.get_context("spawn")
    ready = spawn.Event()
    child = spawn.Process(target=_serve_until_killed, args=(cfg, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(300), "the reward service did not start"
        with channel(cfg.reward.address) as ch:
            lc = LeafChannel.offered(reward_pb2_grpc.RewardServiceStub(ch), MODEL, 1024, 30)
        ev = LeafChannelEvaluator(lc, 30)
        backend = CudaBackend()
        params = SearchParams(simulations=None, deadline_ms=3000.0, parallel_sims=64, evaluator="value_model")
        import threading

        def kill_once_waves_ran() -> None:  # the root and two waves valued: the model is in the tree
            while ev.totals.calls < 3 and child.is_alive():
                time.sleep(0.001)
            child.kill()

        threading.Thread(target=kill_once_waves_ran, daemon=True).start()
        t = time.perf_counter()
        (r,), _ = backend.search(connect4.parse_moves("44"), params, ev, device_waves=DeviceWaves(ev, None))
        elapsed_ms = (time.perf_counter() - t) * 1e3
        assert 0 < r.model_simulations < r.simulations
        assert "leaf channel" in r.evaluation_failure
        assert elapsed_ms < 3000.0 + 1000.0  # its deadline, plus a loaded host's slack
        lc.close()
    finally:
        child.kill()
        child.join(30)


def test_an_ordered_channel_answers_unsynchronised_device_inputs_as_a_synchronised_one(gpu_reward):
    """Events order the waves (LeafChannel.ordered): inputs written by a kernel
    still queued on the caller's stream when the wave is sent are the ones
    the model reads, and the answers equal a synchronised channel's and
    Evaluate's at every bucket."""
    _, stub = gpu_reward
    cp = cupy_module()
    ordered = LeafChannel.offered(stub, MODEL, 1024, 30)
    plain = LeafChannel(stub, ordered.path, MODEL, 1024, 0, events=False)
    try:
        assert ordered.ordered and not plain.ordered and plain.device_outputs
        with cp.cuda.Stream(non_blocking=True):
            for n in (1, 37, 256, 1024):
                obs = random_boards(n, 100 + n)
                answers = []
                for lc in (ordered, plain):
                    big = cp.asarray(np.repeat(obs[None], 8, axis=0))  # work queued ahead of the copy
                    lc.device_inputs[:n] = (big.sum(axis=0) // 8).astype(cp.uint8)
                    if not lc.ordered:
                        cp.cuda.get_current_stream().synchronize()
                    answers.append({k: v[:n].get() for k, v in lc.evaluate_device(n, Deadline.after_s(30)).items()})
                reply = stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", obs)],
                                                                 request_class=reward_pb2.REQUEST_CLASS_CRITICAL))
                want = {t.name: tensors.from_proto(t) for t in reply.outputs}
                for name in ("value", "policy_logits"):
                    np.testing.assert_array_equal(answers[0][name], answers[1][name])
                    np.testing.assert_allclose(answers[0][name], want[name], atol=1e-4)
    finally:
        ordered.close()
        plain.close()


def test_a_ready_event_the_server_cannot_open_leaves_the_channel_synchronised(gpu_reward, monkeypatch):
    """A foreign or stale event handle (here 64 bytes no driver made; a
    process that cannot map a ready word offers its ready event): the server
    logs it and attaches the channel without events; its waves are
    synchronised and answered right."""
    import tandem.leaf_channel as client

    class Foreign:
        handle = bytes(range(64))

        def record(self, stream_ptr):
            raise AssertionError("a channel without the server's done_event records nothing")

    def no_word(view):
        raise RuntimeError("no mapped memory here")

    monkeypatch.setattr(client, "ExportedEvent", Foreign)
    monkeypatch.setattr(client, "ReadyWord", no_word)
    _, stub = gpu_reward
    lc = LeafChannel.offered(stub, MODEL, 256, 30)
    try:
        assert lc.device_outputs and not lc.ordered
        obs = random_boards(40, 7)
        got = lc.evaluate(obs, Deadline.after_s(30))
        assert got["value"].shape == (40, 1) and np.isfinite(got["value"]).all()
    finally:
        lc.close()


def _wave_behind_a_long_kernel(address, sending, code) -> None:
    """A client whose wave's inputs are queued behind a ~10 s kernel on its
    stream: its ready word is written only after, if ever (it is killed);
    ``code`` gets the gRPC status value its wave was answered with."""
    from tandem.leaf_channel import LeafChannelError

    cp = cupy_module()
    with channel(address) as ch:
        lc = LeafChannel.offered(reward_pb2_grpc.RewardServiceStub(ch), MODEL, 64, 30)
    assert lc.ordered
    spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
        long long start = clock64(); while (clock64() - start < cycles) {} }''', "spin")
    spin((1,), (1,), (np.int64(20_000_000_000),))
    lc.device_inputs[:8] = cp.zeros((8, 2, 6, 7), cp.uint8)
    sending.set()
    try:
        lc.evaluate_device(8, Deadline.after_s(30))
    except LeafChannelError as exc:
        code.value = exc.code.value[0]
    time.sleep(3600)  # killed


def test_a_client_whose_inputs_are_never_written_costs_its_own_wave_only(gpu_reward):
    """A wave whose client's kernels have not written its inputs (its ready
    word unwritten: a hung or dying client) is answered DEADLINE_EXCEEDED after
    the run's short wait (session.READY_WAIT_S), never by a stream wait on
    another process's event; the service goes on serving other clients'
    waves and Evaluates, right, also after that client is killed."""
    cfg, stub = gpu_reward
    spawn = mp.get_context("spawn")
    sending, code = spawn.Event(), spawn.Value("i", -1)
    child = spawn.Process(target=_wave_behind_a_long_kernel, args=(cfg.reward.address, sending, code), daemon=True)
    child.start()
    try:
        assert sending.wait(120), "the client did not reach its wave"
        # Without events: the other process's 10 s kernel time-slices the GPU (no MPS here), so this
        # client's own ready event could take longer than the run waits for one.
        lc = LeafChannel.offered(stub, MODEL, 64, 30, events=False)
        try:
            obs = random_boards(20, 11)
            reply = stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", obs)],
                                                             request_class=reward_pb2.REQUEST_CLASS_CRITICAL),
                                  timeout=30)
            want = {t.name: tensors.from_proto(t) for t in reply.outputs}
            got = lc.evaluate(obs, Deadline.after_s(30))
            np.testing.assert_allclose(got["value"], want["value"], atol=1e-4)
            for _ in range(300):  # the stuck wave's answer, well before its kernel ends
                if code.value >= 0:
                    break
                time.sleep(0.01)
            assert code.value == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            child.kill()
            child.join(30)
            got = lc.evaluate(obs, Deadline.after_s(30))
            np.testing.assert_allclose(got["value"], want["value"], atol=1e-4)
        finally:
            lc.close()
    finally:
        child.kill()


@contextlib.contextmanager
def device_batch(gpu_reward):
    """A CUDA batch of value-model trees (K 32) lent the one device channel of
    a leaf channel to the GPU reward service: yields (handoff, batch)."""
    from search_service.cuda import CudaBackend
    from search_service.cuda.tree_batch import CudaTreeBatch
    from search_service.evaluators import HandoffEvaluator
    from search_service.mcts.backend import SearchParams

    cfg, _ = gpu_reward
    with channel(cfg.reward.address) as ch:
        handoff = HandoffEvaluator(ch, MODEL, "leaf_channel", device_channels=1)
        try:
            assert handoff.wait_attached(30.0) and handoff.wait_device_channels(30.0) == 1
            params = SearchParams(simulations=None, deadline_ms=1.0, parallel_sims=32, evaluator="value_model")
            yield handoff, CudaTreeBatch(CudaBackend(value_sims_per_warp=32), params, handoff,
                                         lend=lambda: handoff.lend(None))
        finally:
            handoff.close()


def test_roots_waiting_in_rows_apart_get_their_priors_from_a_device_wave(gpu_reward):
    """Two roots join a device batch, a row leaves before the next wave and
    moves one of them into its hole: the waiting rows are 0 and 2, two runs of
    init_trees and mcts_vm_root_priors beside tree 1's leaves; each root gets
    the model's own priors."""
    from search_service.cuda.answers import call_model
    from search_service.games import connect4
    from search_service.mcts.plan import Member

    with device_batch(gpu_reward) as (handoff, batch):
        batch.join(connect4.stack([connect4.parse_moves(m) for m in ("4453", "")]), [None] * 2, [1, 2], [0, 1])
        assert batch.wave(np.zeros(2, np.int64)) and batch.ready().all()  # their roots alone (host way)
        batch.join(connect4.stack([connect4.parse_moves(m) for m in ("3344", "7")]), [None] * 2, [3, 4], [0, 1])
        _, _, kept = batch.leave([0], [Member(None, None)])
        assert kept.tolist() == [3, 1, 2] and batch.ready().tolist() == [False, True, False]
        before = handoff._device_free[0].totals.calls
        assert batch.wave(np.array([0, 32, 0])) and batch.ready().all()
        assert handoff._device_free[0].totals.calls == before + 1  # one call: tree 1's leaves and both roots
        results, trees, _ = batch.leave([0, 1, 2], [Member(None, None)] * 3)
        assert [r.simulations for r in results] == [0, 32, 0]
        for tree, moves in zip(trees, ("7", "", "3344")):
            pos = connect4.parse_moves(moves)
            _, priors = call_model(handoff, pos.current, pos.mask)
            np.testing.assert_allclose(tree.to_host().prior[0, 0], priors[0], atol=2e-3)


def test_a_batch_of_device_trees_values_its_waves_by_the_device_channels(gpu_reward):
    """The CUDA batch of trees (search_service/cuda/tree_batch.py) lent a
    device channel a wave: ragged value-model searches, every simulation
    valued by the model through the CUDA regions, none on the host; the
    roots that join while others search get their priors from the wave's
    call (mcts_vm_root_priors), the model's own for them."""
    from search_service.cuda.answers import call_model
    from search_service.games import connect4
    from search_service.mcts.batch import step
    from search_service.mcts.plan import Member, WaveTimes

    with device_batch(gpu_reward) as (handoff, batch):
        before = handoff._device_free[0].totals.calls
        specs = [("4453", 256, 0), ("", 128, 0), ("3344", 96, 1), ("7", 200, 3)]
        members, times, out, trees, wave = [], WaveTimes(), {}, {}, 0
        while len(out) < len(specs):
            for i, (moves, sims, at) in enumerate(specs):
                if at == wave:
                    batch.join(connect4.parse_moves(moves), [None], [i + 1], [0])
                    members.append(Member(sims, None, owner=i))
            for m, r, tree in step(batch, members, times):
                out[m.owner], trees[m.owner] = r, tree
            wave += 1
        for i, (moves, sims, _) in enumerate(specs):
            r = out[i]
            assert r.simulations == r.model_simulations == sims and int(r.visit_counts.sum()) == sims
            assert not r.evaluation_failure
            pos = connect4.parse_moves(moves)
            _, priors = call_model(handoff, pos.current, pos.mask)
            np.testing.assert_allclose(trees[i].to_host().prior[0, 0], priors[0], atol=2e-3)
        assert handoff._device_free[0].totals.calls - before >= 8  # the waves went by the device channel