"""In-process device waves on a GPU (tandem/in_process.py,
reward_service/in_process.py): co-located mode's reward service in this test
process, its device links' answers equal to Evaluate's and to a host link's
at every size, inputs written by kernels still queued when the wave is
handed over, outputs read by kernels queued after it returns (the stream's
wait on the GPU), and a co-located CUDA search service whose value-model
searches go by device links. Marked ``gpu``.

    pytest -m gpu tests/search/test_in_process_gpu.py
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import loopback_config
from tandem.v1 import reward_pb2, reward_pb2_grpc, search_pb2, search_pb2_grpc

from tandem import in_process, tensors
from tandem.gpu import cupy_module
from tandem.server import channel
from tandem.deadline import Deadline

pytestmark = pytest.mark.gpu

MODEL = "connect4_value"


@pytest.fixture(scope="module")
def co_located():
    if cupy_module() is None:
        pytest.skip("CuPy sees no GPU")
    from stack import colocated

    cfg = loopback_config(search={"backend": "cuda", "value_model_parallel_sims": 64})
    reward, search = colocated.start(cfg, follow_scheduler=False)
    ch = channel(cfg.reward.address, cfg)
    yield cfg, search, reward_pb2_grpc.RewardServiceStub(ch)
    ch.close()
    search.stop()
    reward.stop()


def random_boards(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2, (n, 2, 6, 7)).astype(np.uint8)


def test_device_waves_answer_as_evaluate_and_a_host_port_at_every_size(co_located):
    """Inputs written by a kernel still queued on the caller's stream when the
    wave is handed over are the ones the model reads (the ready event), and
    the outputs read by a copy queued after the return are the wave's (the
    stream waits for the done event on the GPU): equal to a host link's and
    to Evaluate's."""
    cfg, _, stub = co_located
    cp = cupy_module()
    server = in_process.find(cfg.reward.address)
    device, host = server.link(MODEL, 1024, device=True), server.link(MODEL, 1024, device=False)
    assert device.ordered and device.kind == "cuda" and device.device_inputs.shape == (1024, 2, 6, 7)
    with cp.cuda.Stream(non_blocking=True):
        for n in (1, 37, 256, 1024):
            obs = random_boards(n, 100 + n)
            big = cp.asarray(np.repeat(obs[None], 8, axis=0))  # work queued ahead of the leaves' write
            device.device_inputs[:n] = (big.sum(axis=0) // 8).astype(cp.uint8)
            outputs = device.evaluate_device(n, Deadline.after_s(30))
            got = {k: v[:n].get() for k, v in outputs.items()}  # a copy queued on the same stream, after the wait
            assert device.bucket >= n
            want_host = host.evaluate(obs, Deadline.after_s(30))
            reply = stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", obs)],
                                                             request_class=reward_pb2.REQUEST_CLASS_CRITICAL))
            want = {t.name: tensors.from_proto(t) for t in reply.outputs}
            for name in ("value", "policy_logits"):
                np.testing.assert_array_equal(got[name], want_host[name])
                np.testing.assert_allclose(got[name], want[name], atol=1e-4)


def test_device_waves_in_process_search_as_the_host_way_does(co_located):
    """A search whose leaves and answers stay on the device through a device
    link values every simulation with the model and builds the tree the host
    way builds (as the leaf channel's device waves do)."""
    from search_service.cuda.backend import CudaBackend
    from search_service.evaluators import HANDOFF_IN_PROCESS, DeviceWaves, LeafChannelEvaluator
    from search_service.games import connect4
    from search_service.mcts.backend import SearchParams

    cfg, _, _ = co_located
    server = in_process.find(cfg.reward.address)
    host = LeafChannelEvaluator(server.link(MODEL, 1024, device=False), 30, HANDOFF_IN_PROCESS)
    dev_ev = LeafChannelEvaluator(server.link(MODEL, 1024, device=True), 30, HANDOFF_IN_PROCESS)
    assert DeviceWaves.fits(dev_ev.channel)
    waves = DeviceWaves(dev_ev, None)
    assert waves.ordered and waves.handoff == "in_process"
    backend = CudaBackend(sims_per_warp=32)
    params = SearchParams(simulations=1000, deadline_ms=None, parallel_sims=32, evaluator="value_model", seed=3)
    root = connect4.parse_moves("4453")
    (by_host,), _ = backend.search(root, params, host)
    (dev,), _ = backend.search(root, params, dev_ev, device_waves=waves)
    assert dev_ev.totals.calls == dev.extras["waves"] + 1  # the root, then one call per wave
    assert dev.model_simulations == dev.simulations == 1000 and not dev.evaluation_failure
    assert dev.action == by_host.action
    assert np.abs(dev.visit_counts - by_host.visit_counts).sum() <= 40, (dev.visit_counts, by_host.visit_counts)


