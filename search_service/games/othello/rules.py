"""Othello on 8x8 bitboards, vectorised over a batch of states.

The NumPy rules of the bundled Othello plug-in
(:class:`search_service.games.protocol.GameRules`), the same game as
OpenSpiel's ``othello``: Black (player 0) moves first from the four centre
discs (d4 and e5 White, e4 and d5 Black); a move places a disc that brackets
at least one line of opponent discs and flips every bracketed line; a player
with no such move passes, and only then; the game is over when neither player
can move, and the player with more discs wins (equal counts draw).

Board: the square in row ``r`` (0..7, rank "1" to "8") and column ``c``
(0..7, file "a" to "h") is bit ``r * 8 + c`` of a uint64. That is also its
action number, as in OpenSpiel; action 64 is the pass.

State, 3 uint64 words: ``[0]`` the discs of the player to move, ``[1]`` the
opponent's, ``[2]`` the absolute player to move (0 Black, 1 White). The turn
passes after every action, the last one too, so a finished game's state names
the player who would move next.

Notation: two characters a move, the file letter then the rank digit
(``"f5d6c3"``), and ``"--"`` for a pass, so every move is exactly two
characters and an error's character index is easy to read. Lower case only.

Moves are found with shifts: a disc seen from a square along one of the eight
directions is a shift of the bitboard, masked so that nothing wraps from one
edge of the board to the other.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from search_service.games.rules_helpers import (checked_action, checked_actions, checked_states, popcount,
                                                replay)

SIZE = 8
SQUARES = SIZE * SIZE
PASS = SQUARES  # action 64
NUM_ACTIONS = SQUARES + 1
STATE_WORDS = 3
MAX_MOVES = 119  # 60 discs, each after the first preceded by at most one pass

_U64 = np.uint64
_ONE = _U64(1)
_FILES = "abcdefgh"
_FILE_A = sum(1 << (r * SIZE) for r in range(SIZE))
_NOT_A = _U64(~_FILE_A & (2**64 - 1))  # after a shift towards h, nothing may land on file a
_NOT_H = _U64(~(_FILE_A << (SIZE - 1)) & (2**64 - 1))  # ... and towards a, nothing on file h
_ALL = _U64(2**64 - 1)
# The eight directions as four shift amounts, each taken left (towards h8) and
# right (towards a1): 1 along a rank, 8 along a file, 9 and 7 the diagonals.
# Each shift's mask clears the file that a wrapped-around bit would land on.
_SHIFT = np.array([1, SIZE, SIZE + 1, SIZE - 1], _U64)
_LEFT_MASK = np.array([_NOT_A, _ALL, _NOT_A, _NOT_H], _U64)
_RIGHT_MASK = np.array([_NOT_H, _ALL, _NOT_H, _NOT_A], _U64)
# A run of opponent discs between two squares is at most 6 long: one step
# reaches the first disc, five more the rest.
_RUN_STEPS = SIZE - 3
_BIT = np.arange(SQUARES, dtype=_U64)  # bit index of each square, [row * 8 + column]

# Black: e4 (row 3, column 4) and d5 (row 4, column 3); White: d4 and e5.
_BLACK0 = (1 << 28) | (1 << 35)
_WHITE0 = (1 << 27) | (1 << 36)


# -- bit-level helpers (uint64 [B] in, uint64 [B] out) -----------------------


def _runs(start: np.ndarray, opp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The opponent discs reached from ``start`` (uint64 [B]) along each
    direction without a gap: uint64 [B, 4] towards h8 and [B, 4] towards a1."""
    opp_left = opp[:, None] & _LEFT_MASK  # masking the target is masking the shift
    opp_right = opp[:, None] & _RIGHT_MASK
    s = start[:, None]
    left = (s << _SHIFT) & opp_left
    right = (s >> _SHIFT) & opp_right
    for _ in range(_RUN_STEPS):
        left |= (left << _SHIFT) & opp_left
        right |= (right >> _SHIFT) & opp_right
    return left, right


