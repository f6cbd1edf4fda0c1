"""Connect Four's rules as a game folder's rules.py, for the plug-in search tests.

tests/search/test_plugin_search.py writes this text into a temporary folder
(beside a game.yaml) and loads it with ``load_game``: the MCTS then searches
Connect Four through the plug-in path (:class:`~search_service.mcts.games.PluginSearch`,
its generic rollouts), and must grow exactly the tree that the bundled
Connect Four (:data:`~search_service.mcts.games.CONNECT_FOUR`) grows.

State, 2 uint64 words: Pascal Pons' bitboards, ``[current, mask]``
(:mod:`search_service.games.connect4`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from search_service.games import connect4 as c4
from search_service.games.rules_helpers import checked_actions, checked_states


def _won(states: np.ndarray) -> np.ndarray:
    return c4.has_four(states[:, 0] ^ states[:, 1])


def initial(batch: int) -> np.ndarray:
    return np.zeros((batch, 2), np.uint64)


def legal_mask(states: np.ndarray) -> np.ndarray:
    states = checked_states(states, 2)
    return c4.legal_bits(states[:, 1]) & ~_won(states)[:, None]


def step(states: np.ndarray, actions: np.ndarray):
    actions = checked_actions(actions, legal_mask(states), move_to_text)
    current, mask = c4.play_bits(states[:, 0], states[:, 1], actions)
    nxt = np.stack([current, mask], axis=1)
    won = _won(nxt)
    return nxt, won | (mask == c4.BOARD_MASK), won.astype(np.float32)


def is_terminal(states: np.ndarray) -> np.ndarray:
    states = checked_states(states, 2)
    return _won(states) | (states[:, 1] == c4.BOARD_MASK)


def returns(states: np.ndarray) -> np.ndarray:
    return np.where(_won(checked_states(states, 2)), -1.0, 0.0).astype(np.float32)


def to_play(states: np.ndarray) -> np.ndarray:
    return (c4.popcount(checked_states(states, 2)[:, 1]) % 2).astype(np.int8)


def observation(states: np.ndarray) -> np.ndarray:
    states = checked_states(states, 2)
    return c4.observation(c4.Positions(states[:, 0], states[:, 1], c4.popcount(states[:, 1])))


def parse_moves(text: str) -> np.ndarray:
    p = c4.parse_moves(text)
    return np.stack([p.current, p.mask], axis=1)


def move_to_text(action: int) -> str:
    return c4.move_to_text(int(action))


def moves_to_text(actions: Sequence[int]) -> str:
    return c4.moves_to_text(actions)