def test_a_co_located_cuda_search_service_sends_its_leaves_in_process(co_located):
    cfg, search, _ = co_located
    handoff = search.servicer.handoff
    assert handoff.wait_attached(30.0) and handoff._leaf.handoff == "in_process"
    assert handoff.wait_device_channels(30.0) == cfg.search.device_channels
    lent = {id(ev): ev.totals.calls for ev in handoff._device_free}
    assert all(ev.handoff == "in_process" for ev in handoff._device_free)
    with channel(cfg.search.address) as ch:
        reply = search_pb2_grpc.SearchServiceStub(ch).Search(search_pb2.SearchRequest(
            game="connect4", moves="4453", simulations=1000, evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=60)
    assert reply.handoff == "in_process" and reply.model_simulations == reply.simulations == 1000
    assert not reply.evaluation_failure
    assert sum(ev.totals.calls - lent[id(ev)] for ev in handoff._device_free) > 1


def test_device_waves_merged_with_host_waves_get_their_own_answers(co_located):
    """A device wave and a host wave queued together (the lane's worker held
    by a third wave whose inputs come after a long kernel) run as one batch,
    the host way; the device wave's outputs are written into its buffers on
    its stream: each answer is its own."""
    import threading

    from tandem.leaf_channel import LeafChannelError

    cfg, _, _ = co_located
    cp = cupy_module()
    server = in_process.find(cfg.reward.address)
    blocker, host, device = (server.link(MODEL, 64, device=d) for d in (True, False, True))
    obs = random_boards(64, 7)
    want = host.evaluate(obs, Deadline.after_s(30))["value"]
    batcher = server.batchers[MODEL]
    run, mixed, got, holding = batcher._run, [], {}, threading.Event()

    def spy(batch):  # the real run; notes the batches that held a device wave and a host wave
        if len({r.targets is None for r in batch.requests}) == 2:
            mixed.append(batch.rows)
        if any(r.feeds["board"].data.ptr == blocker.device_inputs.data.ptr for r in batch.requests
               if r.targets is not None):
            holding.set()  # the worker now waits for the blocker's inputs
        return run(batch)

    def held():
        with cp.cuda.Stream(non_blocking=True):
            heavy = cp.ones((8192, 8192), cp.float32)
            heavy @ heavy  # ~20 ms ahead of its inputs: the worker waits for them (at most 5 ms)
            try:
                blocker.evaluate_device(64, Deadline.after_s(30))
            except LeafChannelError:
                pass  # its inputs came too late: DEADLINE_EXCEEDED

    device.device_inputs[:64].set(obs)
    device.outputs["value"].fill(np.nan)
    cp.cuda.Device().synchronize()

    def device_wave():
        with cp.cuda.Stream(non_blocking=True):
            got["device"] = device.evaluate_device(64, Deadline.after_s(30))["value"][:64].get()

    batcher._run = spy
    try:
        first = threading.Thread(target=held)
        first.start()
        assert holding.wait(30)
        others = [threading.Thread(target=device_wave),
                  threading.Thread(target=lambda: got.setdefault("host", host.evaluate(obs, Deadline.after_s(30))))]
        for t in others:
            t.start()
        for t in [first, *others]:
            t.join(60)
    finally:
        batcher._run = run
    assert mixed, "no batch held both kinds of wave: the merged path was not exercised"
    np.testing.assert_allclose(got["device"], want, atol=2e-3)
    np.testing.assert_allclose(got["host"]["value"], want, atol=2e-3)


def test_a_device_wave_given_up_at_its_deadline_never_spoils_the_next(co_located):
    """A wave whose inputs come after a long kernel (a matrix product of ~20
    ms queued ahead of them) cannot run by its 2 ms deadline: it is answered
    DEADLINE_EXCEEDED by then (not run, its inputs late, or still running past
    the grace), and the next wave on the same link and buffers has its own
    answers."""
    from tandem.leaf_channel import LeafChannelError

    cfg, _, _ = co_located
    cp = cupy_module()
    server = in_process.find(cfg.reward.address)
    link = server.link(MODEL, 64, device=True)
    small = random_boards(64, 12)
    want = server.link(MODEL, 64, device=False).evaluate(small, Deadline.after_s(30))["value"]
    heavy = cp.ones((8192, 8192), cp.float32)
    with cp.cuda.Stream(non_blocking=True) as stream:
        for i in range(10):
            heavy @ heavy  # queued ahead of the wave's inputs
            link.device_inputs[:64].set(random_boards(64, 100 + i))
            with pytest.raises(LeafChannelError) as info:
                link.evaluate_device(64, Deadline.after_s(0.002))
            assert info.value.code.name == "DEADLINE_EXCEEDED"
            stream.synchronize()
            link.device_inputs[:64].set(small)
            link.outputs["value"].fill(np.nan)
            got = link.evaluate_device(64, Deadline.after_s(30))["value"][:64].get()
            np.testing.assert_allclose(got, want, atol=2e-3)


def test_a_search_whose_reward_service_stops_keeps_its_tree_and_goes_on(co_located):
    """The reward service's in-process server closes mid-search, as its stop
    begins (the last test of the module: the fixture's is closed): the next
    wave is refused and undone, and the search goes on with rollouts in the
    same tree, and says why."""
    import threading

    cfg, search, _ = co_located
    handoff = search.servicer.handoff
    assert handoff.wait_device_channels(30.0) == cfg.search.device_channels
    lent = list(handoff._device_free)
    before = sum(ev.totals.calls for ev in lent)
    answer = {}

    def long_search():
        with channel(cfg.search.address) as ch:
            answer["r"] = search_pb2_grpc.SearchServiceStub(ch).Search(search_pb2.SearchRequest(
                game="connect4", moves="", simulations=10_000_000, deadline_ms=3000,
                evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=60)

    thread = threading.Thread(target=long_search)
    thread.start()
    end = time.monotonic() + 30
    while sum(ev.totals.calls for ev in lent) < before + 3 and time.monotonic() < end:
        time.sleep(0.001)
    in_process.find(cfg.reward.address).close()  # as the reward service's stop begins
    thread.join(60)
    r = answer["r"]
    assert r.handoff == "in_process" and 0 < r.model_simulations < r.simulations and r.deadline_reached
    assert "in process" in r.evaluation_failure and "UNAVAILABLE" in r.evaluation_failure