def _beyond(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The squares one step past each run of :func:`_runs` (uint64 [B, 4] twice)."""
    return (left << _SHIFT) & _LEFT_MASK, (right >> _SHIFT) & _RIGHT_MASK


def _moves(own: np.ndarray, opp: np.ndarray) -> np.ndarray:
    """uint64 [B]: the empty squares where ``own`` may place a disc."""
    past_left, past_right = _beyond(*_runs(own, opp))
    reach = np.bitwise_or.reduce(past_left | past_right, axis=1)
    return reach & ~(own | opp)


def _flips(own: np.ndarray, opp: np.ndarray, move: np.ndarray) -> np.ndarray:
    """uint64 [B]: the opponent discs that a disc on ``move`` (one bit, or 0
    for a pass) flips: each run from the move that ends on an own disc."""
    left, right = _runs(move, opp)
    past_left, past_right = _beyond(left, right)
    o = own[:, None]
    flipped = np.where((past_left & o) != 0, left, _U64(0)) | np.where((past_right & o) != 0, right, _U64(0))
    return np.bitwise_or.reduce(flipped, axis=1)


def _words(states: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    states = checked_states(states, STATE_WORDS)
    return states[:, 0], states[:, 1], states[:, 2]


def _sign(x: np.ndarray) -> np.ndarray:
    return np.sign(x).astype(np.float32)


# -- the rules protocol ------------------------------------------------------


def initial(batch: int) -> np.ndarray:
    """uint64 [batch, 3]: the starting position, Black to move."""
    return np.tile(np.array([[_BLACK0, _WHITE0, 0]], _U64), (batch, 1))


def legal_mask(states: np.ndarray) -> np.ndarray:
    """bool [B, 65]: the squares the player to move may take, or only the pass
    (64) where no square is and the opponent can move; all False once neither
    player can move.

    Raises:
        ValueError: ``states`` is not uint64 [B, 3].
    """
    own, opp, _ = _words(states)
    mine = _moves(own, opp)
    mask = np.empty((own.shape[0], NUM_ACTIONS), np.bool_)
    mask[:, :SQUARES] = ((mine[:, None] >> _BIT) & _ONE) != 0
    mask[:, PASS] = (mine == 0) & (_moves(opp, own) != 0)
    return mask


def step(states: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plays ``actions`` (int [B]: 0..63 a square, 64 the pass).

    Returns ``(next uint64 [B, 3], terminal bool [B], reward float32 [B])``;
    the reward is the mover's result where the move ended the game (+1 more
    discs, -1 fewer, 0 equal) and 0 elsewhere.

    Raises:
        ValueError: ``states`` is not uint64 [B, 3], ``actions`` is not [B],
            or an action is outside 0..64 or not legal (naming the first such
            state and its action).
    """
    own, opp, player = _words(states)
    actions = checked_actions(actions, legal_mask(states), move_to_text)
    square = np.minimum(actions, SQUARES - 1).astype(_U64)  # keeps the shift below 64 for passes
    move = np.where(actions == PASS, _U64(0), _ONE << square)
    flips = _flips(own, opp, move)
    mover, other = own | move | flips, opp & ~flips
    nxt = np.stack([other, mover, player ^ _ONE], axis=1)
    terminal = is_terminal(nxt)
    reward = np.where(terminal, _sign(popcount(mover) - popcount(other)), np.float32(0))
    return nxt, terminal, reward.astype(np.float32)


def is_terminal(states: np.ndarray) -> np.ndarray:
    """bool [B]: neither player has a square to play.

    Raises:
        ValueError: ``states`` is not uint64 [B, 3].
    """
    own, opp, _ = _words(states)
    return (_moves(own, opp) == 0) & (_moves(opp, own) == 0)


def returns(states: np.ndarray) -> np.ndarray:
    """float32 [B]: the player to move's result in finished games (+1 more
    discs, -1 fewer, 0 equal); 0 in games still going.

    Raises:
        ValueError: ``states`` is not uint64 [B, 3].
    """
    own, opp, _ = _words(states)
    return np.where(is_terminal(states), _sign(popcount(own) - popcount(opp)), np.float32(0)).astype(np.float32)


def to_play(states: np.ndarray) -> np.ndarray:
    """int8 [B]: 0 Black, 1 White.

    Raises:
        ValueError: ``states`` is not uint64 [B, 3].
    """
    return (_words(states)[2] & _ONE).astype(np.int8)


def observation(states: np.ndarray) -> np.ndarray:
    """uint8 [B, 2, 8, 8]: the player to move's discs, then the opponent's,
    indexed [row, column] (row 0 is rank 1, column 0 file a).

    Raises:
        ValueError: ``states`` is not uint64 [B, 3].
    """
    own, opp, _ = _words(states)
    planes = np.stack([own, opp], axis=1)[:, :, None]  # [B, 2, 1]
    return ((planes >> _BIT) & _ONE).astype(np.uint8).reshape(-1, 2, SIZE, SIZE)


def move_to_text(action: int) -> str:
    """``"d3"`` for action 19 (row 2, column 3), ``"--"`` for the pass (64).

    Raises:
        ValueError: ``action`` is outside 0..64.
    """
    action = checked_action(action, NUM_ACTIONS)
    if action == PASS:
        return "--"
    row, column = divmod(action, SIZE)
    return f"{_FILES[column]}{row + 1}"


def moves_to_text(actions: Sequence[int]) -> str:
    """The move string of several actions (``[37, 43] -> "f5d6"``).

    Raises:
        ValueError: an action is outside 0..64.
    """
    return "".join(move_to_text(a) for a in actions)


def parse_moves(text: str) -> np.ndarray:
    """uint64 [1, 3]: the position a move string reaches from the start.

    Raises:
        ValueError: a move that is not a file letter a-h and a rank digit 1-8
            or ``--``, a move cut short, more than 119 moves, a move that is
            not legal (a pass while a square is open, a square that flips
            nothing or is taken) or comes after the game ended. The message
            names the 1-based character where the move starts.
    """
    if len(text) > 2 * MAX_MOVES:
        raise ValueError(f"character {2 * MAX_MOVES + 1}: an Othello game has at most {MAX_MOVES} moves")
    moves = ((i + 1, text[i:i + 2], _parse_move(text[i:i + 2], i + 1)) for i in range(0, len(text), 2))
    return replay(initial(1), moves, legal_mask, step, _why_illegal)


def _why_illegal(action: int) -> str:
    return "a square is open" if action == PASS else "it flips nothing or the square is taken"


def _parse_move(move: str, at: int) -> int:
    """The action of one two-character move starting at 1-based character ``at``."""
    if move == "--":
        return PASS
    if len(move) < 2:
        raise ValueError(f"character {at}: {move!r} is cut short (a move is two characters, e.g. d3 or --)")
    if move[0] not in _FILES:
        raise ValueError(f"character {at}: {move[0]!r} is not a file letter a-h")
    if not "1" <= move[1] <= "8":
        raise ValueError(f"character {at + 1}: {move[1]!r} is not a rank digit 1-8")
    return (int(move[1]) - 1) * SIZE + _FILES.index(move[0])


def to_openspiel_action(action: int) -> int:
    """OpenSpiel's ``othello`` numbers actions the same way (64 the pass).

    Raises:
        ValueError: ``action`` is outside 0..64.
    """
    return checked_action(action, NUM_ACTIONS)
