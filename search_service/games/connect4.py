"""Connect Four rules on bitboards, vectorised over a batch of positions.

Layout (Pascal Pons, "Solving Connect 4", http://blog.gamesolver.org/): each
position is two uint64 bitboards, column-major with 7 bits per column (6 rows
plus one always-empty sentinel bit that stops shifts wrapping from one column
into the next). The cell in column ``c`` (0..6, left to right) and row ``r``
(0..5, 0 at the bottom) is bit ``c * 7 + r``.

* ``current`` holds the stones of the side to move, ``mask`` every stone.
  The opponent's stones are ``current ^ mask``.
* Playing column ``c``: the new stone is ``(mask + bottom(c)) & column(c)``
  (the carry runs up the column to its lowest empty cell); then
  ``current ^= mask`` swaps sides and ``mask`` gains the stone.
* Four in a row for a bitboard ``b``, along the shift ``s`` (1 vertical,
  7 horizontal, 6 and 8 the diagonals): ``m = b & (b >> s); m & (m >> 2s) != 0``.

Actions are 0-based columns; the text notation is 1-based (``"4"`` is the
centre column), as in Pons' test files. Every function takes and returns
batches; :func:`parse_moves` and :func:`from_cells` build a batch of one, and
:func:`stack` / :func:`take` combine and slice batches.

This module doubles as the game's plug-in object: ``GAMES["connect4"]`` is the
module itself (see :class:`search_service.games.Game`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

NAME = "connect4"
ROWS = 6
COLUMNS = 7
NUM_ACTIONS = COLUMNS
MAX_MOVES = ROWS * COLUMNS
COLUMN_BITS = ROWS + 1  # bits per column, sentinel included

_U64 = np.uint64
# Per column c: its bottom cell, its top cell, and its 6 playable cells.
BOTTOM = np.array([1 << (c * COLUMN_BITS) for c in range(COLUMNS)], dtype=_U64)  # uint64 [7]
TOP = np.array([1 << (c * COLUMN_BITS + ROWS - 1) for c in range(COLUMNS)], dtype=_U64)  # uint64 [7]
COLUMN_MASK = np.array([((1 << ROWS) - 1) << (c * COLUMN_BITS) for c in range(COLUMNS)], dtype=_U64)  # uint64 [7]
BOARD_MASK = _U64(sum(int(m) for m in COLUMN_MASK))  # every playable cell
# Bit index of cell [row, col]: observation planes are read through it.
CELL_BIT = (np.arange(COLUMNS)[None, :] * COLUMN_BITS + np.arange(ROWS)[:, None]).astype(_U64)  # uint64 [6, 7]
# Direction shifts (vertical, horizontal, two diagonals) for the four-in-a-row test.
_SHIFTS = np.array([[1, COLUMN_BITS, COLUMN_BITS - 1, COLUMN_BITS + 1]], dtype=_U64)  # uint64 [1, 4]
_SHIFTS2 = _SHIFTS * _U64(2)


@dataclass(frozen=True)
class Positions:
    """A batch of B Connect Four positions (Pons' bitboards)."""

    current: np.ndarray  # uint64 [B]: stones of the side to move
    mask: np.ndarray  # uint64 [B]: occupied cells
    moves: np.ndarray  # int32 [B]: stones on the board (ply count)

    def __len__(self) -> int:
        return int(self.moves.shape[0])


# -- bit-level kernels (arrays in, arrays out; shared with the MCTS) ----------


def popcount(bits: np.ndarray) -> np.ndarray:
    """int32 [...]: set bits of each uint64 (stones on a bitboard)."""
    if hasattr(np, "bitwise_count"):  # NumPy >= 2.0
        return np.bitwise_count(bits).astype(np.int32)
    x = np.asarray(bits, dtype=_U64)  # SWAR popcount, for NumPy 1.x
    x = x - ((x >> _U64(1)) & _U64(0x5555555555555555))
    x = (x & _U64(0x3333333333333333)) + ((x >> _U64(2)) & _U64(0x3333333333333333))
    x = (x + (x >> _U64(4))) & _U64(0x0F0F0F0F0F0F0F0F)
    return ((x * _U64(0x0101010101010101)) >> _U64(56)).astype(np.int32)



def has_four(bits: np.ndarray) -> np.ndarray:
    """bool [...]: whether each uint64 bitboard in ``bits`` has four in a row."""
    x = bits[..., None]
    m = x >> _SHIFTS[0]
    m &= x
    t = m >> _SHIFTS2[0]
    t &= m
    return t.any(axis=-1)


def legal_bits(mask: np.ndarray) -> np.ndarray:
    """bool [..., 7]: columns whose top cell is empty (ignores wins)."""
    return (mask[..., None] & TOP) == 0


def play_bits(current: np.ndarray, mask: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(current, mask) after dropping a stone in column ``actions`` (int [...]).

    No legality check: the column must not be full.
    """
    move = (mask + BOTTOM[actions]) & COLUMN_MASK[actions]
    return current ^ mask, mask | move


def loses_at_once_bits(current: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """bool [B, 7]: legal columns after which the opponent has four in a row with
    its next stone (a move that loses at once; a move that wins is never one).
    ``current``, ``mask``: uint64 [B], the side to move's stones and the occupied cells."""
    cols = np.arange(COLUMNS)
    ours, theirs, m = current[:, None], (current ^ mask)[:, None], mask[:, None]  # [B, 1]
    child = m | ((m + BOTTOM[cols]) & COLUMN_MASK[cols])  # [B, 7]: the cells after our stone in each column
    wins = has_four(ours | (child ^ m))  # [B, 7]: that stone makes our four
    reply = (child[..., None] + BOTTOM[cols]) & COLUMN_MASK[cols]  # [B, 7, 7]: their stone in each column after
    reply_legal = (child[..., None] & TOP[cols]) == 0
    threat = (reply_legal & has_four(theirs[..., None] | reply)).any(axis=-1)  # [B, 7]
    return legal_bits(mask) & ~wins & threat


# -- public API ---------------------------------------------------------------


def empty(batch: int = 1) -> Positions:
    """``batch`` empty boards."""
    return Positions(np.zeros(batch, _U64), np.zeros(batch, _U64), np.zeros(batch, np.int32))


def move_to_text(action: int) -> str:
    """The 1-based column digit of a 0-based action (``3 -> "4"``)."""
    if not 0 <= action < COLUMNS:
        raise ValueError(f"action {action} is outside 0..{COLUMNS - 1}")
    return str(action + 1)


def moves_to_text(actions: Sequence[int]) -> str:
    """A move string for 0-based actions (``[3, 3, 4] -> "445"``)."""
    return "".join(move_to_text(int(a)) for a in actions)


def parse_moves(text: str) -> Positions:
    """The position reached by a move string (batch of 1).

    ``text`` lists 1-based columns from the empty board, first player first
    (``"4453"``); the empty string is the empty board.

    Raises:
        ValueError: more than 42 moves, a character that is not a digit, a
            column outside 1..7, a move into a full column, or a move after the
            game was already won. The message names the 1-based character index.
    """
    if len(text) > MAX_MOVES:
        raise ValueError(
            f"move string has {len(text)} moves; a Connect Four game has at most {MAX_MOVES} "
            f"(character {MAX_MOVES + 1} is one too many)"
        )
    current, mask = 0, 0  # Python ints: one position, <= 42 steps
    won_at = 0
    for i, ch in enumerate(text, start=1):
        if not ("0" <= ch <= "9"):
            raise ValueError(f"character {i} ({ch!r}) is not a column digit 1-{COLUMNS}")
        col = ord(ch) - ord("1")
        if not 0 <= col < COLUMNS:
            raise ValueError(f"character {i}: column {ch} is outside 1..{COLUMNS}")
        if won_at:
            raise ValueError(f"character {i}: move after the game was already won (by the move at character {won_at})")
        if mask & int(TOP[col]):
            raise ValueError(f"character {i}: column {ch} is full")
        current, mask = current ^ mask, mask | ((mask + int(BOTTOM[col])) & int(COLUMN_MASK[col]))
        if _four_int(current ^ mask):
            won_at = i
    return Positions(np.array([current], _U64), np.array([mask], _U64), np.array([len(text)], np.int32))


def _four_int(b: int) -> bool:
    for s in (1, COLUMN_BITS, COLUMN_BITS - 1, COLUMN_BITS + 1):
        m = b & (b >> s)
        if m & (m >> (2 * s)):
            return True
    return False


def from_cells(rows: int, columns: int, cells: bytes | bytearray | memoryview | np.ndarray) -> Positions:
    """The position of an explicit board (batch of 1).

    ``cells[row * columns + col]``, row 0 at the bottom, column 0 at the left;
    0 empty, 1 the first player's stone, 2 the second player's. The side to
    move follows from the stone counts (first player to move when equal).

    Checked: the board size; cell values; no stone above an empty cell; the
    first player has as many stones as the second or one more; not both
    players have four in a row; the player who did not move last has no four;
    if the last mover has four, one of its stones on top of a column completes
    every such four (else the game was over before its last stone). Not
    checked: that some alternating move order reaches the board (rare
    gravity-consistent boards are unreachable, e.g. a lone second-player stone
    under a first-player stone).

    Raises:
        ValueError: the board is malformed or impossible (the message says why,
            with 0-based row and column).
        TypeError: ``cells`` is not bytes-like.
    """
    if rows != ROWS or columns != COLUMNS:
        raise ValueError(f"Connect Four boards are {ROWS} rows x {COLUMNS} columns, got {rows} x {columns}")
    if isinstance(cells, np.ndarray):
        grid = cells.astype(np.int64).reshape(-1)
    elif isinstance(cells, (bytes, bytearray, memoryview)):
        grid = np.frombuffer(bytes(cells), dtype=np.uint8).astype(np.int64)
    else:
        raise TypeError(f"cells must be bytes-like, got {type(cells).__name__}")
    if grid.size != ROWS * COLUMNS:
        raise ValueError(f"cells must hold rows * columns = {ROWS * COLUMNS} values, got {grid.size}")
    grid = grid.reshape(ROWS, COLUMNS)
    bad = np.argwhere((grid < 0) | (grid > 2))
    if bad.size:
        r, c = bad[0]
        raise ValueError(
            f"cell at row {r}, column {c} holds {grid[r, c]}; allowed: 0 empty, 1 first player, 2 second player"
        )
    floating = np.argwhere((grid[1:] != 0) & (grid[:-1] == 0))
    if floating.size:
        r, c = floating[0]
        raise ValueError(f"floating stone at row {r + 1}, column {c}: the cell below it is empty")
    n1, n2 = int((grid == 1).sum()), int((grid == 2).sum())
    if n1 not in (n2, n2 + 1):
        raise ValueError(
            f"impossible stone counts: first player {n1}, second player {n2} "
            "(the first player has as many stones as the second, or one more)"
        )
    first = int((((grid == 1).astype(np.uint64)) << CELL_BIT).sum())
    second = int((((grid == 2).astype(np.uint64)) << CELL_BIT).sum())
    four1, four2 = _four_int(first), _four_int(second)
    if four1 and four2:
        raise ValueError("both players have four in a row")
    first_moved_last = n1 > n2
    last, other = (first, second) if first_moved_last else (second, first)
    names = ("first", "second") if first_moved_last else ("second", "first")
    if _four_int(other):
        raise ValueError(f"the {names[1]} player has four in a row but the {names[0]} player moved last")
    if _four_int(last) and not _last_stone_can_win(last, first | second):
        raise ValueError(f"the {names[0]} player's four in a row was complete before its last stone")
    mask = first | second
    current = first if not first_moved_last else second
    return Positions(np.array([current], _U64), np.array([mask], _U64), np.array([n1 + n2], np.int32))


def _last_stone_can_win(last: int, mask: int) -> bool:
    """Whether removing one of ``last``'s column-top stones leaves it without four."""
    for c in range(COLUMNS):
        col = mask & int(COLUMN_MASK[c])
        if not col:
            continue
        top = 1 << (col.bit_length() - 1)
        if last & top and not _four_int(last ^ top):
            return True
    return False


def to_cells(p: Positions) -> np.ndarray:
    """uint8 [B, 42]: ``cells[b, row * 7 + col]`` as :func:`from_cells` takes
    them (0 empty, 1 first player, 2 second player); ``.tobytes()`` per row."""
    first_to_move = (p.moves % 2 == 0)
    first = np.where(first_to_move, p.current, p.current ^ p.mask)
    second = p.mask ^ first
    bit1 = (first[:, None, None] >> CELL_BIT) & _U64(1)
    bit2 = (second[:, None, None] >> CELL_BIT) & _U64(1)
    return (bit1 + _U64(2) * bit2).astype(np.uint8).reshape(len(p), ROWS * COLUMNS)


def legal_mask(p: Positions) -> np.ndarray:
    """bool [B, 7]: columns the side to move may play; all False once the game
    is over (won or drawn)."""
    return legal_bits(p.mask) & ~last_mover_won(p)[:, None]


def play(p: Positions, actions: np.ndarray | Sequence[int] | int, check: bool = True) -> Positions:
    """The positions after each side to move plays ``actions`` (int [B], 0-based).

    Raises:
        ValueError: with ``check``, an action outside 0..6, into a full column,
            or in a finished game.
    """
    a = np.broadcast_to(np.asarray(actions, dtype=np.int64), p.moves.shape)
    if check:
        if np.any((a < 0) | (a >= COLUMNS)):
            raise ValueError(f"actions must be in 0..{COLUMNS - 1}, got {a.tolist()}")
        ok = legal_mask(p)[np.arange(len(p)), a]
        if not ok.all():
            b = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"position {b}: column {a[b]} (0-based) is full or the game is over")
    current, mask = play_bits(p.current, p.mask, a)
    return Positions(current, mask, p.moves + np.int32(1))


def last_mover_won(p: Positions) -> np.ndarray:
    """bool [B]: the player who just moved has four in a row (the side to move lost)."""
    return has_four(p.current ^ p.mask)


def is_draw(p: Positions) -> np.ndarray:
    """bool [B]: the board is full and nobody has four in a row."""
    return (p.mask == BOARD_MASK) & ~last_mover_won(p)


def is_terminal(p: Positions) -> np.ndarray:
    """bool [B]: the game is over (won or drawn)."""
    return (p.mask == BOARD_MASK) | last_mover_won(p)


def winning_moves(p: Positions) -> np.ndarray:
    """bool [B, 7]: legal columns that give the side to move four in a row at once."""
    legal = legal_mask(p)
    cols = np.arange(COLUMNS)
    move = (p.mask[:, None] + BOTTOM[cols]) & COLUMN_MASK[cols]  # [B, 7]; garbage where full
    return legal & has_four(p.current[:, None] | move)


def observation(p: Positions) -> np.ndarray:
    """uint8 [B, 2, 6, 7]: plane 0 the side to move's stones, plane 1 the
    opponent's, indexed [row, col] with row 0 at the bottom (what the value
    model takes)."""
    planes = np.stack([p.current, p.current ^ p.mask], axis=1)  # [B, 2]
    return ((planes[:, :, None, None] >> CELL_BIT) & _U64(1)).astype(np.uint8)


def from_observation(obs: np.ndarray) -> Positions:
    """The positions behind observations uint8 [B, 2, 6, 7] (the inverse of
    :func:`observation`; no legality check)."""
    bits = (np.asarray(obs).astype(_U64) << CELL_BIT).sum(axis=(2, 3), dtype=_U64)  # [B, 2]: distinct bits
    current, mask = bits[:, 0], bits[:, 0] | bits[:, 1]
    return Positions(current, mask, popcount(mask))


def same_position(a: Positions, b: Positions) -> bool:
    """Whether two batches hold the same positions, element by element."""
    return len(a) == len(b) and bool(np.all(a.current == b.current) and np.all(a.mask == b.mask))


def position_key(p: Positions) -> np.ndarray:
    """uint64 [B]: Pons' unique key ``current + mask`` (distinct positions, distinct keys)."""
    return p.current + p.mask


def stack(batches: Sequence[Positions]) -> Positions:
    """One batch holding the positions of ``batches`` in order."""
    if not batches:
        raise ValueError("stack needs at least one batch")
    return Positions(
        np.concatenate([b.current for b in batches]).astype(_U64),
        np.concatenate([b.mask for b in batches]).astype(_U64),
        np.concatenate([b.moves for b in batches]).astype(np.int32),
    )


def take(p: Positions, index: np.ndarray | Sequence[int] | int | slice) -> Positions:
    """The sub-batch ``p[index]`` (an int gives a batch of 1)."""
    if isinstance(index, (int, np.integer)):
        index = [int(index)]
    return Positions(p.current[index], p.mask[index], p.moves[index])


def to_text(p: Positions, b: int = 0) -> str:
    """A 6-line picture of position ``b``, top row first (X first player, O second)."""
    cells = to_cells(take(p, b)).reshape(ROWS, COLUMNS)
    glyph = {0: ".", 1: "X", 2: "O"}
    return "\n".join("".join(glyph[int(v)] for v in cells[r]) for r in range(ROWS - 1, -1, -1))
