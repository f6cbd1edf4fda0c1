"""The rows of a batch of trees on the device (a slab): grown as trees join,
kept dense as they leave (each row that stays past the new end moves into a
hole below it, its tree and small per-row state), so rows ``[0, B')`` are the
trees in use.

Shared by Connect Four's batch (``tree_batch.py``) and the game folders'
(``game_batch.py``), which copy a tree's region each their own way."""
from __future__ import annotations

import math
from typing import Callable

import cupy
import numpy as np

from search_service.cuda import abi
from search_service.mcts import tree as tr

KEY_WORDS = 3  # a tree's Philox key row: k0, k1, its tree word
# A row's small state: (the batch's attribute, a flat device array; its words a row; dtype).
PER_ROW = (("ts", abi.TREE_STATE.words, np.int32), ("cyc", abi.CYCLES.words, np.uint64), ("keys", KEY_WORDS, np.uint32))


class Slab:
    """The TreeBatch figures both CUDA batches read from their RES rows
    (``res``, as of the last :func:`refresh`)."""

    @property
    def done(self) -> np.ndarray:
        return self.res["done"].astype(np.int64)

    def live(self) -> np.ndarray:
        return self.res["outcome"][:, 0].astype(np.int8) == tr.NOT_TERMINAL


def refresh(batch, finish_trees, region: int, result) -> None:
    """Every row's RES row of ``batch``, written on the device by its module's
    ``finish_trees`` and copied back into ``batch.res`` (waits for the
    stream); ``region``: a tree's node slots; ``result``: the RES layout."""
    if not batch.b:
        batch.res = np.zeros(0, result.dtype)
        return
    finish_trees(((batch.b + abi.WARPS_PER_BLOCK - 1) // abi.WARPS_PER_BLOCK,), (32 * abi.WARPS_PER_BLOCK,),
                 (batch.pool, np.int64(region), np.int32(batch.b), batch.ts, batch.cyc, batch.res_dev))
    batch.res = batch.res_dev[: batch.b * result.nbytes].get().view(result.dtype)


def set_keys(batch, first: int, seeds: list[int], streams: list[int]) -> np.ndarray:
    """Writes the Philox key rows (k0, k1 from each seed, its tree word) of the
    trees joining ``batch`` at rows ``first ..``; returns the seeds (uint64 [n])."""
    seed = np.asarray(seeds, np.uint64)
    keys = np.stack([seed & np.uint64(0xFFFFFFFF), seed >> np.uint64(32), np.asarray(streams, np.uint64)], axis=1)
    batch.keys[first * KEY_WORDS : (first + len(seed)) * KEY_WORDS].set(keys.astype(np.uint32).reshape(-1))
    return seed


def slice_ns(slice_ms: float | None) -> int:
    """A rollout launch's ``deadline_ns`` for a batch's time slice (ms): 0, not
    timed, for none (waves of K) or ``math.inf`` (each tree runs its budget)."""
    return int(slice_ms * 1e6) if slice_ms and math.isfinite(slice_ms) else 0


def fill_holes(batch, leaving: set[int], move_tree: Callable[[int, int], None]) -> np.ndarray:
    """Moves the rows of ``batch`` (a CUDA batch of trees, ``batch.b`` rows)
    that stay past the new end into the rows below it that leave
    (``leaving``): ``move_tree(hole, row)`` copies a tree's region; its tree
    state, cycles and Philox keys (``ts``, ``cyc``, ``keys``) move by one
    gather and one scatter for all rows, not a copy a row. Returns the new
    order (int64 [B']: new row r was row ``order[r]``)."""
    b = batch.b
    stay = [r for r in range(b) if r not in leaving]
    order = list(range(len(stay)))
    holes = [r for r in sorted(leaving) if r < len(stay)]  # as many as the movers
    movers = [r for r in stay if r >= len(stay)]
    for hole, row in zip(holes, movers):
        move_tree(hole, row)
        order[hole] = row
    if movers:
        to, frm = cupy.asarray(np.array(holes, np.int64)), cupy.asarray(np.array(movers, np.int64))
        for name, n, _ in PER_ROW:
            rows = getattr(batch, name)[: b * n].reshape(b, n)
            rows[to] = rows[frm]
    return np.array(order, np.int64)


def grow(batch, rows: int, tree_bytes: int, result_bytes: int, init_words: int) -> None:
    """Gives ``batch`` (a CUDA batch of trees, ``batch.b`` rows in use) a slab
    of ``rows`` rows: its trees (``pool``, ``tree_bytes`` a row), tree state
    (``ts``), cycles (``cyc``) and Philox keys (``keys``) with the rows in use
    copied; fresh RES rows (``res_dev``, ``result_bytes`` a row), INIT rows
    (``init_dev``, ``init_words`` a row), a wave's k per tree (``ks_dev``) and
    the slice's start (``t0``)."""
    b = batch.b
    pool = cupy.empty((rows, tree_bytes), np.uint8)
    if b:
        pool[:b] = batch.pool[:b]
    batch.pool = pool
    for name, n, dtype in PER_ROW:
        words = cupy.zeros(rows * n, dtype)
        if b:
            words[: b * n] = getattr(batch, name)[: b * n]
        setattr(batch, name, words)
    batch.res_dev = cupy.empty(rows * result_bytes, np.uint8)
    batch.init_dev = cupy.empty(rows * init_words, np.uint32)
    batch.ks_dev = cupy.zeros(rows, np.int32)  # a wave's k per tree (value model) or budget (rollouts)
    batch.t0 = cupy.zeros(1, np.uint64)
