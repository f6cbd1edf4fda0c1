"""Connect Four positions as the value model's input planes.

The model contract (see ``reward_service/models/connect4_value.md``): a board is
uint8 ``[2, 6, 7]``; plane 0 holds the stones of the side to move, plane 1 the
opponent's (1 = stone, 0 = empty); index ``[row, col]`` with row 0 the BOTTOM
row and col 0 the leftmost column. This must equal
``search_service.games.connect4.observation`` for the same position
(``tests/training/test_value_model.py`` checks it when that module is present).

Move strings use the data files' convention: one digit per move, columns
1-indexed ("4455" = two stones in column 4, then two in column 5).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

ROWS, COLS = 6, 7


def parse_move_string(moves: str) -> list[int]:
    """1-indexed move string -> list of 0-indexed columns.

    Raises ValueError for a character that is not a digit 1..7."""
    cols = []
    for i, ch in enumerate(moves):
        if ch not in "1234567":
            raise ValueError(f"bad move {ch!r} at ply {i + 1} of {moves!r}")
        cols.append(int(ch) - 1)
    return cols


def encode_columns(columns: Sequence[int]) -> np.ndarray:
    """Replay 0-indexed column moves from the empty board.

    Returns uint8 ``[2, 6, 7]`` from the point of view of the side to move
    after the last move. Raises ValueError for a move into a full column or
    outside 0..6. Does not check for a finished game."""
    board = np.zeros((2, ROWS, COLS), dtype=np.uint8)
    heights = [0] * COLS
    to_move = len(columns) % 2  # ply parity of the player to move now
    for ply, col in enumerate(columns):
        if not 0 <= col < COLS or heights[col] == ROWS:
            raise ValueError(f"illegal move {col} at ply {ply + 1}")
        board[0 if ply % 2 == to_move else 1, heights[col], col] = 1
        heights[col] += 1
    return board


def encode_moves(moves: str) -> np.ndarray:
    """1-indexed move string -> uint8 ``[2, 6, 7]`` (see ``encode_columns``)."""
    return encode_columns(parse_move_string(moves))


def encode_batch(move_strings: Iterable[str]) -> np.ndarray:
    """Many 1-indexed move strings -> uint8 ``[N, 2, 6, 7]``."""
    boards = [encode_moves(m) for m in move_strings]
    if not boards:
        return np.zeros((0, 2, ROWS, COLS), dtype=np.uint8)
    return np.stack(boards)


def legal_mask(boards: np.ndarray) -> np.ndarray:
    """bool ``[N, 7]``: True where a column still has room (top cell empty)."""
    return (boards[:, :, ROWS - 1, :].sum(axis=1) == 0)


def mirror(boards: np.ndarray) -> np.ndarray:
    """Left-right mirror of ``[..., 6, 7]`` boards (or ``[..., 7]`` per-column
    arrays such as policy targets): column c becomes 6 - c."""
    return np.ascontiguousarray(boards[..., ::-1])
