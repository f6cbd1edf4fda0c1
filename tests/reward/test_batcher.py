"""The dynamic batcher on its own (no model, no GPU): merging, bucket padding,
request classes and their lanes (a worker thread each, side by side),
deadlines, the bounded queue, failures and concurrency."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tandem.v1 import reward_pb2

from reward_service.batcher import (
    LANES,
    Batch,
    Batcher,
    BatcherClosed,
    DeadlineExceeded,
    QueueFull,
    bucket_for,
)
from tandem.deadline import Deadline

CRITICAL, BULK = reward_pb2.REQUEST_CLASS_CRITICAL, reward_pb2.REQUEST_CLASS_BULK


class Model:
    """A fake model run: y = 2x + row tag; records every batch, the thread
    that ran it and how many runs of each lane overlapped; can be held.

    ``hold(*lanes)`` makes runs of those lanes (default: both) wait at
    ``gate`` until it is set; ``wait_inside(n)`` waits until ``n`` runs wait there.
    """

    def __init__(self, fail_on=None):
        self.batches: list[Batch] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on = fail_on
        self.threads: list[str] = []  # the thread that ran each batch
        self.held_lanes: tuple[int, ...] = ()
        self._cv = threading.Condition()
        self._inside = 0  # runs waiting at the gate; guarded by _cv
        self._running = {CRITICAL: 0, BULK: 0}  # guarded by _cv
        self.most_running = {CRITICAL: 0, BULK: 0}  # runs of one lane at once, at most (the batcher promises 1)
        self.most_running_total = 0  # runs of both lanes at once, at most

    def hold(self, *lanes):
        self.held_lanes = lanes or (CRITICAL, BULK)
        self.gate.clear()

    def wait_inside(self, n: int, timeout: float = 5.0) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._inside >= n, timeout)

    def __call__(self, batch: Batch) -> dict:
        with self._cv:
            self._running[batch.lane] += 1
            self.most_running[batch.lane] = max(self.most_running[batch.lane], self._running[batch.lane])
            self.most_running_total = max(self.most_running_total, sum(self._running.values()))
        try:
            return self._run(batch)
        finally:
            with self._cv:
                self._running[batch.lane] -= 1

    def _run(self, batch: Batch) -> dict:
        if batch.lane in self.held_lanes and not self.gate.is_set():
            with self._cv:
                self._inside += 1
                self._cv.notify_all()
            try:
                assert self.gate.wait(10)
            finally:
                with self._cv:
                    self._inside -= 1
        self.batches.append(batch)
        self.threads.append(threading.current_thread().name)
        x = batch.feeds()["x"]
        assert x.shape[0] == batch.bucket
        if self.fail_on is not None and (x[: batch.rows] == self.fail_on).any():
            raise RuntimeError("model run failed")
        return {"y": x * 2, "z": x.sum(axis=1, keepdims=True)}

    def ran(self, lane=None) -> list:
        """(batch, thread name) of every run batch (of ``lane``)."""
        return [(b, t) for b, t in zip(self.batches, self.threads) if lane is None or b.lane == lane]


def rows_of(value: float, n: int) -> dict:
    return {"x": np.full((n, 3), value, np.float32)}


def make(model, **kw) -> Batcher:
    kw.setdefault("buckets", (1, 2, 4, 8))
    kw.setdefault("max_batch_size", 64)
    kw.setdefault("max_queue_delay_us", 0)
    kw.setdefault("max_queue_size", 64)
    return Batcher(model, **kw)


def block(model: Model, b: Batcher, *lanes) -> list:
    """Occupies the worker of each of ``lanes`` (default: the bulk lane's) with
    one request until model.gate is set; returns those requests."""
    lanes = lanes or (BULK,)
    model.hold(*lanes)
    blockers = []
    for i, lane in enumerate(lanes):
        blockers.append(b.submit(rows_of(-1, 1), 1, lane))
        assert model.wait_inside(i + 1)
    return blockers


def test_bucket_for():
    assert bucket_for(1, (1, 4, 16)) == 1
    assert bucket_for(3, (1, 4, 16)) == 4
    assert bucket_for(16, (1, 4, 16)) == 16
    assert bucket_for(17, (1, 4, 16)) == 17
    assert bucket_for(5, ()) == 5


def test_batch_fill_pads_with_zeros_and_feeds_avoids_copies():
    a, b = rows_of(1, 2), rows_of(2, 1)
    from reward_service.batcher import Request

    batch = Batch([Request(a, 2), Request(b, 1)], rows=3, bucket=4, offsets=[0, 2])
    buf = {"x": np.full((4, 3), 9, np.float32)}
    batch.fill(buf)
    assert buf["x"][:, 0].tolist() == [1, 1, 2, 0]
    buf["x"][:] = 9
    batch.fill(buf, zero_padding=False)
    assert buf["x"][:, 0].tolist() == [1, 1, 2, 9]
    lone = Batch([Request(a, 2)], rows=2, bucket=2, offsets=[0])
    assert lone.feeds()["x"] is a["x"]


def test_one_request_gets_its_outputs():
    model = Model()
    b = make(model)
    req = b.evaluate(rows_of(3, 3), 3, deadline=Deadline.after_s(5))
    out = req.result()
    assert out["y"].shape == (3, 3) and (out["y"] == 6).all()
    assert req.batch_rows == 3 and req.bucket == 4  # padded to the bucket
    assert model.batches[0].bucket == 4
    b.close()


def test_queued_requests_merge_into_one_padded_batch():
    model = Model()
    b = make(model)
    block(model, b)
    reqs = [b.submit(rows_of(i, 1 + i % 2), 1 + i % 2) for i in range(3)]  # 1 + 2 + 1 rows
    model.gate.set()
    for i, r in enumerate(reqs):
        assert r.wait(5)
        assert (r.result()["y"] == 2 * i).all() and r.result()["y"].shape[0] == 1 + i % 2
    assert [(x.rows, x.bucket) for x in model.batches] == [(1, 1), (4, 4)]
    b.close()


def test_output_names_select_outputs():
    model = Model()
    b = make(model)
    req = b.evaluate(rows_of(1, 2), 2, output_names=["z"])
    assert list(req.result()) == ["z"] and req.result()["z"].tolist() == [[3.0], [3.0]]
    b.close()


def test_merging_stops_at_the_largest_bucket_and_a_large_request_runs_alone_unpadded():
    model = Model()
    b = make(model, buckets=(1, 2, 4, 8), max_batch_size=64)
    block(model, b)
    small = [b.submit(rows_of(i, 3), 3) for i in range(3)]  # 3 + 3 fit 8, the third does not
    big = b.submit(rows_of(7, 20), 20)
    model.gate.set()
    for r in small + [big]:
        assert r.wait(5) and r.error is None
    assert [(x.rows, x.bucket) for x in model.batches[1:]] == [(6, 8), (3, 4), (20, 20)]
    assert big.result()["y"].shape == (20, 3) and (big.result()["y"] == 14).all()
    b.close()


def test_a_critical_request_completes_while_a_bulk_batch_is_held_running():
    """The issue's case: a trainer's 64-row bulk batch is running (held inside
    the model) when a frame's critical request arrives; the critical lane runs
    it at once on its own thread, while the bulk batch still runs."""
    model = Model()
    b = make(model, buckets=(1, 2, 4, 8, 16, 32, 64))
    model.hold(BULK)
    bulk = b.submit(rows_of(1, 64), 64, BULK)
    assert model.wait_inside(1)
    crit = b.evaluate(rows_of(3, 1), 1, CRITICAL, deadline=Deadline.after_s(10))
    assert (crit.result()["y"] == 6).all()
    assert not bulk.done() and model.wait_inside(1, timeout=0)  # the bulk batch is still running
    assert model.ran(CRITICAL)[0][1] == "batcher-model-critical"
    assert model.most_running_total == 2  # the two lanes ran side by side
    model.gate.set()
    assert bulk.wait(5) and bulk.result()["y"].shape == (64, 3)
    assert model.ran(BULK)[0][1] == "batcher-model-bulk"
    b.close()


def test_lanes_never_mix_and_critical_padding_is_zeros():
    model = Model()
    b = make(model, buckets=(1, 2, 4, 8))
    blockers = block(model, b, CRITICAL, BULK)
    bulk_a = b.submit(rows_of(1, 1), 1, BULK)
    bulk_b = b.submit(rows_of(2, 4), 4, BULK)
    crit_a = b.submit(rows_of(3, 2), 2, CRITICAL)
    crit_b = b.submit(rows_of(4, 1), 1, CRITICAL)  # 3 critical rows: bucket 4, one padding row
    model.gate.set()
    for r in (bulk_a, bulk_b, crit_a, crit_b):
        assert r.wait(5) and r.error is None
    batches = [batch for batch in model.batches if not set(batch.requests) & set(blockers)]
    crit_batch = next(x for x in batches if x.lane == CRITICAL)
    bulk_batch = next(x for x in batches if x.lane == BULK)
    assert crit_batch.requests == [crit_a, crit_b] and (crit_batch.rows, crit_batch.bucket) == (3, 4)
    assert crit_batch.feeds()["x"][3:].tolist() == [[0, 0, 0]]  # padding: zeros, never a bulk request
    assert bulk_batch.requests == [bulk_a, bulk_b] and (bulk_batch.rows, bulk_batch.bucket) == (5, 8)
    for batch, thread in model.ran():
        assert {r.request_class for r in batch.requests} == {batch.lane}
        assert thread == f"batcher-model-{LANES[batch.lane]}"
    b.close()


def test_critical_does_not_wait_but_bulk_waits_for_company():
    """No timing assertion a slow machine could fail: the merge delay is a
    minute, so a request that waited for company would not be answered within
    the test's waits, and a bulk one is surely still waiting after 0.2 s."""
    model = Model()
    b = make(model, max_queue_delay_us=60_000_000)
    b.evaluate(rows_of(1, 1), 1, CRITICAL, deadline=Deadline.after_s(10)).result()
    r1 = b.submit(rows_of(1, 1), 1, BULK)
    r2 = b.submit(rows_of(2, 1), 1, BULK)
    time.sleep(0.2)
    assert not r1.done() and not r2.done()  # waiting for company
    b.evaluate(rows_of(1, 1), 1, CRITICAL, deadline=Deadline.after_s(10)).result()  # not behind them
    assert not r1.done()
    r3 = b.submit(rows_of(3, 6), 6, BULK)  # 8 rows: a full batch's worth does not wait
    assert r1.wait(5) and r2.wait(5) and r3.wait(5)
    assert model.ran(BULK)[-1][0].requests == [r1, r2, r3]
    b.close()


@pytest.mark.parametrize("lane", [CRITICAL, BULK])
def test_a_passed_deadline_is_refused_at_submit(lane):
    model = Model()
    b = make(model)
    with pytest.raises(DeadlineExceeded):
        b.submit(rows_of(1, 1), 1, lane, deadline=Deadline.after_s(-0.001))
    s = b.stats()
    assert s["expired"] == 1 and s["lanes"][LANES[lane]]["expired"] == 1 and not model.batches
    b.close()


@pytest.mark.parametrize("lane", [CRITICAL, BULK])
def test_a_request_that_expires_in_the_queue_is_never_run(lane):
    model = Model()
    b = make(model)
    block(model, b, lane)
    doomed = b.submit(rows_of(5, 1), 1, lane, deadline=Deadline.after_s(0.05))
    kept = b.submit(rows_of(6, 1), 1, lane, deadline=Deadline.after_s(10))
    time.sleep(0.1)
    model.gate.set()
    assert doomed.wait(5) and kept.wait(5)
    with pytest.raises(DeadlineExceeded):
        doomed.result()
    assert (kept.result()["y"] == 12).all()
    ran = [r for batch in model.batches for r in batch.requests]
    assert doomed not in ran
    assert b.stats()["lanes"][LANES[lane]]["expired"] == 1
    b.close()


@pytest.mark.parametrize("lane", [CRITICAL, BULK])
def test_evaluate_gives_up_at_the_deadline_and_cancels(lane):
    model = Model()
    b = make(model)
    block(model, b, lane)
    with pytest.raises(DeadlineExceeded):
        b.evaluate(rows_of(5, 1), 1, lane, deadline=Deadline.after_s(0.05))
    assert b.stats()["queued"] == 0
    model.gate.set()
    b.evaluate(rows_of(1, 1), 1, lane).result()
    assert all(r.feeds["x"][0, 0] != 5 for batch in model.batches for r in batch.requests)
    b.close()


def test_a_running_request_with_targets_is_waited_for_past_its_deadline():
    """A request writing into targets (a leaf channel's CUDA region) holds that
    memory while it runs: past the deadline the caller waits for it instead of
    letting go (and the region be closed) under the copy. One without targets
    gives up at once, as before."""
    model = Model()
    b = make(model)
    model.hold(CRITICAL)
    target = {"y": np.zeros((1, 3), np.float32)}
    deadline = Deadline.after_s(2.0)  # the worker takes the request long before
    answer = {}
    waiter = threading.Thread(target=lambda: answer.update(done=b.evaluate(
        rows_of(5, 1), 1, CRITICAL, deadline=deadline, targets=target)))
    waiter.start()
    assert model.wait_inside(1)  # running
    time.sleep(max(deadline.left_s(), 0) + 0.2)  # the deadline passed while it runs
    assert waiter.is_alive()  # still waiting for the run
    model.gate.set()
    waiter.join(5)
    assert answer["done"].done() and answer["done"].error is None  # run, late, not abandoned
    model.hold(CRITICAL)
    running = b.submit(rows_of(6, 1), 1, CRITICAL)
    assert model.wait_inside(1)
    with pytest.raises(DeadlineExceeded):
        b.evaluate(rows_of(7, 1), 1, CRITICAL, deadline=Deadline.after_s(0.05))  # queued: cancelled
    model.gate.set()
    running.wait(5)
    b.close()


def _writing_targets(model: Model):
    """A run that writes each request's targets itself (as the bound runner
    does for a leaf channel's CUDA region) and marks them written."""

    def run(batch: Batch) -> dict:
        out = model(batch)
        for req, off in zip(batch.requests, batch.offsets):
            if req.targets:
                req.targets["y"][:] = out["y"][off : off + req.rows]
                req.targets_written = True
        return out

    return run


def test_on_written_answers_from_the_worker_before_the_waiter_wakes():
    """A request whose run wrote its targets is answered by on_written on the
    lane's worker, with its result fields filled and before done; requests
    without targets, or whose run failed, never call it; a failing on_written
    leaves answered False, and the request is done as before."""
    model = Model(fail_on=9)
    b = make(_writing_targets(model))
    seen = []

    def answer(req):
        seen.append((threading.current_thread().name, req.done(), req.bucket, req.compute_ms > 0))
        return True

    target = {"y": np.zeros((2, 3), np.float32)}
    done = b.evaluate(rows_of(3, 2), 2, CRITICAL, targets=target, on_written=answer)
    assert done.answered and done.targets_written and done.error is None
    assert seen == [(model.threads[-1], False, 2, True)]  # the worker, before done, the fields set
    assert (target["y"] == 6).all()
    plain = b.evaluate(rows_of(4, 1), 1, CRITICAL, on_written=answer)  # no targets: never called
    assert not plain.answered and len(seen) == 1
    failed = b.evaluate(rows_of(9, 1), 1, CRITICAL, targets={"y": np.zeros((1, 3), np.float32)}, on_written=answer)
    assert failed.error is not None and not failed.answered and len(seen) == 1

    for refusing in (lambda req: False, lambda req: 1 / 0):  # a send refused; a bug
        late = b.evaluate(rows_of(5, 1), 1, CRITICAL, targets={"y": np.zeros((1, 3), np.float32)},
                          on_written=refusing)
        assert late.done() and late.error is None and not late.answered  # the waiter answers instead
    b.close()


def test_batch_mates_are_done_before_a_request_is_answered_from_the_worker():
    """A plain request merged with a wave is set done before the wave's
    on_written runs: it never waits for another request's reply."""
    model = Model()
    b = make(_writing_targets(model))
    model.hold(CRITICAL)
    blocker = b.submit(rows_of(-1, 1), 1, CRITICAL)
    assert model.wait_inside(1)  # the worker is busy: the next two are merged into one batch
    plain = b.submit(rows_of(2, 1), 1, CRITICAL)
    seen = []
    wave = b.submit(rows_of(3, 1), 1, CRITICAL, targets={"y": np.zeros((1, 3), np.float32)},
                    on_written=lambda req: seen.append(plain.done()) or True)
    model.gate.set()
    assert wave.wait(5) and plain.wait(5) and blocker.wait(5)
    assert len(model.batches[-1].requests) == 2  # merged
    assert seen == [True] and wave.answered
    b.close()


def test_the_runs_figures_are_recorded_before_its_waiters_go_on():
    """``executed`` runs once per run, failed ones too, before any waiter of
    the batch wakes -- a reader after a reply finds the run counted -- also
    for a plain request merged with a wave the worker answers (whose reply
    may take its time); in a batch of worker-answered waves only, after
    their replies. A raising ``executed`` loses its figures, not the lane."""
    model = Model(fail_on=9)
    recorded = []
    release = threading.Event()

    def executed(batch, seconds):
        recorded.append((len(batch.requests), seconds >= 0))
        if batch.requests[0].feeds["x"][0, 0] == 7:
            raise RuntimeError("metrics broke")

    b = make(_writing_targets(model), executed=executed)
    assert b.evaluate(rows_of(1, 1), 1, CRITICAL).done() and recorded == [(1, True)]
    with pytest.raises(RuntimeError):
        b.evaluate(rows_of(9, 1), 1, CRITICAL).result()  # a failed run is counted too
    assert recorded[-1] == (1, True)
    seen = []
    wave = b.evaluate(rows_of(3, 1), 1, CRITICAL, targets={"y": np.zeros((1, 3), np.float32)},
                      on_written=lambda req: seen.append(len(recorded)) or True)
    assert wave.answered and seen == [2] and len(recorded) == 3  # the reply first, then the figures
    model.hold(CRITICAL)
    blocker = b.submit(rows_of(-1, 1), 1, CRITICAL)
    assert model.wait_inside(1)  # the worker is busy: the next two are merged into one batch
    plain = b.submit(rows_of(2, 1), 1, CRITICAL)
    slow = b.submit(rows_of(3, 1), 1, CRITICAL, targets={"y": np.zeros((1, 3), np.float32)},
                    on_written=lambda req: release.wait(5) or True)
    model.gate.set()
    try:
        assert plain.wait(5) and blocker.wait(5)
        assert len(model.batches[-1].requests) == 2  # merged
        assert recorded[-1][0] == 2  # the merged run's figures, before its plain request woke
    finally:
        release.set()
    assert slow.wait(5) and slow.answered
    assert (b.evaluate(rows_of(7, 1), 1, CRITICAL).result()["y"] == 14).all()  # executed raised: served on
    assert b.evaluate(rows_of(1, 1), 1, CRITICAL).done() and len(recorded) == 7
    b.close()


def test_full_queue_refuses_bulk_and_sheds_bulk_for_critical():
    """The bound spans both lanes: a critical request displaces the newest
    queued bulk one, and is refused only when no bulk request is queued."""
    model = Model()
    b = make(model, max_queue_size=2)
    block(model, b, CRITICAL, BULK)  # both workers busy: what is submitted stays queued
    q1 = b.submit(rows_of(1, 1), 1, BULK)
    q2 = b.submit(rows_of(2, 1), 1, BULK)
    with pytest.raises(QueueFull, match="queue full"):
        b.submit(rows_of(3, 1), 1, BULK)
    crit = b.submit(rows_of(4, 1), 1, CRITICAL)  # sheds q2, the newest bulk
    assert q2.done()
    with pytest.raises(QueueFull):
        q2.result()
    crit2 = b.submit(rows_of(5, 1), 1, CRITICAL)  # sheds q1
    assert q1.done() and q1.error is not None
    with pytest.raises(QueueFull):  # nothing bulk left to shed
        b.submit(rows_of(6, 1), 1, CRITICAL)
    with pytest.raises(QueueFull):  # critical requests fill the bound for bulk too
        b.submit(rows_of(7, 1), 1, BULK)
    s = b.stats()
    assert s["queued"] == 2 and s["lanes"]["critical"]["queued"] == 2 and s["lanes"]["bulk"]["queued"] == 0
    model.gate.set()
    assert crit.wait(5) and (crit.result()["y"] == 8).all() and crit2.wait(5)
    s = b.stats()
    assert s["shed"] == 2 and s["refused"] == 3
    assert s["lanes"]["bulk"]["shed"] == 2 and s["lanes"]["bulk"]["refused"] == 2
    assert s["lanes"]["critical"]["shed"] == 0 and s["lanes"]["critical"]["refused"] == 1
    assert all(batch.lane == CRITICAL for batch in model.batches if crit in batch.requests)
    b.close()


def test_a_full_queue_does_not_stop_the_critical_lane_running():
    """Bulk requests filling the queue behind a held bulk batch do not keep a
    critical request from running at once (it displaces one of them)."""
    model = Model()
    b = make(model, max_queue_size=3)
    block(model, b, BULK)
    queued = [b.submit(rows_of(i, 1), 1, BULK) for i in range(3)]
    crit = b.evaluate(rows_of(9, 1), 1, CRITICAL, deadline=Deadline.after_s(10))
    assert (crit.result()["y"] == 18).all()
    assert queued[-1].done() and isinstance(queued[-1].error, QueueFull)
    assert not any(r.done() for r in queued[:2])
    model.gate.set()
    assert all(r.wait(5) for r in queued)
    b.close()


def test_a_failing_run_fails_its_batch_only():
    model = Model(fail_on=13)
    b = make(model)
    block(model, b)
    bad = b.submit(rows_of(13, 1), 1)
    mate = b.submit(rows_of(1, 1), 1)
    model.gate.set()
    assert bad.wait(5) and mate.wait(5)
    with pytest.raises(RuntimeError, match="model run failed"):
        mate.result()
    assert (b.evaluate(rows_of(2, 2), 2).result()["y"] == 4).all()  # the worker lives on
    b.close()


def test_close_runs_what_is_queued_in_both_lanes_then_refuses():
    model = Model()
    b = make(model)
    block(model, b, CRITICAL, BULK)
    queued = [b.submit(rows_of(1, 1), 1, BULK), b.submit(rows_of(2, 1), 1, CRITICAL)]
    closer = threading.Thread(target=b.close)
    closer.start()
    time.sleep(0.05)
    for lane in (CRITICAL, BULK):
        with pytest.raises(BatcherClosed):
            b.submit(rows_of(1, 1), 1, lane)
    model.gate.set()
    closer.join(5)
    assert all(r.done() and r.error is None for r in queued)
    assert not any(t.is_alive() for t in b.threads.values())


def test_bad_arguments():
    with pytest.raises(ValueError):
        Batcher(Model(), buckets=(4, 2))
    with pytest.raises(ValueError):
        Batcher(Model(), max_queue_size=0)
    b = make(Model())
    with pytest.raises(ValueError):
        b.submit(rows_of(1, 1), 0)
    with pytest.raises(ValueError, match="request_class"):
        b.submit(rows_of(1, 1), 1, request_class=7)
    with pytest.raises(ValueError, match="request_class"):  # the servicer maps UNSPECIFIED to bulk first
        b.submit(rows_of(1, 1), 1, request_class=reward_pb2.REQUEST_CLASS_UNSPECIFIED)
    b.close()


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 12), st.sampled_from([CRITICAL, BULK])), min_size=1, max_size=20),
    st.sampled_from([(), (1, 2, 4, 8), (4, 16)]),
)
def test_every_request_gets_exactly_its_own_rows(specs, buckets):
    model = Model()
    b = make(model, buckets=buckets, max_batch_size=16)
    blockers = block(model, b, CRITICAL, BULK)
    reqs = []
    for i, (n, request_class) in enumerate(specs):
        x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 1000 * i
        reqs.append((b.submit({"x": x}, n, request_class), x))
    model.gate.set()
    for r, x in reqs:
        assert r.wait(5)
        np.testing.assert_array_equal(r.result()["y"], 2 * x)
    limit = min(16, buckets[-1]) if buckets else 16
    for batch, thread in model.ran():
        if set(batch.requests) & set(blockers):
            continue
        assert batch.rows <= limit or len(batch.requests) == 1
        assert batch.bucket == bucket_for(batch.rows, buckets) if batch.rows <= limit else batch.bucket == batch.rows
        # one lane per batch, run by that lane's worker; first in, first out within it
        assert {r.request_class for r in batch.requests} == {batch.lane}
        assert thread == f"batcher-model-{LANES[batch.lane]}"
    for lane in (CRITICAL, BULK):
        order = [r for batch, _ in model.ran(lane) for r in batch.requests if r not in blockers]
        assert order == [r for r, _ in reqs if r.request_class == lane]
    b.close()


