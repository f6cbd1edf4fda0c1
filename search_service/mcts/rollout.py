"""Uniformly random rollouts, vectorised over many leaves: Connect Four's
(:func:`rollout_values`, table-driven) and any game plug-in's
(:func:`plugin_rollout_values`, through its rules), by one rule: the move is
the ``(word % n)``-th of the ``n`` legal actions, the words drawn from Philox
as :mod:`search_service.mcts.philox` says, so both give the same results for
the same rules.

Connect Four's:

All rollouts advance one ply per step in lockstep; a rollout that has ended
keeps "playing" (its moves are ignored) until, every 4 plies, large batches
drop their finished rollouts; the loop stops once every rollout has ended. Random numbers come from Philox with
the counter layout documented in :mod:`search_service.mcts.philox`: the move is
the ``(word % n)``-th of the ``n`` legal columns, counted from the left.

Speed: the legal columns are found with one table look-up. The top cells of
the 7 columns (bits ``5 + 7c``) are gathered into a 7-bit "full columns" code
by ``(((mask >> 5) & C) * MAGIC >> 36) & 127``, with ``C`` the bits ``7c``
and ``MAGIC = sum(2**(36 - 6j), j = 0..6)``: bit ``7c`` times ``2**(36 - 6c)``
lands on bit ``36 + c``, and no other product term lands on bits 36..42 or
collides with another term, so no carry disturbs the code. Tables indexed by
``code * 8 + k`` then give the k-th legal column's bottom and column bits.
"""
from __future__ import annotations

import numpy as np

from search_service.games import connect4
from search_service.mcts.philox import rollout_block, rollout_words

_U = np.uint64
_C = _U(sum(1 << (connect4.COLUMN_BITS * c) for c in range(connect4.COLUMNS)))
_MAGIC = _U(sum(1 << (36 - 6 * j) for j in range(connect4.COLUMNS)))
_S5, _S36, _S3, _M127 = _U(connect4.ROWS - 1), _U(36), _U(3), _U(127)


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_legal = np.ones(128, _U)  # at least 1, so "word % n" is defined on full boards
    bottom = np.zeros(128 * 8, _U)  # zero entries: no stone (full board / past n)
    column = np.zeros(128 * 8, _U)
    for full in range(128):
        legal = [c for c in range(connect4.COLUMNS) if not full >> c & 1]
        n_legal[full] = max(len(legal), 1)
        for k, c in enumerate(legal):
            bottom[full * 8 + k] = connect4.BOTTOM[c]
            column[full * 8 + k] = connect4.COLUMN_MASK[c]
    return n_legal, bottom, column


_N_LEGAL, _BOTTOM_K, _COLUMN_K = _tables()  # uint64 [128], [1024], [1024]
_COMPACT_MIN = 64  # below this many rollouts, dropping finished ones costs more than it saves


def full_columns(mask: np.ndarray) -> np.ndarray:
    """uint64 [...]: bit c set where column c is full (the 7-bit code above)."""
    return ((((mask >> _S5) & _C) * _MAGIC) >> _S36) & _M127


def rollout_values(current: np.ndarray, mask: np.ndarray, sims: np.ndarray, trees: np.ndarray,
                   seed: int | np.ndarray) -> np.ndarray:
    """float32 [M]: results of random games from M unfinished positions, for
    each position's side to move (+1 win, 0 draw, -1 loss).

    Args:
        current, mask: uint64 [M], the leaf positions (none may be finished).
        sims, trees: int [M], the simulation and tree index of each rollout
            (the Philox counter words 0 and 1).
        seed: the 64-bit search seed (the Philox key), or each rollout's
            (uint64 [M]: trees of several searches in one batch).
    """
    m = current.shape[0]
    if m == 0:
        return np.zeros(0, np.float32)
    plies = connect4.MAX_MOVES - int(connect4.popcount(mask).min())
    words = rollout_words(sims, trees, plies, seed).T.astype(_U)  # [plies', M]
    cur, msk = current.copy(), mask.copy()
    end = np.full(m, -1, np.int64)  # ply at which the rollout's mover first completed four; -1: none
    alive = np.arange(m)  # which rollouts cur/msk hold (all, until compacted)
    for i in range(plies):
        code = full_columns(msk)
        w = words[i] if alive.size == m else words[i, alive]
        j = (code << _S3) + w % _N_LEGAL[code]
        cur, msk = cur ^ msk, msk | ((msk + _BOTTOM_K[j]) & _COLUMN_K[j])
        won = connect4.has_four(cur ^ msk)
        if won.any():
            hit = alive[won]
            end[hit] = np.where(end[hit] < 0, i, end[hit])  # ended rollouts play on until compacted
        if i % 4 == 3:
            going = ((end if alive.size == m else end[alive]) < 0) & (msk != connect4.BOARD_MASK)
            left = int(np.count_nonzero(going))
            if left == 0:
                break
            if going.size >= _COMPACT_MIN and left <= 0.75 * going.size:
                alive, cur, msk = alive[going], cur[going], msk[going]
    # The leaf's side to move plays plies 0, 2, 4, ...
    return np.where(end < 0, 0.0, np.where(end % 2 == 0, 1.0, -1.0)).astype(np.float32)


def plugin_rollout_values(rules, max_moves: int, states: np.ndarray, sims: np.ndarray, trees: np.ndarray,
                          seed: int | np.ndarray, name: str = "") -> np.ndarray:
    """float32 [M]: results of random games from M unfinished states of a game
    plug-in, for each state's side to move (+1 win, 0 draw, -1 loss).

    The rollouts advance one ply per step in lockstep with the game's
    ``legal_mask`` and ``step`` (:mod:`search_service.games.protocol`); one
    that ends leaves the batch, and Philox words are drawn four plies at a time
    for the rollouts still going. ``step``'s reward is the mover's, and the
    leaf's side to move makes plies 0, 2, 4, ...

    Args:
        rules: the game's rules module.
        max_moves: the game's ``max_moves`` (no rollout lasts longer).
        states: uint64 [M, W], the leaves (none finished).
        sims, trees, seed: as :func:`rollout_values`.
        name: the game's name, for the error.

    Raises:
        RuntimeError: a rollout lasted more than ``max_moves`` plies (the
            rules disagree with game.yaml).
    """
    m = states.shape[0]
    values = np.zeros(m, np.float32)
    alive = np.arange(m)
    seeds = None if np.ndim(seed) == 0 else np.asarray(seed, np.uint64)
    sims, trees = np.asarray(sims), np.asarray(trees)
    cur, words = states, np.zeros((m, 4), np.uint32)
    for i in range(max_moves):
        if alive.size == 0:
            return values
        if i % 4 == 0:
            words = rollout_block(sims[alive], trees[alive], i // 4, seed if seeds is None else seeds[alive])
        legal = rules.legal_mask(cur)  # [n, A]
        k = words[:, i % 4].astype(np.int64) % np.maximum(legal.sum(axis=1), 1)
        action = np.argmax(np.cumsum(legal, axis=1) > k[:, None], axis=1)  # the k-th legal action
        cur, terminal, reward = rules.step(cur, action)
        if terminal.any():
            values[alive[terminal]] = reward[terminal] if i % 2 == 0 else -reward[terminal]
            going = ~terminal
            alive, cur, words = alive[going], cur[going], words[going]
    if alive.size:
        raise RuntimeError(f"game {name}: a rollout lasted more than max_moves ({max_moves}) plies")
    return values
