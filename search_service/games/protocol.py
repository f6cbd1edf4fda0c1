"""The NumPy rules protocol of a game plug-in (the ``rules.py`` of a game folder).

A game folder's ``rules.py`` defines these functions at module level; the
loader (:mod:`search_service.games.plugin`) imports it and checks it against
the folder's ``game.yaml``. Every function works on a batch of B states.

A state is ``W = state_words`` unsigned 64-bit words, so a batch of states is
``np.uint64 [B, W]``: the same bytes the CUDA rules will hold, which is what
lets the conformance kit compare the two bit for bit. What the words mean is
the game's own business; equal words must mean equal states.

Players are 0 and 1 (0 moves first). ``A = num_actions``: actions are
``0 .. A-1``, passes included where the game has them.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

# The functions every rules module defines; to_openspiel_action is needed only
# where game.yaml names an OpenSpiel game.
REQUIRED = (
    "initial", "legal_mask", "step", "is_terminal", "returns", "to_play", "observation",
    "parse_moves", "move_to_text", "moves_to_text",
)
OPENSPIEL = ("to_openspiel_action",)


@runtime_checkable
class GameRules(Protocol):
    """What a game's ``rules.py`` offers (module-level functions)."""

    def initial(self, batch: int) -> np.ndarray:
        """uint64 [batch, W]: ``batch`` copies of the starting state."""

    def legal_mask(self, states: np.ndarray) -> np.ndarray:
        """bool [B, A]: the actions the player to move may take; all False in
        finished games. ``states``: uint64 [B, W]."""

    def step(self, states: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Plays ``actions`` (int64 [B]) in ``states`` (uint64 [B, W]).

        Returns ``(next, terminal, reward)``: uint64 [B, W] the states after
        the moves, bool [B] whether each game is over, float32 [B] the result
        for the player who made the move (+1 win, -1 loss, 0 draw or not over).
        The inputs are not modified.

        Raises:
            ValueError: an action is illegal in its state (out of range, not
                in ``legal_mask``, or the game is over).
        """

    def is_terminal(self, states: np.ndarray) -> np.ndarray:
        """bool [B]: the game is over. ``states``: uint64 [B, W]."""

    def returns(self, states: np.ndarray) -> np.ndarray:
        """float32 [B]: the result for the player to move (+1 win, -1 loss,
        0 draw) where the game is over; 0 where it is not. After a move the
        turn passes even if the game ended, so ``returns(next) == -reward``."""

    def to_play(self, states: np.ndarray) -> np.ndarray:
        """int8 [B]: the absolute player to move, 0 (moves first) or 1."""

    def observation(self, states: np.ndarray) -> np.ndarray:
        """uint8 [B, planes, rows, columns] (game.yaml's ``observation``): what
        the value model sees, the side to move's plane first."""

    def parse_moves(self, text: str) -> np.ndarray:
        """uint64 [1, W]: the state a move string reaches from the start
        (``""`` is the starting state).

        Raises:
            ValueError: a malformed or illegal move; the message names the
                1-based character where it starts.
        """

    def move_to_text(self, action: int) -> str:
        """One action in the game's notation.

        Raises:
            ValueError: ``action`` is outside ``0 .. A-1``.
        """

    def moves_to_text(self, actions: Sequence[int]) -> str:
        """Several actions as one move string that ``parse_moves`` reads back."""

    def to_openspiel_action(self, action: int) -> int:
        """The OpenSpiel action id of ``action`` (only where game.yaml has
        ``openspiel``).

        Raises:
            ValueError: ``action`` is outside ``0 .. A-1``.
        """