def test_many_threads_at_once():
    model = Model()
    b = make(model, buckets=(1, 2, 4, 8, 16), max_queue_delay_us=200, max_queue_size=1000)
    errors = []

    def client(k):
        rng = np.random.default_rng(k)
        for j in range(30):
            n = int(rng.integers(1, 5))
            x = rng.random((n, 3), dtype=np.float32)
            try:
                out = b.evaluate({"x": x}, n, CRITICAL if j % 3 == 0 else BULK, deadline=Deadline.after_s(10))
                np.testing.assert_array_equal(out.result()["y"], 2 * x)
            except Exception as exc:  # collected: assertion errors in threads are lost otherwise
                errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(model.batches) < 8 * 30  # some requests were merged
    assert model.most_running == {CRITICAL: 1, BULK: 1}  # never two runs of one lane at once
    # Each lane's runs all on its one worker thread (see the module docstring), never the other's requests.
    for lane in (CRITICAL, BULK):
        assert {t for _, t in model.ran(lane)} == {f"batcher-model-{LANES[lane]}"}
        assert all(r.request_class == lane for batch, _ in model.ran(lane) for r in batch.requests)
    s = b.stats()
    assert s["lanes"]["critical"]["submitted"] == 8 * 10 and s["lanes"]["bulk"]["submitted"] == 8 * 20
    assert s["lanes"]["critical"]["batches"] + s["lanes"]["bulk"]["batches"] == s["batches"] == len(model.batches)
    b.close()


