"""stack/frame_loop.py: the pacing schedule (on a fake clock, so nothing here
depends on the machine's speed), the frame budget arithmetic, a frame's records,
and one frame's round trip against the real search and reward servers on loopback."""
from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from conftest import free_port, loopback_config
from tandem.v1 import reward_pb2, search_pb2

from reward_service import server as reward_server
from search_service import server as search_server
from search_service.games import connect4
from stack.frame_loop import (
    FrameClient,
    Record,
    SentFrame,
    Tick,
    board_observation,
    frame_budget_ms,
    frame_latency_ms,
    game_phase,
    missed_frames,
    paced,
    shuffled_positions,
)
from tandem import tensors
from tandem.positions import load_set


# -- pacing, on a fake clock ---------------------------------------------------------------------------
class FakeClock:
    """``paced``'s clock and sleep: time moves only when it sleeps (or a test moves it).
    Times are multiples of powers of two, so the schedule compares exactly."""

    def __init__(self, now: float = 0.0):
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FakeStop:
    """``paced``'s stop event on the fake clock; ``set_at``: the time someone sets it."""

    def __init__(self, clock: FakeClock, set_at: float | None = None):
        self.clock, self.set_at, self._set = clock, set_at, False
        self.waits: list[float] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        if not self._set and self.set_at is not None and self.clock.now + seconds >= self.set_at:
            self.clock.now, self._set = self.set_at, True
        elif not self._set:
            self.clock.now += seconds
        return self._set


def _run(ticks, clock: FakeClock) -> list[tuple[int, int, float, float]]:
    """(engine, frame, due, the clock when it was yielded) of each tick."""
    return [(t.engine, t.frame, t.due, clock()) for t in ticks]


def test_paced_spreads_engines_over_the_period_and_yields_each_frame_when_due():
    clock = FakeClock(10.0)
    got = _run(paced(4, engines=4, frames=3, clock=clock, sleep=clock.sleep), clock)
    # Frame k of engine e at start + (k + e / 4) / 4 s: every 1/16 s, engine by engine.
    expected = [(e, k, 10.0 + k * 0.25 + e * 0.0625) for k in range(3) for e in range(4)]
    assert [g[:3] for g in got] == expected
    assert all(yielded == due for _, _, due, yielded in got)  # neither early nor late
    assert clock.sleeps == [0.0625] * 11  # the first is due at once (start defaults to now)


def test_paced_from_a_given_start():
    clock = FakeClock(0.0)
    got = _run(paced(2, engines=2, frames=2, start=1.0, clock=clock, sleep=clock.sleep), clock)
    assert [g[:3] for g in got] == [(0, 0, 1.0), (1, 0, 1.25), (0, 1, 1.5), (1, 1, 1.75)]
    assert clock.sleeps == [1.0, 0.25, 0.25, 0.25]


def test_paced_stops_at_the_first_frame_due_duration_s_after_start():
    clock = FakeClock(0.0)
    got = _run(paced(4, engines=2, duration_s=0.5, clock=clock, sleep=clock.sleep), clock)
    # Frames due at 0 and 0.25 s (both engines); the round due at 0.5 s is not sent.
    assert [g[:3] for g in got] == [(0, 0, 0.0), (1, 0, 0.125), (0, 1, 0.25), (1, 1, 0.375)]
    clock = FakeClock(0.0)
    assert len(list(paced(4, engines=2, duration_s=0.51, clock=clock, sleep=clock.sleep))) == 6


def test_paced_frames_bound_counts_frames_per_engine():
    clock = FakeClock(0.0)
    ticks = list(paced(8, engines=3, frames=5, clock=clock, sleep=clock.sleep))
    assert len(ticks) == 15
    assert {e: [t.frame for t in ticks if t.engine == e] for e in range(3)} == {e: list(range(5)) for e in range(3)}
    # Both bounds: the first reached ends it.
    clock = FakeClock(0.0)
    assert len(list(paced(8, engines=3, frames=5, duration_s=0.25, clock=clock, sleep=clock.sleep))) == 6


def test_a_late_frame_is_yielded_at_once_and_the_schedule_does_not_drift():
    clock = FakeClock(0.0)
    got = []
    for tick in paced(4, frames=5, clock=clock, sleep=clock.sleep):
        got.append((tick.frame, tick.due, clock()))
        if tick.frame == 0:
            clock.now += 0.625  # the consumer is slow on frame 0: frames 1 and 2 are late
    assert got == [(0, 0.0, 0.0), (1, 0.25, 0.625), (2, 0.5, 0.625), (3, 0.75, 0.75), (4, 1.0, 1.0)]
    assert clock.sleeps == [0.125, 0.25]  # no wait for the late ones; frame 3 on its own time


