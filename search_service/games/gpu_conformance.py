"""The conformance kit's GPU half: random games played on the GPU with a
game folder's device rules (its ``rules.cu``, in the game's CUDA module,
:mod:`search_service.cuda.game_module`) and replayed with its NumPy rules,
bit for bit.

One thread a game (``kernels/playout.cu``: ``game_playouts``) plays from the
starting state, each ply the ``(word % n)``-th of the ``n`` legal actions
(Philox words of the game's index and the seed), and records every state,
legal mask, ``game_is_terminal``, ``game_returns``, action, and ``game_step``'s
terminal flag and reward. The host then checks, ply by ply, over the games
still going: the starting state is ``initial``'s; each state's legal mask
(packed into u32 words, bit ``a % 32`` of word ``a // 32``), terminal flag
and return equal ``legal_mask``, ``is_terminal`` and ``returns``; and
``step`` of the state and the device's action gives the device's next state,
terminal flag and reward. A game that has not ended after ``max_moves``
plies is a mismatch too. A game is reported at its first mismatch only.

Needs CuPy and a GPU; :func:`gpu_check` says why it skipped otherwise.
"""
from __future__ import annotations

import numpy as np

from search_service.games.metadata import GameError
from search_service.games.plugin import GamePlugin

CHUNK = 2048  # games a launch (the recorded plies of 2048 Gomoku games: ~40 MB)


def gpu_check(plugin: GamePlugin, games: int, seed: int, report) -> None:
    """Plays ``games`` random games on the GPU and compares them with the
    NumPy rules; adds each game's first mismatch to ``report`` (a
    :class:`~search_service.games.conformance.Report`, whose ``gpu`` line it
    sets: what was compared, or why the GPU half was skipped)."""
    from search_service.backends import cuda_available
    from search_service.cuda import game_module

    why = cuda_available()
    if why is None and not game_module.has_device_rules(plugin.meta):
        why = f"the folder has no {game_module.RULES_FILE}"
    if why is not None:
        report.gpu = f"GPU playouts: skipped ({why})"
        return
    try:
        mod = game_module.device_module(plugin.meta)
    except GameError as e:
        report.gpu = "GPU playouts: the device rules do not compile"
        report.mismatch(-1, 0, "", str(e))
        return
    plies = 0
    for first in range(0, games, CHUNK):
        plies += _check_chunk(plugin, mod, first, min(CHUNK, games - first), seed, report)
    report.gpu = f"GPU playouts: {games} random games, {plies} plies, against the NumPy rules bit for bit"


def packed_legal(legal: np.ndarray, words: int) -> np.ndarray:
    """uint32 [B, words]: a legal mask bool [B, A] as the device's words (bit a % 32 of word a // 32)."""
    packed = np.packbits(legal, axis=1, bitorder="little")
    out = np.zeros((legal.shape[0], words * 4), np.uint8)
    out[:, : packed.shape[1]] = packed
    return out.view("<u4").astype(np.uint32)


def _check_chunk(plugin: GamePlugin, mod, first: int, n: int, seed: int, report) -> int:
    """Games ``first .. first + n - 1``; returns the plies they played."""
    import cupy

    rules, a = plugin.rules, mod.abi
    p = plugin.meta.max_moves + 1  # one ply more than any game may last
    w, mw = a.state_words, a.mask_words
    dev = dict(states=cupy.zeros((n, p + 1, w), np.uint64), legal=cupy.zeros((n, p + 1, mw), np.uint32),
               over=cupy.zeros((n, p + 1), np.uint8), returns=cupy.zeros((n, p + 1), np.float32),
               actions=cupy.full((n, p), -1, np.int32), terminal=cupy.zeros((n, p), np.uint8),
               reward=cupy.zeros((n, p), np.float32), plies=cupy.zeros(n, np.int32))
    key = np.uint64(seed) + np.uint64(first)  # chunks draw distinct words: game g of a chunk is thread g
    mod.kernel("game_playouts")(((n + 127) // 128,), (128,), (
        np.int32(n), np.int32(p), np.uint32(int(key) & 0xFFFFFFFF), np.uint32(int(key) >> 32),
        dev["states"], dev["legal"], dev["over"], dev["returns"], dev["actions"], dev["terminal"], dev["reward"],
        dev["plies"]))
    got = {k: v.get() for k, v in dev.items()}
    length = got["plies"].astype(np.int64)
    bad = np.zeros(n, bool)

    def fail(rows: np.ndarray, ply: int, what) -> None:
        for g in rows[~bad[rows]]:
            moves = rules.moves_to_text([int(x) for x in got["actions"][g, :ply + 1] if x >= 0])
            report.mismatch(first + int(g), ply, moves, what(int(g)))
        bad[rows] = True

    start = rules.initial(n)
    differ = np.flatnonzero((got["states"][:, 0] != start).any(axis=1))
    fail(differ, 0, lambda g: "the device's starting state differs from initial()")
    fail(np.flatnonzero(length >= p), p - 1, lambda g: f"the game lasted more than max_moves ({p - 1}) plies")
    for i in range(p + 1):
        rows = np.flatnonzero((length >= i) & ~bad)
        if rows.size == 0:
            break
        s = got["states"][rows, i]
        for name, want in (("legal mask", packed_legal(rules.legal_mask(s), mw)),
                           ("is_terminal", rules.is_terminal(s)), ("returns", rules.returns(s))):
            have = {"legal mask": got["legal"][rows, i], "is_terminal": got["over"][rows, i] != 0,
                    "returns": got["returns"][rows, i]}[name]
            off = (have != want).reshape(len(rows), -1).any(axis=1)
            fail(rows[off], i, lambda g, name=name: f"the device's {name} differs from rules.py's")
        rows = np.flatnonzero((length > i) & ~bad)
        if rows.size == 0:
            continue
        nxt, terminal, reward = rules.step(got["states"][rows, i], got["actions"][rows, i].astype(np.int64))
        for name, have, want in (("next state", got["states"][rows, i + 1], nxt),
                                 ("terminal flag", got["terminal"][rows, i] != 0, terminal),
                                 ("reward", got["reward"][rows, i], reward)):
            off = (have != want).reshape(len(rows), -1).any(axis=1)
            fail(rows[off], i, lambda g, name=name: f"game_step's {name} differs from rules.py's step")
    return int(length.sum())
