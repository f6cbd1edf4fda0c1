"""The helpers games' NumPy rules share: bit order across words, the input
checks' messages, and a move string's replay reporting the first error."""
from __future__ import annotations

import numpy as np
import pytest

from search_service.games import rules_helpers as h


def test_unpack_bits_counts_across_words_from_the_low_bit():
    words = np.array([[1 | (1 << 63), 1 | (1 << 5)]], np.uint64)  # bits 0, 63, 64, 69
    bits = h.unpack_bits(words, 70)
    assert bits.dtype == np.bool_ and bits.shape == (1, 70)
    assert np.flatnonzero(bits[0]).tolist() == [0, 63, 64, 69]
    assert h.unpack_bits(words[None], 64).shape == (1, 1, 64)  # leading axes kept
    assert h.popcount(words).tolist() == [[2, 2]]


def test_checked_states_names_the_expected_shape():
    ok = np.zeros((3, 2), np.uint64)
    assert h.checked_states(ok, 2) is ok
    with pytest.raises(ValueError, match=r"states must be uint64 \[B, 2\], got int64 \[3, 2\]"):
        h.checked_states(ok.astype(np.int64), 2)
    with pytest.raises(ValueError, match=r"got uint64 \[3\]"):
        h.checked_states(ok[:, 0], 2)


def test_checked_actions_names_the_first_bad_state():
    legal = np.array([[True, False], [False, True]])
    assert h.checked_actions(np.array([0, 1], np.int32), legal, str).dtype == np.int64
    with pytest.raises(ValueError, match=r"state 1: action 2 is outside 0..1"):
        h.checked_actions(np.array([0, 2]), legal, str)
    with pytest.raises(ValueError, match=r"state 1: action 0 \(move 0\) is not legal there"):
        h.checked_actions(np.array([0, 0]), legal, lambda a: f"move {a}")
    with pytest.raises(ValueError, match=r"actions must be integers \[2\], got float64 \[2\]"):
        h.checked_actions(np.array([0.0, 1.0]), legal, str)
    with pytest.raises(ValueError, match="action 5 is outside 0..4"):
        h.checked_action(5, 5)


def counting_game():
    """A game of one word counting moves: two actions, only 0 ever legal, over after two moves."""
    def legal_mask(state):
        return np.concatenate([state < 2, np.zeros_like(state, np.bool_)], axis=1)

    def step(state, actions):
        return state + np.uint64(1), None, None
    return legal_mask, step


def test_replay_plays_in_turn_and_stops_at_the_first_error():
    legal_mask, step = counting_game()
    start = np.zeros((1, 1), np.uint64)
    assert h.replay(start, [(1, "x", 0), (2, "x", 0)], legal_mask, step, str).tolist() == [[2]]
    with pytest.raises(ValueError, match=r"character 2: y is not legal there \(because 1\)"):
        h.replay(start, [(1, "x", 0), (2, "y", 1)], legal_mask, step, lambda a: f"because {a}")
    with pytest.raises(ValueError, match="character 3: x comes after the game ended"):
        h.replay(start, [(1, "x", 0), (2, "x", 0), (3, "x", 0)], legal_mask, step, str)

    def moves():  # a malformed move after an illegal one is never read
        yield 1, "y", 1
        raise AssertionError("read too far")
    with pytest.raises(ValueError, match="character 1: y is not legal"):
        h.replay(start, moves(), legal_mask, step, str)
