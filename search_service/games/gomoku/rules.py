"""Gomoku on a 15x15 board, vectorised over a batch of states.

The NumPy rules of the bundled Gomoku plug-in
(:class:`search_service.games.protocol.GameRules`), the same game as
OpenSpiel's ``gomoku`` with its default parameters (size 15, connect 5, no
wrapping): Black (player 0) moves first on the empty board; the players take
turns placing a stone on any empty square (there is no pass); a player who
makes five or more of their stones in a row, along a row, a column or either
diagonal, wins at once (freestyle: a line of six or more wins too); the game
is a draw when the board fills up without such a line.

Board: the square in row ``r`` and column ``c`` (both 0..14) is action
``r * 15 + c``, as in OpenSpiel (whose ``action_to_string`` writes it
``"r,c"``), and bit ``r * 15 + c`` of a 225-bit board held in four uint64
words (bit ``i`` is bit ``i % 64`` of word ``i // 64``; bits 225..255 are
never set).

State, 9 uint64 words: ``[0:4]`` the stones of the player to move, ``[4:8]``
the opponent's, ``[8]`` flags: bit 0 the absolute player to move (0 Black,
1 White), bit 1 set when the last move made a line of five (then the game is
over and the opponent, who made it, has won). The turn passes after every
move, the last one too. The flag is what lets ``is_terminal`` avoid a search
of the whole board: ``step`` looks for the line only through the stone it
places, the one place a new line can be.

Notation: a move is the column letter ``a``-``o`` (column 0..14) then the row
number ``1``-``15`` (row 0..14), so ``"h8"`` is the centre (action 112) and
``"a1"`` is action 0, the square OpenSpiel prints first. Moves are written one
after another (``"h8h9i9"``): a letter always starts the next move, so the row
numbers' one or two digits need no separator. Lower case only; no leading
zero (``"a05"`` is an error), so every move has one spelling.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from search_service.games.rules_helpers import (checked_action, checked_actions, checked_states, replay,
                                                unpack_bits)

SIZE = 15
SQUARES = SIZE * SIZE
NUM_ACTIONS = SQUARES
CONNECT = 5  # stones in a row that win; more win too
STATE_WORDS = 9
MAX_MOVES = SQUARES

_U64 = np.uint64
_BOARD_WORDS = 4  # 225 bits in 4 words
_OWN = slice(0, _BOARD_WORDS)
_OPP = slice(_BOARD_WORDS, 2 * _BOARD_WORDS)
_FLAGS = 2 * _BOARD_WORDS
_TO_PLAY = _U64(1)  # flags bit 0: the absolute player to move
_WON = _U64(2)  # flags bit 1: the last move made a line
_COLUMNS = "abcdefghijklmno"
# Every square set: words 0-2 whole, word 3 its low 33 bits (225 = 3 * 64 + 33).
_FULL = np.array([(1 << 64) - 1] * 3 + [(1 << (SQUARES - 3 * 64)) - 1], _U64)
# Bit 225 lies off the board and so is never set: the line table below points
# there for the steps that leave the board, which then read as empty squares.
_OFF = SQUARES


def _line_table() -> np.ndarray:
    """int64 [225, 4, 2, 4]: for each square, each direction (along a row,
    along a column, the diagonal and the anti-diagonal) and each way along it,
    the squares 1..4 steps away, nearest first; ``_OFF`` past the edge, so
    that no line wraps from one side of the board to the other."""
    row, column = np.divmod(np.arange(SQUARES), SIZE)
    directions = np.array([(0, 1), (1, 0), (1, 1), (1, -1)])  # (rows, columns) per step
    ways = np.array([1, -1])
    steps = np.arange(1, CONNECT)
    # [square, direction, way, step] by broadcasting
    reach = ways[None, None, :, None] * steps[None, None, None, :]
    r = row[:, None, None, None] + reach * directions[None, :, 0, None, None]
    c = column[:, None, None, None] + reach * directions[None, :, 1, None, None]
    inside = (r >= 0) & (r < SIZE) & (c >= 0) & (c < SIZE)
    return np.where(inside, r * SIZE + c, _OFF)


_LINES = _line_table()


def _split(states: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(own uint64 [B, 4], opponent's uint64 [B, 4], flags uint64 [B]) of
    checked states; ValueError where ``states`` is not uint64 [B, 9]."""
    states = checked_states(states, STATE_WORDS)
    return states[:, _OWN], states[:, _OPP], states[:, _FLAGS]


def _makes_line(stones: np.ndarray, squares: np.ndarray) -> np.ndarray:
    """bool [B]: the stones (uint64 [B, 4], one player's, the stone on
    ``squares`` (int64 [B]) among them) hold a line of five or more through
    that square."""
    bits = unpack_bits(stones, _BOARD_WORDS * 64)  # [B, 256]: _OFF (225) reads False
    near = bits[np.arange(bits.shape[0])[:, None, None, None], _LINES[squares]]  # [B, 4, 2, 4]
    # The stones next to the square without a gap, each way along each direction.
    run = np.logical_and.accumulate(near, axis=3).sum(axis=(2, 3))  # [B, 4]
    return (run + 1 >= CONNECT).any(axis=1)


def _full(own: np.ndarray, opp: np.ndarray) -> np.ndarray:
    """bool [B]: no empty square left."""
    return ((own | opp) == _FULL).all(axis=1)


# -- the rules protocol ------------------------------------------------------


def initial(batch: int) -> np.ndarray:
    """uint64 [batch, 9]: the empty board, Black to move."""
    return np.zeros((batch, STATE_WORDS), _U64)


