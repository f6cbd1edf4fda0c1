"""Tic-tac-toe rules for the plug-in tests: a game from outside the repository.

The tests copy this text into a temporary folder as its ``rules.py`` (beside a
``game.yaml`` they write) and load it with ``load_game``; nothing imports it
from here. It follows OpenSpiel's ``tic_tac_toe``: cell ``row * 3 + column``
is action and bit number, X (player 0) moves first.

State, 1 uint64 word: bits 0-8 X's marks, bits 9-17 O's. The player to move
is the one with fewer marks (X on equal counts). Notation: one digit a move,
the cell number 1-9 (row by row from the top left).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

CELLS = 9
_U64 = np.uint64
_FULL = (1 << CELLS) - 1
_LINES = np.array([0b111 << (3 * r) for r in range(3)] + [0b1001001 << c for c in range(3)]
                  + [0b100010001, 0b001010100], _U64)  # rows, columns, diagonals
_CELL = np.arange(CELLS, dtype=_U64)


def _marks(states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    states = np.asarray(states)
    if states.dtype != _U64 or states.ndim != 2 or states.shape[1] != 1:
        raise ValueError(f"states must be uint64 [B, 1], got {states.dtype} {list(states.shape)}")
    word = states[:, 0]
    return word & _U64(_FULL), (word >> _U64(CELLS)) & _U64(_FULL)


def _line(bits: np.ndarray) -> np.ndarray:
    return ((bits[:, None] & _LINES) == _LINES).any(axis=1)


def _count(bits: np.ndarray) -> np.ndarray:
    return ((bits[:, None] >> _CELL) & _U64(1)).sum(axis=1)


def initial(batch: int) -> np.ndarray:
    """uint64 [batch, 1]: the empty board, X to move."""
    return np.zeros((batch, 1), _U64)


def to_play(states: np.ndarray) -> np.ndarray:
    """int8 [B]: 0 X, 1 O."""
    x, o = _marks(states)
    return (_count(x) > _count(o)).astype(np.int8)


def is_terminal(states: np.ndarray) -> np.ndarray:
    """bool [B]: a line, or a full board."""
    x, o = _marks(states)
    return _line(x) | _line(o) | ((x | o) == _U64(_FULL))


def returns(states: np.ndarray) -> np.ndarray:
    """float32 [B]: -1 where the player who just moved made a line (only the
    mover can), else 0."""
    x, o = _marks(states)
    return np.where(_line(x) | _line(o), np.float32(-1), np.float32(0)).astype(np.float32)


def legal_mask(states: np.ndarray) -> np.ndarray:
    """bool [B, 9]: the empty cells of games still going."""
    x, o = _marks(states)
    empty = (((x | o)[:, None] >> _CELL) & _U64(1)) == 0
    return empty & ~is_terminal(states)[:, None]


def step(states: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(next uint64 [B, 1], terminal bool [B], reward float32 [B]): +1 for a
    move that makes a line. ValueError on an illegal action."""
    actions = np.asarray(actions, dtype=np.int64)
    legal = legal_mask(states)
    if actions.shape != (legal.shape[0],) or ((actions < 0) | (actions >= CELLS)).any():
        raise ValueError(f"actions must be cells 0..8, one a state, got {actions.tolist()}")
    if not legal[np.arange(actions.size), actions].all():
        raise ValueError(f"an action in {actions.tolist()} is not legal")
    shift = actions.astype(_U64) + _U64(CELLS) * to_play(states).astype(_U64)
    nxt = states | (_U64(1) << shift)[:, None]
    terminal = is_terminal(nxt)
    return nxt, terminal, -returns(nxt)


def observation(states: np.ndarray) -> np.ndarray:
    """uint8 [B, 2, 3, 3]: the player to move's marks, then the opponent's."""
    x, o = _marks(states)
    first = to_play(states) == 0
    planes = np.stack([np.where(first, x, o), np.where(first, o, x)], axis=1)[:, :, None]
    return ((planes >> _CELL) & _U64(1)).astype(np.uint8).reshape(-1, 2, 3, 3)


def move_to_text(action: int) -> str:
    """The cell digit 1-9 of action 0-8."""
    if not 0 <= int(action) < CELLS:
        raise ValueError(f"action {action} is outside 0..8")
    return str(int(action) + 1)


def moves_to_text(actions: Sequence[int]) -> str:
    """The digits of several actions."""
    return "".join(move_to_text(a) for a in actions)


def parse_moves(text: str) -> np.ndarray:
    """uint64 [1, 1] after a digit string; ValueError naming the 1-based character."""
    state = initial(1)
    for i, ch in enumerate(text, start=1):
        if not "1" <= ch <= "9":
            raise ValueError(f"character {i}: {ch!r} is not a cell digit 1-9")
        if not legal_mask(state)[0, int(ch) - 1]:
            raise ValueError(f"character {i}: cell {ch} is taken or the game is over")
        state = step(state, np.array([int(ch) - 1]))[0]
    return state


def to_openspiel_action(action: int) -> int:
    """OpenSpiel numbers the cells the same way."""
    if not 0 <= int(action) < CELLS:
        raise ValueError(f"action {action} is outside 0..8")
    return int(action)