def test_unmergeable_models_run_one_request_per_batch():
    """A model whose requests cannot be concatenated (fixed batch, ragged
    dimension) gets each request in a batch of its own, never merged."""
    seen = []

    def run(batch):
        seen.append(len(batch.requests))
        return {"y": np.zeros((batch.rows, 1), np.float32)}

    b = Batcher(run, max_batch_size=8, max_queue_delay_us=50_000, merge=False, name="fixed")
    try:
        reqs = [b.submit({"x": np.zeros((1, 3), np.float32)}, 1) for _ in range(4)]
        for r in reqs:
            assert r.wait(5.0) and r.error is None
        assert seen and max(seen) == 1
    finally:
        b.close()


def test_a_failure_after_the_run_answers_the_requests_and_keeps_the_worker():
    calls = []

    def run(batch):
        calls.append(batch.rows)
        if len(calls) == 1:
            return {"y": np.float32(1.0)}  # 0-d: cannot be split per request
        return {"y": np.zeros((batch.rows, 1), np.float32)}

    b = Batcher(run, max_batch_size=8, name="scalar")
    try:
        first = b.submit({"x": np.zeros((1, 3), np.float32)}, 1)
        assert first.wait(5.0) and first.error is not None
        second = b.submit({"x": np.zeros((1, 3), np.float32)}, 1)
        assert second.wait(5.0) and second.error is None
    finally:
        b.close()


