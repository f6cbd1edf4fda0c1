"""The wave timeline (tandem/timeline.py): off, a mark keeps nothing; on, a
real leaf-channel wave on loopback leaves its marks on both sides in the
order the wave takes (client, connection thread, the critical lane's
worker, client); a child process's marks come back through dump/load; and
the benchmark's rows (bench/neural_search.py ``timeline_rows``) are the
gaps between consecutive marks, the service's merged in by time."""
from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest
from conftest import loopback_config
from tandem.v1 import reward_pb2_grpc

from bench.neural_search import timeline_rows
from reward_service import server as reward_server
from search_service.games import connect4 as c4
from tandem import timeline
from tandem.leaf_channel import LeafChannel
from tandem.server import channel
from tandem.deadline import Deadline

MODEL = "connect4_value"


@pytest.fixture
def enabled(monkeypatch, tmp_path):
    monkeypatch.setattr(timeline, "ENABLED", True)
    monkeypatch.setattr(timeline, "FOLDER", str(tmp_path))
    timeline.take()
    yield tmp_path
    timeline.take()


def test_off_a_mark_keeps_nothing(monkeypatch):
    monkeypatch.setattr(timeline, "ENABLED", False)
    timeline.take()
    timeline.mark("wave.sent")
    assert timeline.take() == [] and timeline.dump() is None


def test_a_wave_leaves_its_marks_in_the_order_it_goes(enabled):
    cfg = loopback_config()
    service = reward_server.start(cfg, follow_scheduler=False)
    try:
        with channel(cfg.reward.address, cfg) as ch:
            lc = LeafChannel.offered(reward_pb2_grpc.RewardServiceStub(ch), MODEL, 16, 30)
            try:
                timeline.take()  # the attach's
                lc.evaluate(c4.observation(c4.stack([c4.parse_moves("44")] * 3)), Deadline.after_s(30))
            finally:
                lc.close()
    finally:
        service.stop()
    names = [n for _, n in timeline.take()]
    wave = ["wave.sent", "channel.received", "channel.leased", "channel.submitted", "batch.taken", "wave.answered"]
    at = [names.index(n) for n in wave]  # each once at least, the first of each in the wave's order
    assert at == sorted(at), names
    assert names.count("wave.sent") == names.count("wave.answered") == 1


def _child_marks(folder: str) -> None:
    timeline.enable(folder)
    timeline.mark("batch.taken")
    timeline.mark("batch.synced")
    timeline.dump()


def test_a_child_process_dumps_its_marks_for_its_parent(tmp_path):
    child = mp.get_context("spawn").Process(target=_child_marks, args=(str(tmp_path),))
    child.start()
    child.join(60)
    (path,) = [tmp_path / f for f in os.listdir(tmp_path)]
    assert [n for _, n in timeline.load(str(path))] == ["batch.taken", "batch.synced"]


def test_the_rows_are_the_gaps_between_consecutive_marks():
    us = 1000  # ns
    search = []
    service = []
    for s in range(3):  # three searches of one wave each, 100 µs apart; the service's marks in between
        t = s * 100 * us
        search += [(t, "search.start"), (t + 10 * us, "wave.sent"), (t + 50 * us, "wave.answered"),
                   (t + 60 * us, "search.end")]
        service += [(t + 20 * us, "channel.received"), (t + 40 * us, "channel.replied")]
    service.append((10_000 * us, "channel.received"))  # outside the searches' span: left out
    rows = {(r["from_mark"], r["to_mark"]): r for r in timeline_rows(256, search, service, 3)}
    assert rows[("wave.sent", "channel.received")]["us_p50"] == pytest.approx(10.0)
    assert rows[("channel.received", "channel.replied")]["us_p50"] == pytest.approx(20.0)
    assert rows[("channel.replied", "wave.answered")]["count"] == 3
    total = rows[("search.start", "search.end")]
    assert total["step"] == "total" and total["us_p50"] == pytest.approx(60.0)
    assert ("search.end", "search.start") not in rows  # 2 gaps for 3 searches: fewer than the searches
    assert all(r["kind"] == "timeline" and r["wave"] == 256 for r in rows.values())
    assert np.isfinite([r["us_p90"] for r in rows.values()]).all()


def test_off_a_gpu_mark_queues_nothing(monkeypatch):
    monkeypatch.setattr(timeline, "GPU_ENABLED", False)
    timeline.gpu_mark("gpu.selected")  # no CuPy call: this runs without a GPU
    assert timeline.take_gpu() == []


@pytest.mark.gpu
def test_gpu_marks_follow_their_stream_on_the_gpus_clock(monkeypatch):
    cp = pytest.importorskip("cupy")
    monkeypatch.setattr(timeline, "GPU_ENABLED", True)
    timeline.take_gpu()
    busy = cp.RawKernel(r"""extern "C" __global__ void busy(long long ns) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    }""", "busy")
    with cp.cuda.Stream(non_blocking=True):
        timeline.gpu_mark("gpu.selected")
        busy((1,), (1,), (np.int64(200_000),))  # 200 µs on the GPU
        timeline.gpu_mark("gpu.model_start")
    (t0, a), (t1, b) = timeline.take_gpu()
    assert (a, b) == ("gpu.selected", "gpu.model_start")
    assert t1 - t0 >= 200_000  # ns: the second stamp ran after the kernel, whatever the host did
    assert timeline.take_gpu() == []
