"""A parity game for the plug-in tests: a game from outside the repository
that the bundled ones do not cover on the device (few actions, one state
word, a game.yaml max_moves that every game reaches, with a choice at its
last ply). tests/games/game_folders.py writes it into a temporary folder.

Two players take turns naming a digit 0..7 (the action), four plies in all;
the first player wins where the four digits sum to an even number, the
second where odd. The turn passes after every ply, the last one too.

State, 1 uint64 word: bits 0-7 the plies played, bits 8.. the sum so far.
Notation: one digit a move.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

NUM_ACTIONS = 8
PLIES = 4
_U64 = np.uint64


def _split(states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    states = np.asarray(states)
    if states.dtype != _U64 or states.ndim != 2 or states.shape[1] != 1:
        raise ValueError(f"states must be uint64 [B, 1], got {states.dtype} {list(states.shape)}")
    return states[:, 0] & _U64(0xFF), states[:, 0] >> _U64(8)


def initial(batch: int) -> np.ndarray:
    """uint64 [batch, 1]: no ply played."""
    return np.zeros((batch, 1), _U64)


def to_play(states: np.ndarray) -> np.ndarray:
    """int8 [B]: 0 the first player, 1 the second."""
    return (_split(states)[0] % _U64(2)).astype(np.int8)


def is_terminal(states: np.ndarray) -> np.ndarray:
    """bool [B]: all four plies played."""
    return _split(states)[0] == PLIES


def returns(states: np.ndarray) -> np.ndarray:
    """float32 [B]: the player to move's result in finished games (+1, -1), else 0."""
    _, total = _split(states)
    first_wins = total % _U64(2) == 0
    mover_is_first = PLIES % 2 == 0  # who would move after the last ply
    result = np.where(first_wins == mover_is_first, np.float32(1), np.float32(-1))
    return np.where(is_terminal(states), result, np.float32(0)).astype(np.float32)


def legal_mask(states: np.ndarray) -> np.ndarray:
    """bool [B, 8]: every digit, in games still going."""
    return np.repeat(~is_terminal(states)[:, None], NUM_ACTIONS, axis=1)


def step(states: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(next uint64 [B, 1], terminal bool [B], reward float32 [B]): the
    mover's result where the ply ended the game. ValueError on an illegal action."""
    actions = np.asarray(actions, dtype=np.int64)
    legal = legal_mask(states)
    if actions.shape != (legal.shape[0],) or ((actions < 0) | (actions >= NUM_ACTIONS)).any():
        raise ValueError(f"actions must be digits 0..7, one a state, got {actions.tolist()}")
    if not legal[np.arange(actions.size), actions].all():
        raise ValueError(f"an action in {actions.tolist()} comes after the game ended")
    plies, total = _split(states)
    nxt = ((plies + _U64(1)) | ((total + actions.astype(_U64)) << _U64(8)))[:, None]
    terminal = is_terminal(nxt)
    return nxt, terminal, np.where(terminal, -returns(nxt), np.float32(0)).astype(np.float32)


def observation(states: np.ndarray) -> np.ndarray:
    """uint8 [B, 1, 1, 2]: the plies played and the sum's parity."""
    plies, total = _split(states)
    return np.stack([plies, total % _U64(2)], axis=1).astype(np.uint8).reshape(-1, 1, 1, 2)


def move_to_text(action: int) -> str:
    """The digit of action 0-7."""
    if not 0 <= int(action) < NUM_ACTIONS:
        raise ValueError(f"action {action} is outside 0..7")
    return str(int(action))


def moves_to_text(actions: Sequence[int]) -> str:
    """The digits of several actions."""
    return "".join(move_to_text(a) for a in actions)


def parse_moves(text: str) -> np.ndarray:
    """uint64 [1, 1] after a digit string; ValueError naming the 1-based character."""
    state = initial(1)
    for i, ch in enumerate(text, start=1):
        if not "0" <= ch <= "7":
            raise ValueError(f"character {i}: {ch!r} is not a digit 0-7")
        if is_terminal(state)[0]:
            raise ValueError(f"character {i}: the game is over")
        state = step(state, np.array([int(ch)]))[0]
    return state