def test_warm_up_runs_on_both_lanes_threads_one_at_a_time_before_the_constructor_returns():
    model, warmed_on, active, most = Model(), [], [0], [0]
    lock = threading.Lock()

    def warm_up(lane):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.05)  # a slow warm-up: the other lane's would overlap it if they ran at once
        warmed_on.append((lane, threading.current_thread().name))
        with lock:
            active[0] -= 1

    b = make(model, warm_up=warm_up)
    try:
        # Done by the time the constructor returns: the critical lane's, then the bulk lane's.
        assert warmed_on == [(CRITICAL, "batcher-model-critical"), (BULK, "batcher-model-bulk")]
        assert most[0] == 1
        for lane in (CRITICAL, BULK):
            r = b.submit(rows_of(1, 2), 2, lane)
            assert r.wait(5) and r.result()["y"].shape == (2, 3)
        # The thread that warmed a lane up runs its requests.
        assert [(batch.lane, t) for batch, t in model.ran()] == warmed_on
        assert {k: t.name for k, t in b.threads.items()} == {"critical": "batcher-model-critical",
                                                            "bulk": "batcher-model-bulk"}
    finally:
        b.close()


@pytest.mark.parametrize("failing", [CRITICAL, BULK])
def test_a_failed_warm_up_fails_the_constructor_and_stops_every_lane(failing):
    def warm_up(lane):
        if lane == failing:
            raise RuntimeError("cuDNN: out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        make(Model(), warm_up=warm_up, name=f"broken-{failing}")
    assert not [t for t in threading.enumerate() if t.name.startswith(f"batcher-broken-{failing}-")]


# -- the bulk share (the scheduler's lever over bulk work) --------------------------------------


def test_a_small_bulk_share_holds_the_next_bulk_batch_but_never_a_critical_one():
    """Share 1 %: after a bulk batch that ran >= 0.2 s the bulk lane idles
    >= 19.8 s; a critical request is answered meanwhile, and raising the share
    to 100 % lets the queued bulk request run at once."""
    model = Model()
    b = make(model)
    b.set_bulk_share(1)
    assert b.bulk_share == 1 and b.stats()["bulk_share_percent"] == 1
    model.hold(BULK)
    first = b.submit(rows_of(1, 1), 1, BULK)
    assert model.wait_inside(1)
    time.sleep(0.2)  # the batch runs at least this long
    second = b.submit(rows_of(2, 1), 1, BULK)
    model.gate.set()
    assert first.wait(10)
    crit = b.evaluate(rows_of(3, 1), 1, CRITICAL, deadline=Deadline.after_s(10))
    assert (crit.result()["y"] == 6).all()
    assert not second.done()  # still idling out the bulk lane's share
    b.set_bulk_share(100)
    assert second.wait(10) and (second.result()["y"] == 4).all()
    b.close()


def test_the_bulk_lane_idles_in_proportion_to_its_last_batch():
    """Share 50 %: the gap before the next bulk batch is at least as long as
    the previous one ran (a lower bound: a slower machine only adds to it)."""
    starts, ends = [], []

    def run(batch):
        starts.append(time.monotonic())
        time.sleep(0.2)
        ends.append(time.monotonic())
        return {"y": batch.feeds()["x"] * 2}

    b = make(run)
    b.set_bulk_share(50)
    reqs = [b.submit(rows_of(i, 1), 1, BULK) for i in range(2)]
    time.sleep(0.05)  # both queued before the first batch ends
    assert all(r.wait(10) for r in reqs)
    if len(starts) == 1:  # the two merged into one batch: queue two more, one at a time
        reqs = [b.submit(rows_of(5, 1), 1, BULK)]
        assert reqs[0].wait(10)
        reqs.append(b.submit(rows_of(6, 1), 1, BULK))
        assert reqs[1].wait(10)
        starts, ends = starts[1:], ends[1:]
    assert starts[1] - ends[0] >= (ends[0] - starts[0]) * (100 / 50 - 1) - 1e-3
    with pytest.raises(ValueError, match="bulk share"):
        b.set_bulk_share(101)
    b.set_bulk_share(0)  # 0 (an older scheduler's assignment) means no limit
    assert b.bulk_share == 100
    b.close()


def test_take_latencies_gives_each_answered_request_of_a_lane_once():
    model = Model()
    b = make(model)
    for lane in (CRITICAL, CRITICAL, BULK):
        b.evaluate(rows_of(1, 1), 1, lane, deadline=Deadline.after_s(10))
    critical = b.take_latencies(CRITICAL)
    assert len(critical) == 2 and all(ms >= 0 for ms in critical)
    assert len(b.take_latencies(BULK)) == 1
    assert b.take_latencies(CRITICAL) == [] and b.take_latencies(BULK) == []
    b.close()