def test_stop_before_the_first_frame_yields_nothing():
    clock = FakeClock(0.0)
    stop = FakeStop(clock)
    stop.set()
    assert list(paced(60, engines=4, stop=stop, clock=clock, sleep=clock.sleep)) == []


def test_stop_set_while_waiting_ends_it_without_the_frame():
    clock = FakeClock(0.0)
    stop = FakeStop(clock, set_at=0.6)
    got = _run(paced(4, engines=2, stop=stop, start=0.0, clock=clock, sleep=clock.sleep), clock)
    assert [g[:3] for g in got] == [(0, 0, 0.0), (1, 0, 0.125), (0, 1, 0.25), (1, 1, 0.375), (0, 2, 0.5)]
    assert clock() == 0.6  # it woke when stopped, not at the next frame (0.625)
    assert clock.sleeps == []  # with a stop event, it waits on the event
    assert stop.waits == [0.125, 0.125, 0.125, 0.125, 0.125]


@pytest.mark.parametrize("late,expected", [
    # On time: the next frame's wait sees the stop, and that frame is not sent.
    (False, [(0, 0), (1, 0), (2, 0), (0, 1)]),
    # Late: frames past due need no wait, so the round ends and the stop is seen before the next one.
    (True, [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]),
])
def test_stop_set_by_the_consumer(late, expected):
    clock = FakeClock(0.0)
    stop = FakeStop(clock)
    got = []
    for tick in paced(4, engines=3, stop=stop, clock=clock, sleep=clock.sleep):
        got.append((tick.engine, tick.frame))
        if (tick.engine, tick.frame) == (0, 1):
            clock.now += 10.0 if late else 0.0
            stop.set()
    assert got == expected


def test_paced_on_the_real_clock_when_every_frame_is_already_due():
    """The default clock and a real Event, with no waiting: the frames are an hour late."""
    start = time.monotonic() - 3600.0
    ticks = list(paced(2, engines=2, frames=2, start=start, stop=threading.Event()))
    assert ticks == [Tick(0, 0, start), Tick(1, 0, start + 0.25), Tick(0, 1, start + 0.5), Tick(1, 1, start + 0.75)]
    stop = threading.Event()
    stop.set()
    assert list(paced(60, start=start, stop=stop)) == []


def test_paced_refuses_zero_fps():
    with pytest.raises(ZeroDivisionError):
        next(paced(0, frames=1))


# -- the frame budget ------------------------------------------------------------------------------------
def test_frame_budget_is_the_period_in_ms():
    assert frame_budget_ms(60) == pytest.approx(16.6667, abs=1e-4)
    assert frame_budget_ms(30) == pytest.approx(33.3333, abs=1e-4)
    assert frame_budget_ms(4) == 250.0
    assert frame_budget_ms(0.5) == 2000.0
    with pytest.raises(ZeroDivisionError):
        frame_budget_ms(0)


def test_missed_frames_counts_latencies_over_the_budget():
    assert missed_frames([10.0, 20.0, 20.000001, 35.0, 19.9], 20.0) == 2  # exactly on budget is not missed
    assert missed_frames((x for x in [16.0, 17.0, 40.0]), frame_budget_ms(60)) == 2
    assert missed_frames([], 16.7) == 0


# -- positions -------------------------------------------------------------------------------------------
def test_shuffled_positions_are_every_position_of_the_sets_in_an_order_fixed_by_the_seed():
    sets = ("Test_L3_R1", "Test_L2_R1")
    every = load_set(sets[0]) + load_set(sets[1])
    a = shuffled_positions(sets, seed=1)
    assert sorted(a, key=lambda p: p.source) == sorted(every, key=lambda p: p.source)
    assert shuffled_positions(list(sets), seed=1) == a
    assert shuffled_positions(sets, seed=2) != a
    assert a != every  # shuffled


def test_shuffled_positions_of_an_unknown_set():
    with pytest.raises(FileNotFoundError):
        shuffled_positions(["No_Such_Set"], seed=0)


def test_board_observation_is_the_value_models_planes():
    obs = board_observation("4")
    assert obs.shape == (1, 2, 6, 7) and obs.dtype == np.uint8
    # After one stone in column 4 the second player is to move: the stone is the opponent's (plane 1).
    assert obs[0, 0].sum() == 0 and obs[0, 1].sum() == 1 and obs[0, 1, 0, 3] == 1
    np.testing.assert_array_equal(board_observation("4453"), connect4.observation(connect4.parse_moves("4453")))


