"""Game plug-ins for the search service.

``GAMES[name]`` is an object offering the :class:`Game` protocol; for Connect
Four it is the :mod:`search_service.games.connect4` module itself. Positions
are whatever batch type the game defines (Connect Four:
:class:`~search_service.games.connect4.Positions`); every function works on a
batch of B positions.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from search_service.games import connect4


@runtime_checkable
class Game(Protocol):
    """What the search server needs from a game's rules."""

    NAME: str
    NUM_ACTIONS: int
    ROWS: int
    COLUMNS: int

    def parse_moves(self, text: str) -> Any:
        """Batch of 1 from a move string; ValueError (with the 1-based character) if illegal."""

    def from_cells(self, rows: int, columns: int, cells: bytes) -> Any:
        """Batch of 1 from an explicit board; ValueError if malformed or impossible."""

    def to_cells(self, positions: Any) -> np.ndarray:
        """uint8 [B, rows * columns], the inverse of ``from_cells``."""

    def same_position(self, a: Any, b: Any) -> bool:
        """Whether two batches hold the same positions."""

    def legal_mask(self, positions: Any) -> np.ndarray:
        """bool [B, NUM_ACTIONS]; all False in finished games."""

    def play(self, positions: Any, actions: np.ndarray) -> Any:
        """The positions after playing ``actions`` (int [B]); ValueError if illegal."""

    def last_mover_won(self, positions: Any) -> np.ndarray:
        """bool [B]: the side to move has lost."""

    def is_draw(self, positions: Any) -> np.ndarray:
        """bool [B]."""

    def is_terminal(self, positions: Any) -> np.ndarray:
        """bool [B]."""

    def observation(self, positions: Any) -> np.ndarray:
        """uint8 [B, 2, rows, columns]: side to move's plane, then the opponent's."""

    def move_to_text(self, action: int) -> str:
        """One 0-based action in the game's notation."""

    def moves_to_text(self, actions: Sequence[int]) -> str:
        """Several actions in the game's notation."""


GAMES: dict[str, Game] = {connect4.NAME: connect4}  # type: ignore[dict-item]  (a module is the plug-in)
