"""The games the search serves, as the MCTS and the search server see them.

A :class:`SearchGame` is one game's rules in the shape the tree search needs:
states as ``uint64 [M, W]`` words (``W = state_words``), ``A = num_actions``
actions, the legal actions, one move, a position's known result, random
rollouts and the value model's observation; and, for the server, the game's
notation and its position batches. Two kinds exist:

* :data:`CONNECT_FOUR` (:class:`ConnectFourSearch`), over the Connect Four
  module (:mod:`search_service.games.connect4`): a state is Pascal Pons'
  two bitboards ``[current, mask]``, its positions are
  :class:`~search_service.games.connect4.Positions`, its rollouts the
  table-driven ones of :mod:`search_service.mcts.rollout`, and it has a value
  model (``connect4_value``) and explicit boards;
* :class:`PluginSearch`, over any game folder's NumPy rules
  (:mod:`search_service.games.protocol`, loaded by
  :func:`search_service.games.plugin.load_game`): its positions are the state
  words themselves, its rollouts the generic ones
  (:func:`search_service.mcts.rollout.plugin_rollout_values`), and it has
  neither a value model nor explicit boards.

Both draw rollouts by the same rule (:mod:`search_service.mcts.philox`), so
the Connect Four rules run through :class:`PluginSearch` search exactly the
tree :data:`CONNECT_FOUR` does (tests/search/test_plugin_search.py checks it).

The tree search needs of every game that the turn passes after every action,
passes included (the protocol's rule: ``returns(next) == -reward``), so a
value backed up one edge higher changes sign.

Known results (``node_terminal`` codes of :mod:`search_service.mcts.tree`): a
finished position the side to move has lost is ``TERMINAL_LOSS``, drawn
``TERMINAL_DRAW``, and won (a game such as Othello, whose last move may
leave the side to move ahead) ``PROVEN_WIN``: its value is as exactly known
as a proof's.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from search_service.games import connect4
from search_service.games.plugin import GamePlugin
from search_service.mcts import codes
from search_service.mcts.rollout import plugin_rollout_values, rollout_values

CONNECT_FOUR_MODEL = "connect4_value"  # the value model of the bundled Connect Four (reward_service/models)


class SearchGame(ABC):
    """One game's rules for the tree search and the search server.

    Attributes:
        name: the game's name (``SearchRequest.game``).
        num_actions: A, actions ``0 .. A-1`` (passes included).
        state_words: W, uint64 words a state.
        max_moves: no game lasts longer (plies): a selection path's and a
            rollout's longest.
        observation_shape: (planes, rows, columns) of :meth:`observation`.
        value_model: the value model's name on the reward service, or ""
            where the game has none (its leaves are valued by rollouts only).
        boards: whether :meth:`from_cells` takes explicit boards.
        action_dtype: the dtype that holds an action (int8 up to 127 actions,
            int16 beyond): ``Tree.node_action``'s.

    Subclasses implement the abstract methods; every method works on a batch.
    """

    name: str
    num_actions: int
    state_words: int
    max_moves: int
    observation_shape: tuple[int, int, int]
    value_model: str = ""
    boards: bool = False

    @property
    def action_dtype(self) -> type:
        return np.int8 if self.num_actions <= 127 else np.int16

    @property
    def label(self) -> str:
        """How messages name the game (a plug-in: its name and folder)."""
        return repr(self.name)

    @property
    def rows(self) -> int:
        return self.observation_shape[1]

    @property
    def columns(self) -> int:
        return self.observation_shape[2]

    # -- positions (the server's side) ----------------------------------------
    @abstractmethod
    def as_states(self, positions) -> np.ndarray:
        """uint64 [B, W]: the state words of a batch of positions."""

    @abstractmethod
    def positions(self, states: np.ndarray):
        """The batch of positions holding ``states`` (uint64 [B, W])."""

    @abstractmethod
    def stack(self, batches: Sequence) -> object:
        """One batch of positions holding ``batches`` in order."""

    @abstractmethod
    def parse_moves(self, text: str):
        """A batch of one position: the state a move string reaches.

        Raises:
            ValueError: a malformed or illegal move (the message names its character).
        """

    def from_cells(self, rows: int, columns: int, cells: bytes):
        """A batch of one position from an explicit board.

        Raises:
            ValueError: a malformed or impossible board, or a game without
                explicit boards (``boards`` False).
        """
        raise ValueError(f"game {self.name} takes positions as move strings only (no board)")

    def same_position(self, a, b) -> bool:
        """Whether two batches hold the same positions."""
        sa, sb = self.as_states(a), self.as_states(b)
        return sa.shape == sb.shape and bool((sa == sb).all())

    @abstractmethod
    def move_to_text(self, action: int) -> str:
        """One action in the game's notation."""

    def split_moves(self, text: str) -> list[int] | None:
        """The actions of ``text``, the end of a legal move string, where the
        notation tells them apart without the moves before (a session's tree
        is then re-rooted along them); None where it does not (it is
        re-rooted at the position instead: :func:`search_service.mcts.tree.reroot_to`)."""
        return None

    def is_terminal(self, positions) -> np.ndarray:
        """bool [B]: the games that are over."""
        return self.terminal_code(self.as_states(positions)) != codes.NOT_TERMINAL

    # -- the tree search's side (states uint64 [M, W]) -------------------------
    @abstractmethod
    def legal(self, states: np.ndarray) -> np.ndarray:
        """bool [M, A]: the legal actions (none in a finished game)."""

    @abstractmethod
    def play(self, states: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """uint64 [M, W]: the states after ``actions`` (int [M], each legal)."""

    @abstractmethod
    def terminal_code(self, states: np.ndarray) -> np.ndarray:
        """int8 [M]: NOT_TERMINAL, or the finished position's result for its
        side to move (TERMINAL_LOSS, TERMINAL_DRAW, PROVEN_WIN)."""

    @abstractmethod
    def rollout_values(self, states: np.ndarray, sims: np.ndarray, trees: np.ndarray,
                       seed: int | np.ndarray) -> np.ndarray:
        """float32 [M]: one uniformly random game from each unfinished state,
        its result for the state's side to move (+1, 0, -1); Philox words of
        (``sims``, ``trees``, ``seed``) as :mod:`search_service.mcts.philox` says."""

    @abstractmethod
    def observation(self, states: np.ndarray) -> np.ndarray:
        """uint8 [M, planes, rows, columns]: what the value model takes."""

    def loses_at_once(self, states: np.ndarray) -> np.ndarray | None:
        """bool [M, A]: legal actions after which the opponent wins with its
        next move (the answer's last resort, :func:`search_service.mcts.backend.best_action`);
        None where the game does not say."""
        return None


class ConnectFourSearch(SearchGame):
    """Connect Four (:mod:`search_service.games.connect4`): states ``[current, mask]``."""

    name = connect4.NAME
    num_actions = connect4.NUM_ACTIONS
    state_words = 2
    max_moves = connect4.MAX_MOVES
    observation_shape = (2, connect4.ROWS, connect4.COLUMNS)
    value_model = CONNECT_FOUR_MODEL
    boards = True

    def as_states(self, positions) -> np.ndarray:
        if isinstance(positions, np.ndarray):
            return positions
        return np.stack([positions.current, positions.mask], axis=1).astype(np.uint64)

    def positions(self, states: np.ndarray) -> connect4.Positions:
        mask = np.ascontiguousarray(states[:, 1])
        return connect4.Positions(np.ascontiguousarray(states[:, 0]), mask, connect4.popcount(mask))

    def stack(self, batches: Sequence) -> connect4.Positions:
        return connect4.stack(list(batches))

    def parse_moves(self, text: str) -> connect4.Positions:
        return connect4.parse_moves(text)

    def from_cells(self, rows: int, columns: int, cells: bytes) -> connect4.Positions:
        return connect4.from_cells(rows, columns, cells)

    def move_to_text(self, action: int) -> str:
        return connect4.move_to_text(action)

    def split_moves(self, text: str) -> list[int]:
        return [int(c) - 1 for c in text]  # one digit a move

    def legal(self, states: np.ndarray) -> np.ndarray:
        return connect4.legal_bits(states[:, 1]) & (self.terminal_code(states) == codes.NOT_TERMINAL)[:, None]

    def play(self, states: np.ndarray, actions: np.ndarray) -> np.ndarray:
        current, mask = connect4.play_bits(states[:, 0], states[:, 1], actions)
        return np.stack([current, mask], axis=1)

    def terminal_code(self, states: np.ndarray) -> np.ndarray:
        return codes.connect4_terminal_code(states[:, 0], states[:, 1])

    def rollout_values(self, states, sims, trees, seed) -> np.ndarray:
        return rollout_values(np.ascontiguousarray(states[:, 0]), np.ascontiguousarray(states[:, 1]), sims, trees,
                              seed)

    def observation(self, states: np.ndarray) -> np.ndarray:
        return connect4.observation(self.positions(states))

    def loses_at_once(self, states: np.ndarray) -> np.ndarray:
        return connect4.loses_at_once_bits(states[:, 0], states[:, 1])


CONNECT_FOUR = ConnectFourSearch()
"""The bundled Connect Four: every search's game unless it names another."""


class PluginSearch(SearchGame):
    """A game folder's NumPy rules (:class:`~search_service.games.plugin.GamePlugin`):
    its positions are its states, uint64 [B, W]; no value model, no boards."""

    def __init__(self, plugin: GamePlugin):
        meta = plugin.meta
        self.plugin = plugin
        self.rules = plugin.rules
        self.name = meta.name
        self.num_actions = meta.num_actions
        self.state_words = meta.state_words
        self.max_moves = meta.max_moves
        self.observation_shape = tuple(meta.observation)

    def __repr__(self) -> str:
        return f"PluginSearch({self.label})"

    @property
    def label(self) -> str:
        return self.plugin.meta.label

    def as_states(self, positions) -> np.ndarray:
        return np.asarray(positions, np.uint64)

    def positions(self, states: np.ndarray) -> np.ndarray:
        return states

    def stack(self, batches: Sequence) -> np.ndarray:
        return np.concatenate([self.as_states(b) for b in batches]) if batches else np.zeros(
            (0, self.state_words), np.uint64)

    def parse_moves(self, text: str) -> np.ndarray:
        return self.rules.parse_moves(text)

    def move_to_text(self, action: int) -> str:
        return self.rules.move_to_text(int(action))

    def legal(self, states: np.ndarray) -> np.ndarray:
        return self.rules.legal_mask(states)

    def play(self, states: np.ndarray, actions: np.ndarray) -> np.ndarray:
        return self.rules.step(states, np.asarray(actions, np.int64))[0]

    def terminal_code(self, states: np.ndarray) -> np.ndarray:
        if states.shape[0] == 0:
            return np.zeros(0, np.int8)
        over = self.rules.is_terminal(states)
        result = self.rules.returns(states)
        code = np.where(result < 0, codes.TERMINAL_LOSS, np.where(result > 0, codes.PROVEN_WIN, codes.TERMINAL_DRAW))
        return np.where(over, code, codes.NOT_TERMINAL).astype(np.int8)

    def rollout_values(self, states, sims, trees, seed) -> np.ndarray:
        return plugin_rollout_values(self.rules, self.max_moves, states, sims, trees, seed, self.name)

    def observation(self, states: np.ndarray) -> np.ndarray:
        return self.rules.observation(states)
