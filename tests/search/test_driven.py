"""Driven callers in co-located mode (InProcessLink.drive, reward_service/in_process.py;
Batcher.drive): a search's whole loop of waves runs on the model's
critical-lane worker thread, each wave merged into that lane's next batch,
with no thread hand-off per wave. Here on the CPU with host waves (a real
reward service and its ONNX model): the answers are Evaluate's, two callers'
waves share a batch, every bad or late wave is thrown back into the caller's
generator with its status while the lane goes on, what the generator raises
reaches its caller, and a search handed back at DETACH ends on its own
thread. A CUDA search driven so: test_in_process_gpu.py."""
from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from conftest import loopback_config, wait_for
from prometheus_client import REGISTRY
from tandem.v1 import reward_pb2

from reward_service import server as reward_server
from search_service.evaluators import HANDOFF_IN_PROCESS, DeviceWaves, LeafChannelEvaluator
from search_service.games import connect4 as c4
from search_service.mcts.backend import DETACH, EvaluationFailed
from tandem import in_process
from tandem.leaf_channel import LeafChannelError
from tandem.deadline import Deadline

MODEL = "connect4_value"
WORKER = f"batcher-{MODEL}-critical"  # the critical lane's worker thread (Batcher's name for it)


def boards(*moves: str) -> np.ndarray:
    return c4.observation(c4.stack([c4.parse_moves(m) for m in moves]))


@pytest.fixture(scope="module")
def server():
    """A reward service (CPU), its in-process server offered as co-located mode offers it."""
    cfg = loopback_config()
    service = reward_server.start(cfg, follow_scheduler=False)
    in_process.offer(cfg.reward.address, service.servicer.in_process)
    yield service.servicer.in_process
    in_process.withdraw(service.servicer.in_process)
    service.stop()


def figure(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"model": MODEL, "lane": "critical", **labels}) or 0.0


def waves_of(*inputs, log: list | None = None):
    """A generator that yields each of ``inputs`` as a wave and returns what
    came back for each (outputs, or the LeafChannelError's code and message),
    noting the thread of each step in ``log``."""
    answers = []
    for x in inputs:
        if log is not None:
            log.append(threading.current_thread().name)
        try:
            answers.append((yield x))
        except LeafChannelError as exc:
            answers.append((exc.code, str(exc)))
    return answers


def test_a_driven_caller_runs_on_the_critical_worker_and_gets_evaluates_answers(server):
    link = server.link(MODEL, 16, device=False)
    x, y = boards("", "4", "4453"), boards("172737")
    want = [link.evaluate(x), link.evaluate(y)]
    requests, successes = figure("tandem_reward_model_requests_total"), figure("tandem_reward_model_request_successes_total")
    log = []
    got = link.drive(waves_of(x, y, log=log), Deadline.after_s(30))
    assert log == [WORKER, WORKER] and threading.current_thread().name != WORKER
    for answer, expected in zip(got, want):
        assert set(answer) == {"value", "policy_logits"}
        for name in answer:
            np.testing.assert_array_equal(answer[name], expected[name])
    assert figure("tandem_reward_model_requests_total") == requests + 2
    assert figure("tandem_reward_model_request_successes_total") == successes + 2
    assert link.bucket == 1 and link.queue_ms >= 0 and link.compute_ms > 0  # the last wave's figures


def test_two_driven_callers_waves_share_one_batch(server):
    """Batching across searches: two generators handed over while the lane
    runs a third caller's wave have their next waves run as one batch."""
    batcher = server.batchers[MODEL]
    blocker, links = server.link(MODEL, 8, device=False), [server.link(MODEL, 8, device=False) for _ in range(2)]
    run, holding, release, batches = batcher._run, threading.Event(), threading.Event(), []
    marker = boards("1111")

    def spy(batch):  # the real run, held while it runs the blocker's wave; notes each batch's driven waves
        batches.append(sum(r.driver is not None for r in batch.requests))
        if any(np.array_equal(r.feeds["board"], marker) for r in batch.requests):
            holding.set()
            assert release.wait(30)
        return run(batch)

    want = [blocker.evaluate(boards("4")), blocker.evaluate(boards("44"))]
    got = [None, None]
    batcher._run = spy
    try:
        held = threading.Thread(target=lambda: blocker.evaluate(marker, Deadline.after_s(30)))
        held.start()
        assert holding.wait(30)
        callers = [threading.Thread(target=lambda i=i: got.__setitem__(
            i, links[i].drive(waves_of(boards("4"), boards("44")), Deadline.after_s(30)))) for i in range(2)]
        for t in callers:
            t.start()
        assert wait_for(lambda: len(batcher._lanes[reward_pb2.REQUEST_CLASS_CRITICAL].drivers) == 2, 10)
        release.set()
        for t in [held, *callers]:
            t.join(30)
    finally:
        batcher._run = run
    assert 2 in batches, batches  # the two callers' waves in one batch
    for answers in got:
        for answer, expected in zip(answers, want):
            np.testing.assert_allclose(answer["value"], expected["value"], rtol=1e-5, atol=1e-6)