@pytest.mark.parametrize("stones,phase", [
    (0, search_pb2.GAME_PHASE_EARLY), (11, search_pb2.GAME_PHASE_EARLY),
    (12, search_pb2.GAME_PHASE_MID), (27, search_pb2.GAME_PHASE_MID),
    (28, search_pb2.GAME_PHASE_LATE), (42, search_pb2.GAME_PHASE_LATE),
])
def test_game_phase_boundaries(stones, phase):
    assert game_phase(stones) == phase


# -- a frame's records --------------------------------------------------------------------------------------
def _rec(kind: str, done: float | None, code: str | None) -> Record:
    return Record(kind, 0, 0, scheduled=1.0, sent=1.001, done=done, code=code)


def test_frame_latency_runs_from_the_reference_to_the_last_answer():
    recs = [_rec("search", 1.0125, "OK"), _rec("evaluate", 1.0075, "OK")]
    assert frame_latency_ms(recs, since=1.0) == pytest.approx(12.5)
    assert frame_latency_ms(recs, since=1.005) == pytest.approx(7.5)  # e.g. from when it was sent
    assert frame_latency_ms(recs[1:], since=1.0) == pytest.approx(7.5)


def test_frame_latency_is_none_unless_every_request_was_answered_ok():
    assert frame_latency_ms([_rec("search", 1.01, "OK"), _rec("evaluate", 1.02, "UNAVAILABLE")], 1.0) is None
    assert frame_latency_ms([_rec("search", 1.01, "OK"), _rec("evaluate", None, None)], 1.0) is None


class _Future:
    """A grpc.Future stand-in, completed by the test."""

    def __init__(self):
        self._callbacks, self._reply, self._exc = [], None, None

    def add_done_callback(self, cb):
        self._callbacks.append(cb)

    def finish(self, reply=None, exc=None):
        self._reply, self._exc = reply, exc
        for cb in self._callbacks:
            cb(self)

    def result(self):
        if self._exc is not None:
            raise self._exc
        return self._reply


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def test_a_frame_is_answered_only_when_every_request_has_its_outcome():
    frame = SentFrame(Tick(0, 3, 5.0), expected=2)
    search, evaluate = _Future(), _Future()
    frame._track(Record("search", 0, 3, 5.0, 5.001), lambda: search)
    search.finish(search_pb2.SearchResponse(evaluator=search_pb2.EVALUATOR_VALUE_MODEL, simulations=16))
    assert not frame.wait(0)  # the search's answer came before the Evaluate left
    frame._track(Record("evaluate", 0, 3, 5.0, 5.002), lambda: evaluate)
    assert not frame.wait(0)
    evaluate.finish(reward_pb2.EvaluateResponse(queue_ms=1.5, compute_ms=2.5))
    assert frame.wait(0) and frame.failure() is None
    s, e = frame.records
    assert (s.code, s.evaluator, s.simulations) == ("OK", "EVALUATOR_VALUE_MODEL", 16)
    assert (e.code, e.server_queue_ms, e.server_compute_ms) == ("OK", 1.5, 2.5)
    assert s.done is not None and e.done is not None
    assert [type(r) for r in frame.replies()] == [search_pb2.SearchResponse, reward_pb2.EvaluateResponse]


def test_a_frame_names_its_first_failure_search_first():
    frame = SentFrame(Tick(0, 0, 0.0), expected=2)
    search, evaluate = _Future(), _Future()
    frame._track(Record("search", 0, 0, 0.0, 0.0), lambda: search)
    frame._track(Record("evaluate", 0, 0, 0.0, 0.0), lambda: evaluate)
    evaluate.finish(exc=_Unavailable())
    search.finish(exc=grpc.FutureCancelledError())
    assert frame.wait(0)
    assert [r.code for r in frame.records] == ["FutureCancelledError", "UNAVAILABLE"]
    assert frame.failure() == "FutureCancelledError"
    with pytest.raises(grpc.FutureCancelledError):
        frame.replies()


def test_a_request_that_cannot_be_sent_is_recorded_as_such():
    frame = SentFrame(Tick(0, 0, 0.0), expected=1)

    def refuse():
        raise RuntimeError("channel closed")

    frame._track(Record("search", 0, 0, 0.0, 0.0), refuse)
    assert frame.wait(0)
    assert frame.calls == [None] and frame.records[0].done is not None
    assert frame.failure() == "SEND_FAILED:RuntimeError"


# -- one frame against the real servers ------------------------------------------------------------------------
# Generous gRPC deadlines and waits: they bound a hung server, they are not measured.
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def client():
    cfg = loopback_config(search={"backend": "cpu"})
    reward = reward_server.start(cfg, follow_scheduler=False)
    search = search_server.start(cfg, follow_scheduler=False)
    client = FrameClient(cfg.search.address, cfg.reward.address, cfg)
    yield client
    client.close()
    search.stop()
    reward.stop()


