"""The rows of a batch of trees on the device (a slab): grown as trees join,
kept dense as they leave (each row that stays past the new end moves into a
hole below it, its tree and small per-row state), so rows ``[0, B')`` are the
trees in use.

Shared by Connect Four's batch (``tree_batch.py``) and the game folders'
(``game_batch.py``), which copy a tree's region each their own way."""
from __future__ import annotations

from typing import Callable

import cupy
import numpy as np


def fill_holes(b: int, leaving: set[int], move_tree: Callable[[int, int], None],
               per_row: list[tuple[cupy.ndarray, int]]) -> np.ndarray:
    """Moves the rows of ``b`` that stay past the new end into the rows below
    it that leave (``leaving``): ``move_tree(hole, row)`` copies a tree's
    region; each ``(words, n)`` of ``per_row`` (a flat device array of ``n``
    words a row) moves by one gather and one scatter for all rows, not a copy
    a row. Returns the new order (int64 [B']: new row r was row ``order[r]``).
    """
    stay = [r for r in range(b) if r not in leaving]
    order = list(range(len(stay)))
    holes = [r for r in sorted(leaving) if r < len(stay)]  # as many as the movers
    movers = [r for r in stay if r >= len(stay)]
    for hole, row in zip(holes, movers):
        move_tree(hole, row)
        order[hole] = row
    if movers:
        to, frm = cupy.asarray(np.array(holes, np.int64)), cupy.asarray(np.array(movers, np.int64))
        for words, n in per_row:
            rows = words[: b * n].reshape(b, n)
            rows[to] = rows[frm]
    return np.array(order, np.int64)



def grown(old: cupy.ndarray | None, rows: int, per_row: int, dtype, used: int, flat: bool = True,
          empty: bool = False) -> cupy.ndarray:
    """A device array of ``rows`` rows of ``per_row`` elements, ``flat`` (one
    axis, as the kernels take the per-row state) or ``[rows, per_row]``; zeros,
    or uninitialised where ``empty``; the first ``used`` rows of ``old`` copied in."""
    new = (cupy.empty if empty else cupy.zeros)((rows * per_row,) if flat else (rows, per_row), dtype)
    if used:
        n = used * per_row if flat else used
        new[:n] = old[:n]
    return new