def test_a_bad_or_late_driven_wave_is_thrown_back_counted_and_the_caller_goes_on(server):
    link = server.link(MODEL, 4, device=False)
    invalid = figure("tandem_reward_model_request_failures_total", reason="invalid_input")
    late = figure("tandem_reward_model_request_failures_total", reason="deadline_exceeded")
    answers = link.drive(waves_of(np.full((1, 2, 6, 7), 0.7), np.zeros((5, 2, 6, 7), np.uint8), 3, boards("4")),
                         Deadline.after_s(30))
    codes = [a[0] if isinstance(a, tuple) else "ok" for a in answers]
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3 + ["ok"]
    assert "dtype float64" in answers[0][1] and "1..4 rows" in answers[1][1] and "a host link" in answers[2][1]
    assert figure("tandem_reward_model_request_failures_total", reason="invalid_input") == invalid + 3
    (code, message), = link.drive(waves_of(boards("4")), Deadline.after_s(-0.001))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "not run" in message
    assert figure("tandem_reward_model_request_failures_total", reason="deadline_exceeded") == late + 1
    assert link.evaluate(boards("4"))["value"].shape == (1, 1)  # the link and the lane go on


def test_what_a_driven_generator_raises_reaches_its_caller_and_the_lane_goes_on(server):
    link = server.link(MODEL, 4, device=False)

    def broken():
        yield boards("4")
        raise ValueError("a bug in the search")

    with pytest.raises(ValueError, match="a bug in the search"):
        link.drive(broken())
    assert link.evaluate(boards("4"))["value"].shape == (1, 1)


def test_a_reward_service_stopping_mid_drive_throws_unavailable_and_refuses_new_drives():
    cfg = loopback_config()
    service = reward_server.start(cfg, follow_scheduler=False)
    server = service.servicer.in_process
    link = server.link(MODEL, 4, device=False)
    began, closed = threading.Event(), threading.Event()

    def until_closed():
        first = yield boards("4")
        began.set()
        assert closed.wait(30)  # the worker waits here while the service is told to stop
        try:
            yield boards("44")
        except LeafChannelError as exc:
            return first, exc.code, str(exc)
        return first, None, ""

    answer = {}
    caller = threading.Thread(target=lambda: answer.setdefault("r", link.drive(until_closed())))
    caller.start()
    assert began.wait(30)
    server.close()
    closed.set()
    caller.join(30)
    first, code, message = answer["r"]
    assert first["value"].shape == (1, 1) and code == grpc.StatusCode.UNAVAILABLE and "stopping" in message
    with pytest.raises(LeafChannelError) as info:
        link.drive(waves_of(boards("4")))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    service.stop()


def test_a_search_handed_back_at_detach_ends_on_its_own_thread(server):
    """DeviceWaves.run: the search's set-up up to its first wave runs on the
    caller's thread, its waves on the worker until it yields DETACH (the
    model stopped valuing its leaves), the rest on the caller's thread
    again; a refused wave reaches the search as EvaluationFailed, naming why."""
    waves = DeviceWaves(LeafChannelEvaluator(server.link(MODEL, 8, device=False), 30, HANDOFF_IN_PROCESS), None)
    assert waves.driven
    seen, errors = [], []

    def steps():
        seen.append(threading.current_thread().name)
        try:
            yield 4  # a device wave, which a host link refuses: INVALID_ARGUMENT
        except EvaluationFailed as exc:
            errors.append(str(exc))
            seen.append(threading.current_thread().name)
        yield DETACH
        seen.append(threading.current_thread().name)
        return "answered"

    caller = threading.current_thread().name
    assert waves.run(steps()) == "answered"
    assert seen == [caller, WORKER, caller]
    assert "in process" in errors[0] and "a host link" in errors[0]


def test_a_refused_drive_runs_the_search_wave_by_wave_on_its_own_thread():
    """A reward service stopping: InProcessLink.drive refuses (UNAVAILABLE) and the
    search runs on its own thread, each wave's failure thrown in (here the
    host link's refusal of a device wave, which the link checks first)."""
    cfg = loopback_config()
    service = reward_server.start(cfg, follow_scheduler=False)
    waves = DeviceWaves(LeafChannelEvaluator(service.servicer.in_process.link(MODEL, 8, device=False), 30,
                                             HANDOFF_IN_PROCESS), None)
    service.stop()
    seen, errors = [], []

    def steps():
        seen.append(threading.current_thread().name)
        try:
            yield 4
        except EvaluationFailed as exc:
            errors.append(str(exc))
        return len(seen)

    assert waves.run(steps()) == 1 and seen == [threading.current_thread().name]
    assert errors == ["reward service (in process): INVALID_ARGUMENT: evaluate_device: a host link; use evaluate"]
