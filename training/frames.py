"""A small deterministic renderer of Connect Four positions as game frames.

What a game engine would hand the frame reward model: uint8 RGB images,
``[N, 224, 224, 3]`` (NHWC, row 0 at the top of the image).

Layout of a frame (before jitter), in pixels:

* background ``BACKGROUND`` everywhere;
* the board: a blue 224 × 192 rectangle at x 0..223, y 32..223, six rows of
  seven 32 × 32 cells; each cell a round hole (radius ``HOLE_RADIUS``) that
  shows an empty slot colour, a red disc (first player) or a yellow disc
  (second player). Board row 0 (the bottom row) is drawn at the bottom;
* the turn indicator: a disc of the colour of the player to move, hovering
  over the middle column in the 32-pixel band above the board (as game UIs
  show the disc about to drop). Red moves first, so red is to move when both
  have played as many discs.

With ``rng`` given, each frame is shifted by up to ``JITTER_PX`` pixels in x
and y (what the shift uncovers shows the background) and its brightness is
scaled by up to ±``BRIGHTNESS_JITTER``; the same ``rng`` state gives the same
frames. Without ``rng`` a frame depends on the position alone.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

SIZE = 224  # frame height and width (px)
CELL = 32  # cell size (px)
ROWS, COLS = 6, 7
TOP = SIZE - ROWS * CELL  # 32 px band above the board (turn indicator)
HOLE_RADIUS = 12.5
JITTER_PX = 3
BRIGHTNESS_JITTER = 0.08

BACKGROUND = (38, 42, 54)
BOARD = (28, 78, 196)
EMPTY = (226, 232, 240)
RED = (214, 40, 46)
YELLOW = (242, 196, 32)
EMPTY_CELL, RED_DISC, YELLOW_DISC = 0, 1, 2
_PALETTE = np.array([EMPTY, RED, YELLOW], np.uint8)


def _disc_mask() -> np.ndarray:
    """bool [CELL, CELL]: the round hole of one cell."""
    c = (CELL - 1) / 2
    y, x = np.mgrid[0:CELL, 0:CELL]
    return (y - c) ** 2 + (x - c) ** 2 <= HOLE_RADIUS**2


# A frame is drawn as a map of colour codes, one per pixel, looked up in a
# per-frame colour table: codes 0..41 are the cells (board row * 7 + column),
# then the board, the background and the turn indicator. Jitter shifts the
# code map (one precomputed map per shift) and brightness scales the table, so
# a whole batch is one gather.
_BOARD_CODE, _BACKGROUND_CODE, _INDICATOR_CODE = ROWS * COLS, ROWS * COLS + 1, ROWS * COLS + 2
_CODES = ROWS * COLS + 3


def _code_map() -> np.ndarray:
    """uint8 [224, 224]: the colour code of each pixel of an unshifted frame."""
    hole = _disc_mask()
    m = np.full((SIZE, SIZE), _BACKGROUND_CODE, np.uint8)
    x0 = (COLS // 2) * CELL
    m[0:TOP, x0 : x0 + CELL][hole] = _INDICATOR_CODE
    for image_row in range(ROWS):
        board_row = ROWS - 1 - image_row  # board row 0 is drawn at the bottom
        for col in range(COLS):
            y, x = TOP + image_row * CELL, col * CELL
            m[y : y + CELL, x : x + CELL] = np.where(hole, board_row * COLS + col, _BOARD_CODE)
    return m


def _shifted_maps() -> np.ndarray:
    """uint8 [2J+1, 2J+1, 224, 224]: the code map shifted by (dy, dx) = (i - J, j - J)."""
    base, j = _code_map(), JITTER_PX
    out = np.full((2 * j + 1, 2 * j + 1, SIZE, SIZE), _BACKGROUND_CODE, np.uint8)
    for dy in range(-j, j + 1):
        for dx in range(-j, j + 1):
            out[dy + j, dx + j, max(dy, 0) : SIZE - max(-dy, 0), max(dx, 0) : SIZE - max(-dx, 0)] = base[
                max(-dy, 0) : SIZE - max(dy, 0), max(-dx, 0) : SIZE - max(dx, 0)
            ]
    return out


_MAPS = _shifted_maps()


def cells_from_moves(moves: str) -> np.ndarray:
    """int8 [6, 7]: EMPTY_CELL / RED_DISC / YELLOW_DISC per cell, row 0 the
    bottom row, column 0 the leftmost, from a 1-indexed move string.

    Raises:
        ValueError: a character other than 1..7, or a move into a full column.
    """
    cells = np.zeros((ROWS, COLS), np.int8)
    heights = [0] * COLS
    for ply, ch in enumerate(moves):
        if ch not in "1234567":
            raise ValueError(f"bad move {ch!r} at ply {ply + 1} of {moves!r}")
        col = int(ch) - 1
        if heights[col] == ROWS:
            raise ValueError(f"column {col + 1} is full at ply {ply + 1} of {moves!r}")
        cells[heights[col], col] = RED_DISC if ply % 2 == 0 else YELLOW_DISC
        heights[col] += 1
    return cells


def render_cells(cells: np.ndarray, red_to_move: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
    """Frames for boards given as cells.

    Args:
        cells: int [N, 6, 7] of EMPTY_CELL / RED_DISC / YELLOW_DISC (row 0 = bottom).
        red_to_move: bool [N].
        rng: jitter source (see the module docstring); None: no jitter.

    Returns:
        uint8 [N, 224, 224, 3].

    Raises:
        ValueError: wrong shapes or a cell value out of 0..2.
    """
    cells = np.asarray(cells)
    red_to_move = np.asarray(red_to_move, bool)
    n = len(cells)
    if cells.shape[1:] != (ROWS, COLS) or red_to_move.shape != (n,):
        raise ValueError(f"cells must be [N, 6, 7] and red_to_move [N], got {cells.shape} and {red_to_move.shape}")
    if n and (cells.min() < 0 or cells.max() > 2):
        raise ValueError("cells must hold 0 (empty), 1 (red) or 2 (yellow)")
    table = np.empty((n, _CODES, 3), np.uint8)  # per-frame colour of each code
    table[:, : ROWS * COLS] = _PALETTE[cells.reshape(n, ROWS * COLS)]
    table[:, _BOARD_CODE] = BOARD
    table[:, _BACKGROUND_CODE] = BACKGROUND
    table[:, _INDICATOR_CODE] = np.where(red_to_move[:, None], np.array(RED, np.uint8), np.array(YELLOW, np.uint8))
    if rng is None:
        maps = [_MAPS[JITTER_PX, JITTER_PX]] * n
    else:
        dy, dx = rng.integers(0, 2 * JITTER_PX + 1, size=(2, n))
        maps = _MAPS[dy, dx]
        gains = 1.0 + rng.uniform(-BRIGHTNESS_JITTER, BRIGHTNESS_JITTER, size=n)
        table = np.clip(table * gains[:, None, None], 0, 255).astype(np.uint8)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i in range(n):  # per frame: a gather from a 45-entry table stays in cache
        np.take(table[i], maps[i], axis=0, out=out[i])
    return out


def render_moves(moves: Sequence[str], rng: np.random.Generator | None = None) -> np.ndarray:
    """uint8 [N, 224, 224, 3]: frames of the positions reached by 1-indexed
    move strings (see :func:`render_cells`).

    Raises:
        ValueError: a bad move string.
    """
    if not len(moves):
        return np.zeros((0, SIZE, SIZE, 3), np.uint8)
    cells = np.stack([cells_from_moves(m) for m in moves])
    red_to_move = np.array([len(m) % 2 == 0 for m in moves])
    return render_cells(cells, red_to_move, rng)


def mirror_moves(moves: str) -> str:
    """The left-right mirror of a 1-indexed move string (column c -> 8 - c);
    the mirrored position has the same game value."""
    return moves.translate(str.maketrans("1234567", "7654321"))
