"""The dynamic batcher on its own (no model, no GPU): merging, bucket padding,
request classes, deadlines, the bounded queue, failures and concurrency."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tandem.v1 import reward_pb2

from reward_service.batcher import (
    Batch,
    Batcher,
    BatcherClosed,
    DeadlineExceeded,
    QueueFull,
    bucket_for,
)

CRITICAL, BULK = reward_pb2.REQUEST_CLASS_CRITICAL, reward_pb2.REQUEST_CLASS_BULK


class Model:
    """A fake model run: y = 2x + row tag; records every batch; can be held."""

    def __init__(self, fail_on=None):
        self.batches: list[Batch] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_on = fail_on
        self.threads: list[str] = []  # the thread that ran each batch
        self._running = 0
        self.most_running = 0  # runs at once, at most (the batcher promises 1)
        self._count = threading.Lock()

    def hold(self):
        self.gate.clear()
        self.entered.clear()

    def __call__(self, batch: Batch) -> dict:
        with self._count:
            self._running += 1
            self.most_running = max(self.most_running, self._running)
        try:
            return self._run(batch)
        finally:
            with self._count:
                self._running -= 1

    def _run(self, batch: Batch) -> dict:
        self.entered.set()
        assert self.gate.wait(10)
        self.batches.append(batch)
        self.threads.append(threading.current_thread().name)
        x = batch.feeds()["x"]
        assert x.shape[0] == batch.bucket
        if self.fail_on is not None and (x[: batch.rows] == self.fail_on).any():
            raise RuntimeError("model run failed")
        return {"y": x * 2, "z": x.sum(axis=1, keepdims=True)}


def rows_of(value: float, n: int) -> dict:
    return {"x": np.full((n, 3), value, np.float32)}


def make(model, **kw) -> Batcher:
    kw.setdefault("buckets", (1, 2, 4, 8))
    kw.setdefault("max_batch_size", 64)
    kw.setdefault("max_queue_delay_us", 0)
    kw.setdefault("max_queue_size", 64)
    return Batcher(model, **kw)


def block(model: Model, b: Batcher):
    """Occupies the worker with one request until model.gate is set."""
    model.hold()
    first = b.submit(rows_of(-1, 1), 1)
    assert model.entered.wait(5)
    return first


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
    req = b.evaluate(rows_of(3, 3), 3, deadline=time.monotonic() + 5)
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


def test_critical_goes_first_and_bulk_rides_only_in_the_padding():
    model = Model()
    b = make(model, buckets=(1, 2, 4, 8))
    block(model, b)
    bulk_a = b.submit(rows_of(1, 1), 1, BULK)
    bulk_b = b.submit(rows_of(2, 4), 4, BULK)
    crit = b.submit(rows_of(3, 3), 3, CRITICAL)  # bucket 4: one padding row free
    model.gate.set()
    for r in (bulk_a, bulk_b, crit):
        assert r.wait(5) and r.error is None
    second, third = model.batches[1], model.batches[2]
    assert [r.request_class for r in second.requests] == [CRITICAL, BULK]
    assert (second.rows, second.bucket) == (4, 4)  # the critical bucket did not grow
    assert second.requests[1] is bulk_a
    assert third.requests == [bulk_b]
    b.close()


def test_critical_does_not_wait_but_bulk_waits_for_company():
    model = Model()
    b = make(model, max_queue_delay_us=300_000)  # 0.3 s
    t = time.monotonic()
    b.evaluate(rows_of(1, 1), 1, CRITICAL).result()
    assert time.monotonic() - t < 0.25
    t = time.monotonic()
    r1 = b.submit(rows_of(1, 1), 1, BULK)
    r2 = b.submit(rows_of(2, 1), 1, BULK)
    assert r1.wait(5) and r2.wait(5)
    assert time.monotonic() - t >= 0.25  # waited for company
    assert model.batches[-1].requests == [r1, r2]
    # A full batch's worth of rows does not wait.
    t = time.monotonic()
    b.evaluate(rows_of(1, 8), 8, BULK).result()
    assert time.monotonic() - t < 0.25
    b.close()


def test_a_passed_deadline_is_refused_at_submit():
    model = Model()
    b = make(model)
    with pytest.raises(DeadlineExceeded):
        b.submit(rows_of(1, 1), 1, deadline=time.monotonic() - 0.001)
    assert b.stats()["expired"] == 1 and not model.batches
    b.close()


def test_a_request_that_expires_in_the_queue_is_never_run():
    model = Model()
    b = make(model)
    block(model, b)
    doomed = b.submit(rows_of(5, 1), 1, deadline=time.monotonic() + 0.05)
    kept = b.submit(rows_of(6, 1), 1, deadline=time.monotonic() + 10)
    time.sleep(0.1)
    model.gate.set()
    assert doomed.wait(5) and kept.wait(5)
    with pytest.raises(DeadlineExceeded):
        doomed.result()
    assert (kept.result()["y"] == 12).all()
    ran = [r for batch in model.batches for r in batch.requests]
    assert doomed not in ran
    b.close()


def test_evaluate_gives_up_at_the_deadline_and_cancels():
    model = Model()
    b = make(model)
    block(model, b)
    with pytest.raises(DeadlineExceeded):
        b.evaluate(rows_of(5, 1), 1, deadline=time.monotonic() + 0.05)
    assert b.stats()["queued"] == 0
    model.gate.set()
    b.evaluate(rows_of(1, 1), 1).result()
    assert all(r.feeds["x"][0, 0] != 5 for batch in model.batches for r in batch.requests)
    b.close()


def test_full_queue_refuses_bulk_and_sheds_bulk_for_critical():
    model = Model()
    b = make(model, max_queue_size=2)
    block(model, b)
    q1 = b.submit(rows_of(1, 1), 1, BULK)
    q2 = b.submit(rows_of(2, 1), 1, BULK)
    with pytest.raises(QueueFull, match="queue full"):
        b.submit(rows_of(3, 1), 1, BULK)
    crit = b.submit(rows_of(4, 1), 1, CRITICAL)  # sheds q2, the newest bulk
    assert q2.done()
    with pytest.raises(QueueFull):
        q2.result()
    crit2_refused = None
    try:
        b.submit(rows_of(5, 1), 1, CRITICAL)  # q1 is shed now
    except QueueFull as exc:
        crit2_refused = exc
    assert crit2_refused is None and q1.done()
    with pytest.raises(QueueFull):  # nothing bulk left to shed
        b.submit(rows_of(6, 1), 1, CRITICAL)
    assert b.stats()["queued"] == 2
    model.gate.set()
    assert crit.wait(5) and (crit.result()["y"] == 8).all()
    s = b.stats()
    assert s["shed"] == 2 and s["refused"] == 2
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


def test_close_runs_what_is_queued_then_refuses():
    model = Model()
    b = make(model)
    block(model, b)
    queued = b.submit(rows_of(1, 1), 1)
    closer = threading.Thread(target=b.close)
    closer.start()
    time.sleep(0.05)
    with pytest.raises(BatcherClosed):
        b.submit(rows_of(1, 1), 1)
    model.gate.set()
    closer.join(5)
    assert queued.done() and queued.error is None


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
    block(model, b)
    reqs = []
    for i, (n, request_class) in enumerate(specs):
        x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 1000 * i
        reqs.append((b.submit({"x": x}, n, request_class), x))
    model.gate.set()
    for r, x in reqs:
        assert r.wait(5)
        np.testing.assert_array_equal(r.result()["y"], 2 * x)
    limit = min(16, buckets[-1]) if buckets else 16
    for batch in model.batches[1:]:
        assert batch.rows <= limit or len(batch.requests) == 1
        assert batch.bucket == bucket_for(batch.rows, buckets) if batch.rows <= limit else batch.bucket == batch.rows
        # critical requests of one batch come before its bulk ones
        classes = [r.request_class for r in batch.requests]
        assert classes == sorted(classes, key=lambda c: c != CRITICAL)
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
                out = b.evaluate({"x": x}, n, CRITICAL if j % 3 == 0 else BULK, deadline=time.monotonic() + 10)
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
    assert model.most_running == 1  # never two runs at once
    assert set(model.threads) == {"batcher-model"}  # all on the worker (see the module docstring)
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


def test_warm_up_runs_on_the_worker_thread_before_any_request():
    model, warmed_on = Model(), []
    b = make(model, warm_up=lambda: warmed_on.append(threading.current_thread().name))
    try:
        assert warmed_on == [f"batcher-{b.name}"]  # done by the time the constructor returns
        r = b.submit(rows_of(1, 2), 2)
        assert r.wait(5) and r.result()["y"].shape == (2, 3)
        assert model.threads == warmed_on  # the thread that warmed up runs the requests
    finally:
        b.close()


def test_a_failed_warm_up_fails_the_constructor():
    def broken():
        raise RuntimeError("cuDNN: out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        make(Model(), warm_up=broken)