def _send(client: FrameClient, moves: str, **kw) -> tuple[Tick, SentFrame]:
    tick = Tick(engine=2, frame=7, due=time.monotonic())
    frame = client.send(tick, moves, seed=11, timeout_s=TIMEOUT_S, **kw)
    assert frame.wait(2 * TIMEOUT_S), "the frame's answers never came"
    return tick, frame


def test_a_frame_with_only_a_search(client):
    tick, frame = _send(client, "4453", simulations=32, evaluator="rollout")
    assert frame.failure() is None and len(frame.records) == len(frame.calls) == 1
    rec = frame.records[0]
    assert (rec.kind, rec.engine, rec.frame, rec.scheduled, rec.code) == ("search", 2, 7, tick.due, "OK")
    assert rec.scheduled <= rec.sent <= rec.done
    (reply,) = frame.replies()
    assert isinstance(reply, search_pb2.SearchResponse)
    assert reply.simulations == rec.simulations == 32 and sum(reply.visit_counts) == 32
    assert rec.evaluator == "EVALUATOR_ROLLOUT" == search_pb2.Evaluator.Name(reply.evaluator)
    assert reply.backend == "cpu_reference" and 0 <= reply.action < 7
    assert rec.server_queue_ms is None and rec.server_compute_ms is None
    assert frame_latency_ms(frame.records, tick.due) == pytest.approx((rec.done - tick.due) * 1e3)


def test_a_frame_with_a_search_and_an_evaluate(client):
    moves = "121212"  # the side to move wins in column 1
    calls = []

    def evaluate():
        calls.append(1)
        return board_observation(moves)

    tick, frame = _send(client, moves, simulations=16, evaluator="value_model", evaluate=evaluate)
    assert calls == [1]
    assert frame.failure() is None and [r.kind for r in frame.records] == ["search", "evaluate"]
    s, e = frame.records
    assert s.code == e.code == "OK" and e.scheduled == s.scheduled == tick.due and s.sent <= e.sent
    search_reply, eval_reply = frame.replies()
    assert s.evaluator == "EVALUATOR_VALUE_MODEL" and search_reply.action == 0
    assert isinstance(eval_reply, reward_pb2.EvaluateResponse) and eval_reply.model == "connect4_value"
    assert (e.server_queue_ms, e.server_compute_ms) == (eval_reply.queue_ms, eval_reply.compute_ms)
    assert e.server_queue_ms >= 0 and e.server_compute_ms >= 0
    assert [t.name for t in eval_reply.outputs] == ["value"]
    value = tensors.from_proto(eval_reply.outputs[0])
    assert value.size == 1 and -1.0 <= float(value.ravel()[0]) <= 1.0
    assert frame_latency_ms(frame.records, tick.due) == pytest.approx((max(s.done, e.done) - tick.due) * 1e3)


def test_a_frame_of_several_agents_is_one_search_batch(client):
    tick, frame = _send(client, ["4453", "121212", ""], simulations=24, evaluator="rollout", session_id="npc")
    assert frame.failure() is None and [r.kind for r in frame.records] == ["search_batch"]
    (reply,) = frame.replies()
    assert isinstance(reply, search_pb2.SearchBatchResponse) and len(reply.results) == 3
    assert reply.results[1].action == 0  # "121212": the side to move wins in column 1 at once
    assert frame.records[0].simulations == min(r.simulations for r in reply.results)
    assert reply.results[0].simulations == 24 and reply.results[2].simulations == 24
    assert frame.records[0].evaluator == "EVALUATOR_ROLLOUT"


def test_metadata_is_asked_once(client):
    meta = client.metadata()
    assert meta.name == "connect4_value" and len(meta.inputs) >= 1
    assert client.metadata() is meta


def test_an_unknown_evaluator_is_refused_before_sending(client):
    with pytest.raises(ValueError, match="evaluator"):
        client.send(Tick(0, 0, 0.0), "4", simulations=1, evaluator="oracle", seed=0, timeout_s=TIMEOUT_S)


def test_a_frame_to_servers_that_are_not_there_fails_with_their_status():
    client = FrameClient(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    try:
        tick = Tick(0, 0, time.monotonic())
        frame = client.send(tick, "4", simulations=8, evaluator="rollout", seed=0, timeout_s=TIMEOUT_S)
        assert frame.wait(2 * TIMEOUT_S)
        assert frame.failure() == "UNAVAILABLE" and frame.records[0].done is not None
        assert frame_latency_ms(frame.records, tick.due) is None
        with pytest.raises(grpc.RpcError):
            frame.replies()
    finally:
        client.close()


def test_no_engines_is_refused_rather_than_spinning():
    with pytest.raises(ValueError, match="engines"):
        next(paced(60, engines=0))
