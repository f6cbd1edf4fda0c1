"""Philox4x32-10, a counter-based random number generator, in vectorised NumPy.

Source: J. K. Salmon, M. A. Moraes, R. O. Dror, D. E. Shaw, "Parallel random
numbers: as easy as 1, 2, 3", SC 2011; constants and round structure as in
the Random123 library (``philox4x32_R`` with R = 10). Output is a pure
function of (counter, key): no state, so the CPU reference and the CUDA
kernels draw identical numbers wherever they compute them.

One round, on counter words (c0, c1, c2, c3) and key words (k0, k1)::

    hi0:lo0 = 0xD2511F53 * c0      (32 x 32 -> 64-bit product)
    hi1:lo1 = 0xCD9E8D57 * c2
    (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

and between rounds the key is bumped: k0 += 0x9E3779B9, k1 += 0xBB67AE85
(mod 2**32). Ten rounds; the first uses the key as given.

How the search draws numbers (the CUDA backend must do exactly this)
---------------------------------------------------------------------
Key: ``(seed & 0xFFFFFFFF, seed >> 32)`` for the 64-bit ``SearchParams.seed``.

Random rollouts (the only consumer today), in every game. The rollout of simulation ``s`` of
tree ``t`` uses, at its ``i``-th random move (``i = 0`` is the first move
played from the leaf), word ``i % 4`` of::

    philox4x32(counter = (s, t, i // 4, STREAM_ROLLOUT), key)

where ``s`` is the 0-based index of the simulation among those of this
``search`` call for that tree (the k-th selection of the wave that starts
after ``n`` simulations has ``s = n + k``), ``t`` the 0-based index of the
tree in the batch, and ``STREAM_ROLLOUT = 0``. Other values of counter word 3
are reserved for future consumers (e.g. root noise). With ``w`` that word and
``n`` the number of legal actions, the move is the ``(w % n)``-th legal action
counting from action 0 (0-based), i.e. the action ``a`` such that exactly
``w % n`` legal actions are lower than it (Connect Four: the ``(w % n)``-th
legal column from the left).
"""
from __future__ import annotations

import numpy as np

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9  # golden ratio
PHILOX_W1 = 0xBB67AE85  # sqrt(3) - 1
ROUNDS = 10
STREAM_ROLLOUT = 0

_LO32 = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def philox4x32(counter: np.ndarray, key: np.ndarray, rounds: int = ROUNDS) -> np.ndarray:
    """Philox4x32-``rounds`` of ``counter`` under ``key``.

    Args:
        counter: uint32 [..., 4] (other unsigned ints are taken mod 2**32).
        key: uint32 [..., 2], broadcast against ``counter[..., 0]``.

    Returns:
        uint32 [..., 4]: four independent uniformly distributed words per counter.
    """
    ctr = np.asarray(counter).astype(np.uint64) & _LO32
    k = np.asarray(key).astype(np.uint64) & _LO32
    if ctr.shape[-1:] != (4,) or k.shape[-1:] != (2,):
        raise ValueError(f"counter must be [..., 4] and key [..., 2], got {ctr.shape} and {k.shape}")
    shape = np.broadcast_shapes(ctr.shape[:-1], k.shape[:-1])
    c0, c1, c2, c3 = (np.broadcast_to(ctr[..., i], shape) for i in range(4))
    k0, k1 = (np.broadcast_to(k[..., i], shape) for i in range(2))
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    w0, w1 = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1)
    for r in range(rounds):
        if r:
            k0 = (k0 + w0) & _LO32
            k1 = (k1 + w1) & _LO32
        p0 = m0 * c0  # < 2**64: exact in uint64
        p1 = m1 * c2
        c0, c1, c2, c3 = (p1 >> _32) ^ c1 ^ k0, p1 & _LO32, (p0 >> _32) ^ c3 ^ k1, p0 & _LO32
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def seed_key(seed: int) -> np.ndarray:
    """uint32 [2]: the Philox key for a 64-bit seed (low word first)."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)


def seed_keys(seeds: np.ndarray) -> np.ndarray:
    """uint32 [M, 2]: the Philox keys of M 64-bit seeds (uint64 [M]; low word first)."""
    s = np.asarray(seeds, np.uint64)
    return np.stack([s & _LO32, s >> _32], axis=-1).astype(np.uint32)


def rollout_words(sims: np.ndarray, trees: np.ndarray, plies: int, seed: int | np.ndarray) -> np.ndarray:
    """uint32 [M, plies']: the words rollouts draw (see the module docstring).

    Args:
        sims: int [M], simulation index ``s`` of each rollout within its tree.
        trees: int [M], tree index ``t`` of each rollout.
        plies: how many moves each rollout may need; ``plies'`` is that rounded
            up to a multiple of 4. Column ``i`` holds the word for move ``i``.
        seed: the search's 64-bit seed, or each rollout's (uint64 [M]: a batch
            of trees from several searches).
    """
    blocks = -(-plies // 4)
    m = sims.shape[0]
    ctr = np.empty((m, blocks, 4), dtype=np.uint64)
    ctr[..., 0] = sims[:, None]
    ctr[..., 1] = trees[:, None]
    ctr[..., 2] = np.arange(blocks, dtype=np.uint64)[None, :]
    ctr[..., 3] = STREAM_ROLLOUT
    key = _key(seed)
    return philox4x32(ctr, key if key.ndim == 1 else key[:, None, :]).reshape(m, blocks * 4)


def rollout_block(sims: np.ndarray, trees: np.ndarray, block: int, seed: int | np.ndarray) -> np.ndarray:
    """uint32 [M, 4]: the words of moves ``4 * block .. 4 * block + 3`` of M
    rollouts (column ``i % 4`` for move ``i``), as :func:`rollout_words`
    draws them; for rollouts that draw a block at a time. Arguments as there."""
    ctr = np.empty((sims.shape[0], 4), dtype=np.uint64)
    ctr[:, 0] = sims
    ctr[:, 1] = trees
    ctr[:, 2] = block
    ctr[:, 3] = STREAM_ROLLOUT
    return philox4x32(ctr, _key(seed))


def _key(seed: int | np.ndarray) -> np.ndarray:
    """uint32 [2] for one seed, [M, 2] for each rollout's."""
    return seed_key(int(seed)) if np.ndim(seed) == 0 else seed_keys(seed)
