"""NVTX ranges (tandem/nvtx.py): balanced on every path, around each search
step and each model call; a no-op where CuPy is absent."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from search_service.games import connect4
from search_service.mcts.backend import SearchParams
from search_service.mcts.cpu_reference import CpuReferenceBackend
from tandem import nvtx


def test_spans_nest_and_balance_even_when_the_body_raises():
    base_depth, base_opened = nvtx.depth(), nvtx.opened()
    with nvtx.span("outer"):
        with nvtx.span("inner"):
            assert nvtx.depth() == base_depth + 2
    with pytest.raises(ZeroDivisionError):
        with nvtx.span("fails"):
            1 / 0
    assert nvtx.depth() == base_depth and nvtx.opened() == base_opened + 3


def test_depth_is_per_thread():
    seen = []
    with nvtx.span("main"):
        t = threading.Thread(target=lambda: seen.append(nvtx.depth()))
        t.start()
        t.join()
    assert seen == [0]


def test_a_cpu_search_opens_four_balanced_ranges_per_wave():
    before = nvtx.opened()
    params = SearchParams(simulations=64, deadline_ms=None, parallel_sims=16, seed=3)
    results, _ = CpuReferenceBackend().search(connect4.parse_moves("44"), params, None, [None])
    waves = results[0].extras["waves"]
    assert waves == 4
    assert nvtx.opened() - before == 4 * waves and nvtx.depth() == 0


def test_each_model_call_is_a_range():
    from reward_service.batcher import Batch, Request
    from reward_service.session import ModelSession
    from tandem.config import RewardConfig

    cfg = RewardConfig(execution_provider="cpu")
    session = ModelSession(cfg.models[0], cfg)
    request = Request(feeds={"board": np.zeros((2, 2, 6, 7), np.uint8)}, rows=2)
    before = nvtx.opened()
    out = session.run_batch(Batch([request], rows=2, bucket=2, offsets=[0]))  # the batcher's callback
    assert out["value"].shape[0] == 2
    assert nvtx.opened() - before == 1 and nvtx.depth() == 0


def test_without_cupy_nothing_reaches_nvtx():
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert not nvtx.enabled()
    else:
        assert nvtx.enabled()
