"""What every search backend (CPU reference, CUDA) offers, and its parameters.

A backend searches a batch of B root positions at once, one tree per root, and
answers one :class:`SearchResult` per tree plus the trees themselves, which
the caller may keep: :func:`search_service.mcts.tree.reroot` promotes the
child reached by the moves played since to root, and the re-rooted tree can be
passed back (``trees=[...]``) for the next search of that game.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from search_service.mcts import tree as tr
from search_service.mcts.games import CONNECT_FOUR, SearchGame

if TYPE_CHECKING:
    from search_service.games.connect4 import Positions
    from search_service.mcts.tree import Tree

EVALUATORS = ("rollout", "value_model")

LeafEvaluator = Callable[[np.ndarray], "tuple[np.ndarray, np.ndarray | None]"]
"""obs uint8 [N, planes, rows, columns] (the game's observation; Connect
Four's [N, 2, 6, 7]) -> (values float32 [N] in [-1, 1] for the side to
move at each leaf, priors float32 [N, A] or None). Called once per wave with
every leaf of every tree that needs a model value. Raises
:class:`EvaluationFailed` when it cannot (the backend undoes that wave)."""


@dataclass(frozen=True)
class SearchParams:
    """Budget and constants of one search call (the same for every tree).

    Raises:
        ValueError: from the constructor, for a value out of range or when
            neither ``simulations`` nor ``deadline_ms`` is given.
    """

    simulations: int | None  # simulations per tree; None = no simulation budget
    deadline_ms: float | None  # wall-clock budget (ms), checked between waves (plan.WaveTimes); None = none
    parallel_sims: int = 1  # simulations in flight per tree per wave (virtual loss)
    evaluator: str = "rollout"  # "rollout" (UCT, random rollouts) or "value_model" (PUCT)
    c_uct: float = 1.4  # UCT exploration constant
    c_puct: float = 1.5  # PUCT exploration constant
    virtual_loss: float = 1.0  # value subtracted per in-flight simulation (each also counts one visit)
    max_nodes: int = 200_000  # node pool per tree, root included
    seed: int = 0  # 64-bit Philox key for rollouts
    game: SearchGame = CONNECT_FOUR  # the game searched (search_service/mcts/games.py)

    def __post_init__(self) -> None:
        if self.simulations is None and self.deadline_ms is None:
            raise ValueError("set at least one budget: simulations or deadline_ms")
        sims = self.simulations
        if sims is not None and (not isinstance(sims, (int, np.integer)) or sims < 1):
            raise ValueError(f"simulations must be an int >= 1 or None, got {self.simulations!r}")
        if self.deadline_ms is not None and not (math.isfinite(self.deadline_ms) and self.deadline_ms > 0):
            raise ValueError(f"deadline_ms must be a finite number > 0 or None, got {self.deadline_ms!r}")
        if not isinstance(self.parallel_sims, (int, np.integer)) or not 1 <= self.parallel_sims <= 65536:
            raise ValueError(f"parallel_sims must be an int in 1..65536, got {self.parallel_sims!r}")
        if self.evaluator not in EVALUATORS:
            raise ValueError(f"evaluator must be one of {EVALUATORS}, got {self.evaluator!r}")
        for name in ("c_uct", "c_puct", "virtual_loss"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.max_nodes, (int, np.integer)) or self.max_nodes < 1:
            raise ValueError(f"max_nodes must be an int >= 1, got {self.max_nodes!r}")
        if not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        if self.evaluator == "value_model" and not self.game.value_model:
            raise ValueError(f"game {self.game.name} has no value model: search it with the rollout evaluator")


class EvaluationFailed(RuntimeError):
    """A leaf evaluator could not value a wave's leaves: its service failed,
    or could not answer by the search deadline. Backends undo that wave and
    go on from the tree they have (see the CPU reference's docstring)."""


@dataclass
class SearchResult:
    """The answer for one tree. Times are wall-clock ms for the whole batch,
    summed over waves (the same in every result of one call)."""

    action: int  # most-visited root action (ties: higher Q, then lower index)
    # Root statistics include what a reused tree held before this call.
    visit_counts: np.ndarray  # int64 [A]: root edge visits, 0 for illegal actions
    q_values: np.ndarray  # float32 [A]: mean value per root action, side to move's view; 0 where unvisited
    root_value: float  # mean backed-up value over the root's edges, side to move's view, in [-1, 1]; exact once proven
    principal_variation: list[int]  # most-visited path from the root, 0-based actions
    simulations: int  # simulations completed in this call
    max_depth: int  # longest selection path (edges from the root) in this call
    tree_nodes: int  # nodes in the tree after the search
    pool_exhausted: bool  # the node pool filled; later leaves were evaluated without being added
    deadline_reached: bool  # the deadline ended the search
    select_ms: float = 0.0
    expand_ms: float = 0.0
    evaluate_ms: float = 0.0
    backup_ms: float = 0.0
    tree_reused: bool = False  # a tree passed in was searched further (not replaced by a fresh one)
    model_simulations: int = 0  # of ``simulations``, those whose leaf the value model valued
    evaluation_failure: str = ""  # why the value model stopped valuing leaves in this call ("" if it did not)
    proven: int = 0  # the root's result proven by the solver (tree.PROVEN_*), 0 while unproven
    extras: dict = field(default_factory=dict)  # backend-specific figures (e.g. waves)


class SearchBackend(Protocol):
    """A tree-search implementation (CPU reference, CUDA kernels, ...)."""

    name: str

    def search(
        self,
        roots: "Positions",
        params: SearchParams,
        evaluator: LeafEvaluator | None = None,
        trees: "list[Tree | None] | None" = None,
        *,
        should_stop: "Callable[[], bool] | None" = None,
    ) -> "tuple[list[SearchResult], list[Tree]]":
        """Searches every root (none may be finished) and returns one result
        and one tree per root. ``trees[b]``, if given, must be rooted at
        ``roots[b]`` (see ``reroot``); it is searched further instead of a
        fresh tree.

        ``should_stop`` (keyword-only, optional) is a cheap, thread-safe check
        called between waves, after the first one: when it returns true the
        search ends there as if its budget were spent, and answers with what
        it has (``extras["stopped"] = True``). The search server passes "the
        RPC is no longer active", so a search whose caller cancelled or whose
        gRPC deadline passed stops and frees its thread and tree at once.
        Call it at most once per wave (it takes a lock in gRPC).

        Raises:
            ValueError: a finished root, a tree rooted elsewhere, or
                ``evaluator`` missing for ``value_model``.
        """
        ...

    def reroot(self, tree: "Tree", actions: list[int]) -> "Tree | None":
        """``tree`` re-rooted at the node reached by ``actions`` (0-based) from
        its root, or None if that node is not in the tree."""
        ...


def model_answer(values, priors, legal: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The rules both backends apply to a value model's answer for M leaves:
    values float32 [M], NaN as 0, clipped to [-1, 1]; priors float32 [M, A]
    masked to ``legal`` (bool [M, A]), negatives and non-finite as 0, and
    renormalised (uniform over the legal moves where nothing is left), or None.

    Raises:
        EvaluationFailed: values or priors of the wrong shape (the model cannot
            value these leaves: the search undoes the wave and goes on without it).
    """
    m, a = legal.shape
    values = np.asarray(values, np.float32).reshape(-1)
    if values.shape != (m,):
        raise EvaluationFailed(f"the value model returned {values.shape} values for {m} leaves")
    # Few whole-array operations, each in place where it can be: this runs once per wave on the host.
    values = np.where(np.isnan(values), np.float32(0), values)
    np.clip(values, -1.0, 1.0, out=values)
    if priors is None:
        return values, None
    priors = np.asarray(priors, np.float32)
    if priors.shape != (m, a):
        raise EvaluationFailed(f"the value model returned priors of shape {priors.shape}, expected {(m, a)}")
    p = np.where(legal & np.isfinite(priors), priors, np.float32(0))
    np.maximum(p, 0, out=p)
    total = p.sum(axis=1)
    empty = total <= 0
    if empty.any():  # nothing legal left: uniform over the legal moves (all zeros where none is)
        p[empty] = legal[empty]
        total[empty] = np.maximum(legal[empty].sum(axis=1), 1)
    p /= total[:, None]
    return values, p


# best_action's preference among a root's children by their known result (code - ILLEGAL): an
# immediate win (the child's side to move has lost: TERMINAL_LOSS) first, then a proven win
# (PROVEN_LOSS), then any child not proven lost for us (not PROVEN_WIN), then a proven loss; a
# move that lets the opponent win at once (proven or not yet) comes last, so that a lost position
# resists as long as it can instead of playing an unsearched blunder.
_CHOICE_TIER = np.full(tr.PROVEN_DRAW - tr.ILLEGAL + 1, 2, np.int64)
_CHOICE_TIER[[tr.TERMINAL_LOSS - tr.ILLEGAL, tr.PROVEN_LOSS - tr.ILLEGAL, tr.PROVEN_WIN - tr.ILLEGAL]] = 4, 3, 1
_LOSES_AT_ONCE_TIER = 0


def best_action(visits: np.ndarray, q: np.ndarray, legal: np.ndarray | None = None,
                child_codes: np.ndarray | None = None, priors: np.ndarray | None = None,
                loses_at_once: np.ndarray | None = None) -> np.ndarray:
    """int64 [B]: the move to play, per row of [B, A]: the most visits, then
    the higher Q, then the lower index, among the candidates. Candidates are
    the ``legal`` actions (bool [B, A]; None: all); with the children's known
    results (``child_codes`` int8 [B, A], ``Tree.node_terminal`` codes) only
    the winning ones if any (an immediate win first), else those not proven
    lost, else the proven losses that do not lose at once (``loses_at_once``
    bool [B, A], the game's rules: the opponent wins with its next move; such
    a move is a last resort even when the search has not proven it, since a
    move visited once or twice is not yet proven). In a lost position this
    plays the most searched of the moves that hold longest, as a solver's
    longest-resistance choice would, not an unsearched blunder.
    Both backends choose with this, so they agree. A row with no visits
    at all (answered before its first wave, e.g. a first search cut by a
    deadline shorter than its start-up) plays its policy: the highest of
    ``priors`` (float32 [B, A], the root's; None: the lowest candidate), as a
    zero-visit AlphaZero player plays its policy head's move."""
    cand = np.ones(visits.shape, bool) if legal is None else legal.astype(bool)
    if child_codes is not None:  # the candidates of the best tier present (one pass, no loop over the tiers)
        tier = _CHOICE_TIER[child_codes.astype(np.int64) - tr.ILLEGAL]
        if loses_at_once is not None:
            tier = np.where(loses_at_once & (tier <= _CHOICE_TIER[tr.NOT_TERMINAL - tr.ILLEGAL]),
                            _LOSES_AT_ONCE_TIER, tier)
        tier = np.where(cand, tier, -1)
        cand &= tier == tier.max(axis=1, keepdims=True)
    visits = np.where(cand, visits, -1)
    most = visits.max(axis=1, keepdims=True)
    top = visits == most
    if priors is not None:  # unvisited rows: every candidate ties at 0 visits and Q, the prior decides
        q = np.where(most <= 0, priors, q)
    return np.argmax(np.where(top, q, -np.inf), axis=1)


def kept_trees(roots, trees: list, evaluator: str, convert=None, game: SearchGame = CONNECT_FOUR) -> dict:
    """The trees passed in to be searched further: {i: ``trees[i]``} (through
    ``convert``, e.g. an upload to the device) for each single tree built
    with ``evaluator`` in ``game`` (another evaluator's or game's is replaced by
    a fresh tree). ``roots``: B positions of ``game`` (or their states).

    Raises:
        ValueError: a tree holding several, or rooted elsewhere than ``roots[i]``.
    """
    kept = {}
    states = game.as_states(roots)
    for i, t in enumerate(trees):
        if t is None or t.evaluator != evaluator or getattr(t, "game", CONNECT_FOUR).name != game.name:
            continue
        if t.batch != 1:
            raise ValueError(f"trees[{i}] holds {t.batch} trees; pass single trees")
        t = convert(t) if convert is not None else t
        if not (game.as_states(t.root_positions())[0] == states[i]).all():
            raise ValueError(f"trees[{i}] is rooted at another position than roots[{i}]")
        kept[i] = t
    return kept


def check_call(roots, params: SearchParams, evaluator: LeafEvaluator | None, trees) -> list:
    """Checks one ``search()`` call's arguments, the same for every backend.
    ``roots``: B positions of ``params.game`` (or their states, uint64 [B, W]).

    Returns:
        ``trees`` as a list with one entry (a tree or None) per root.

    Raises:
        ValueError: the value-model evaluator without a leaf evaluator, no
            roots, a finished game among them, or a trees list of another length.
    """
    if params.evaluator == "value_model" and evaluator is None:
        raise ValueError("evaluator 'value_model' needs a leaf evaluator")
    b = len(params.game.as_states(roots))
    if b == 0:
        raise ValueError("no roots to search")
    finished = params.game.is_terminal(roots)
    if finished.any():
        raise ValueError(f"root {int(np.flatnonzero(finished)[0])} is a finished game")
    trees = list(trees) if trees is not None else [None] * b
    if len(trees) != b:
        raise ValueError(f"got {len(trees)} trees for {b} roots")
    return trees