def legal_mask(states: np.ndarray) -> np.ndarray:
    """bool [B, 225]: the empty squares, in games still going; all False in
    finished ones.

    Raises:
        ValueError: ``states`` is not uint64 [B, 9].
    """
    own, opp, _ = _split(states)
    empty = ~unpack_bits(own | opp, SQUARES)
    return empty & ~is_terminal(states)[:, None]


def step(states: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Places the player to move's stone on ``actions`` (int [B], squares 0..224).

    Returns ``(next uint64 [B, 9], terminal bool [B], reward float32 [B])``;
    the reward is +1 where the move made a line of five or more (the mover
    wins) and 0 elsewhere, a full board's draw included.

    Raises:
        ValueError: ``states`` is not uint64 [B, 9], ``actions`` is not
            integers [B], or an action is outside 0..224, on a taken square or
            in a finished game (naming the first such state and its action).
    """
    own, opp, flags = _split(states)
    actions = checked_actions(actions, legal_mask(states), move_to_text)
    word, bit = np.divmod(actions, 64)
    placed = np.zeros_like(own)
    placed[np.arange(own.shape[0]), word] = _U64(1) << bit.astype(_U64)
    mover = own | placed
    won = _makes_line(mover, actions)
    nxt_flags = ((flags & _TO_PLAY) ^ _TO_PLAY) | np.where(won, _WON, _U64(0))
    nxt = np.concatenate([opp, mover, nxt_flags[:, None]], axis=1)
    terminal = won | _full(mover, opp)
    return nxt, terminal, won.astype(np.float32)


def is_terminal(states: np.ndarray) -> np.ndarray:
    """bool [B]: the last move made a line, or the board is full.

    Raises:
        ValueError: ``states`` is not uint64 [B, 9].
    """
    own, opp, flags = _split(states)
    return ((flags & _WON) != 0) | _full(own, opp)


def returns(states: np.ndarray) -> np.ndarray:
    """float32 [B]: -1 where the opponent's last move made a line (only the
    player who just moved can have one); 0 for a draw and in games still
    going.

    Raises:
        ValueError: ``states`` is not uint64 [B, 9].
    """
    _, _, flags = _split(states)
    return np.where((flags & _WON) != 0, np.float32(-1), np.float32(0)).astype(np.float32)


def to_play(states: np.ndarray) -> np.ndarray:
    """int8 [B]: 0 Black, 1 White.

    Raises:
        ValueError: ``states`` is not uint64 [B, 9].
    """
    return (_split(states)[2] & _TO_PLAY).astype(np.int8)


def observation(states: np.ndarray) -> np.ndarray:
    """uint8 [B, 2, 15, 15]: the player to move's stones, then the
    opponent's, indexed [row, column] (row 0 is row number 1, column 0
    column a).

    Raises:
        ValueError: ``states`` is not uint64 [B, 9].
    """
    own, opp, _ = _split(states)
    planes = unpack_bits(np.stack([own, opp], axis=1), SQUARES)  # [B, 2, 225]
    return planes.view(np.uint8).reshape(-1, 2, SIZE, SIZE)


def move_to_text(action: int) -> str:
    """``"h8"`` for action 112 (row 7, column 7), ``"a1"`` for 0, ``"o15"`` for 224.

    Raises:
        ValueError: ``action`` is outside 0..224.
    """
    row, column = divmod(checked_action(action, NUM_ACTIONS), SIZE)
    return f"{_COLUMNS[column]}{row + 1}"


def moves_to_text(actions: Sequence[int]) -> str:
    """The move string of several actions (``[112, 127] -> "h8h9"``).

    Raises:
        ValueError: an action is outside 0..224.
    """
    return "".join(move_to_text(a) for a in actions)


def parse_moves(text: str) -> np.ndarray:
    """uint64 [1, 9]: the position a move string reaches from the start.

    Raises:
        ValueError: a move that is not a column letter a-o followed by a row
            number 1-15, a move on a taken square, or one after the game
            ended (a line of five, or the full board after 225 moves). The
            message names the 1-based character where the move, or for a
            bad row number the number, starts.
    """
    return replay(initial(1), _read_moves(text), legal_mask, step, lambda action: "the square is taken")


def _read_moves(text: str) -> Iterator[tuple[int, str, int]]:
    """(1-based character, text, action) of each move in ``text``, read one
    at a time, so that an illegal move is reported before a malformed one
    after it; ValueError at the first malformed move."""
    i = 0
    while i < len(text):
        column = text[i]
        if column not in _COLUMNS:
            raise ValueError(f"character {i + 1}: {column!r} is not a column letter a-o")
        end = i + 1
        while end < len(text) and "0" <= text[end] <= "9":  # ASCII digits only (str.isdigit takes others)
            end += 1
        number = text[i + 1:end]
        if not number:
            if end == len(text):
                raise ValueError(f"character {i + 1}: {column!r} is cut short (a move is a column letter a-o "
                                 "and a row number 1-15, e.g. h8)")
            raise ValueError(f"character {end + 1}: {text[end]!r} is not a row number 1-15")
        # Two digits at most before int(): a long run of digits is an error, not a huge number.
        if number[0] == "0" or len(number) > 2 or int(number) > SIZE:
            raise ValueError(f"character {i + 2}: {number!r} is not a row number 1-15")
        yield i + 1, text[i:end], (int(number) - 1) * SIZE + _COLUMNS.index(column)
        i = end


def to_openspiel_action(action: int) -> int:
    """OpenSpiel's ``gomoku`` numbers the squares the same way (row * 15 + column).

    Raises:
        ValueError: ``action`` is outside 0..224.
    """
    return checked_action(action, NUM_ACTIONS)
