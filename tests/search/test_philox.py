"""Philox4x32-10 against the Random123 known-answer vectors, and the counter
layout the search's rollouts use."""
from __future__ import annotations

import numpy as np
import pytest

from search_service.mcts.philox import (
    STREAM_ROLLOUT,
    philox4x32,
    rollout_words,
    seed_key,
)

# Random123 kat_vectors, philox4x32 with 10 rounds: counter, key -> output.
KATS = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    (
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ),
]


@pytest.mark.parametrize("counter, key, expected", KATS)
def test_known_answers(counter, key, expected):
    out = philox4x32(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert out.dtype == np.uint32 and out.tolist() == expected


def test_batched_equals_one_by_one_and_broadcasts_the_key():
    counters = np.array([c for c, _, _ in KATS], np.uint32)
    keys = np.array([k for _, k, _ in KATS], np.uint32)
    assert philox4x32(counters, keys).tolist() == [e for _, _, e in KATS]
    grid = np.arange(24, dtype=np.uint32).reshape(2, 3, 4)
    shared = philox4x32(grid, np.array([7, 9], np.uint32))
    assert shared.shape == (2, 3, 4)
    assert shared[1, 2].tolist() == philox4x32(grid[1, 2], np.array([7, 9], np.uint32)).tolist()


def test_counter_changes_every_word():
    a = philox4x32(np.array([1, 0, 0, 0], np.uint32), np.array([0, 0], np.uint32))
    b = philox4x32(np.array([0, 0, 0, 0], np.uint32), np.array([0, 0], np.uint32))
    assert np.all(a != b)


def test_bad_shapes_and_seeds():
    with pytest.raises(ValueError):
        philox4x32(np.zeros(3, np.uint32), np.zeros(2, np.uint32))
    with pytest.raises(ValueError):
        seed_key(-1)
    with pytest.raises(ValueError):
        seed_key(1 << 64)


def test_rollout_word_layout():
    seed = 0x0123456789ABCDEF
    assert seed_key(seed).tolist() == [0x89ABCDEF, 0x01234567]
    sims, trees = np.array([0, 5, 7]), np.array([0, 2, 1])
    words = rollout_words(sims, trees, 9, seed)
    assert words.shape == (3, 12)  # 9 plies rounded up to 3 blocks of 4
    for m in range(3):
        for i in range(12):
            ctr = np.array([sims[m], trees[m], i // 4, STREAM_ROLLOUT], np.uint32)
            assert words[m, i] == philox4x32(ctr, seed_key(seed))[i % 4]
