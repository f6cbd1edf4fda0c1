"""Search trees as a structure of arrays over a batch of B trees (mctx style).

Each tree owns a pool of ``capacity`` node slots; node 0 is the root and slots
``[0, num_nodes)`` are in use. A node is one position, held as its game's
``W = state_words`` uint64 words; its A = ``num_actions`` outgoing edges are
stored contiguously in row ``[b, node, :]`` of the edge arrays, so the
statistics read during selection (visits, value sum, virtual loss, prior) of
one node's children sit side by side. Edge statistics live on the edge, not
on the child node: an edge can be visited before (or without, once the pool
is full) its child node exists. The tree's game
(:class:`~search_service.mcts.games.SearchGame`) fixes A and W.

Memory per node slot (:func:`bytes_per_node`): ``8 W`` bytes of state, 10 of
the other node fields (11 where an action needs int16: A > 127), and A * 20
bytes of edge fields: 166 bytes for Connect Four (A = 7, W = 2; a
200,000-node pool is 33 MB per tree), 1,334 for Othello (A = 65, W = 3),
4,583 for Gomoku (A = 225, W = 9). The CPU reference allocates lazily (grows
the arrays, never past ``max_nodes``), so small searches stay small; the
limit on nodes is the same as a preallocated pool's.

Edge child codes and node result codes: :mod:`search_service.mcts.codes`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from search_service.games import connect4
from search_service.mcts.codes import (  # re-exported: tree.NOT_TERMINAL etc.
    ILLEGAL,
    LOST,
    NOT_TERMINAL,
    OUTCOME_VALUE,
    PROVEN_DRAW,
    PROVEN_LOSS,
    PROVEN_WIN,
    TERMINAL_DRAW,
    TERMINAL_LOSS,
    UNEXPANDED,
)
from search_service.mcts.codes import connect4_terminal_code as terminal_code  # Connect Four's
from search_service.mcts.games import CONNECT_FOUR, SearchGame

__all__ = [
    "BYTES_PER_NODE", "ILLEGAL", "LOST", "NOT_TERMINAL", "OUTCOME_VALUE", "PROVEN_DRAW", "PROVEN_LOSS", "PROVEN_WIN",
    "TERMINAL_DRAW", "TERMINAL_LOSS", "UNEXPANDED", "Tree", "bytes_per_node", "edges", "find_node", "gather", "grow",
    "init_edges", "new_trees", "reroot", "reroot_to", "set_roots", "solve", "split", "take", "terminal_code",
]


def bytes_per_node(game: SearchGame) -> int:
    """Bytes one node slot of ``game``'s trees holds (state, node fields, A edges)."""
    action = np.dtype(game.action_dtype).itemsize
    return 8 * game.state_words + 1 + 4 + 4 + action + game.num_actions * (4 + 4 + 4 + 4 + 4)


BYTES_PER_NODE = bytes_per_node(CONNECT_FOUR)  # Connect Four's: 166


@dataclass
class Tree:
    """B trees of one game; every array's first axis is the tree, the second
    the node slot (N = capacity); A and W are the game's."""

    node_state: np.ndarray  # uint64 [B, N, W]: the node's position (its game's state words)
    # int8 [B, N]: the node's known result for its side to move (search_service/mcts/codes.py):
    # terminal (TERMINAL_LOSS, TERMINAL_DRAW), proven (PROVEN_WIN, PROVEN_LOSS, PROVEN_DRAW), else NOT_TERMINAL.
    node_terminal: np.ndarray
    node_visits: np.ndarray  # int32 [B, N]: simulations that passed through or ended at the node
    node_parent: np.ndarray  # int32 [B, N]: parent slot, -1 for the root
    node_action: np.ndarray  # int8 (int16 where A > 127) [B, N]: action from the parent, -1 for the root
    children: np.ndarray  # int32 [B, N, A]: child slot, UNEXPANDED or ILLEGAL
    edge_visits: np.ndarray  # int32 [B, N, A]: completed simulations through the edge
    edge_value: np.ndarray  # float32 [B, N, A]: sum of their values, for the player to move at the node
    edge_vloss: np.ndarray  # int32 [B, N, A]: simulations in flight through the edge (0 between searches)
    prior: np.ndarray  # float32 [B, N, A]: policy prior (uniform over legal moves without a model)
    num_nodes: np.ndarray  # int32 [B]: slots in use
    evaluator: str = "rollout"  # what valued the leaves; a tree is only reused with the same evaluator
    game: SearchGame = CONNECT_FOUR  # whose positions the nodes hold; a tree is only reused in its game

    @property
    def batch(self) -> int:
        return int(self.num_nodes.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.node_visits.shape[1])

    @property
    def node_current(self) -> np.ndarray:
        """uint64 [B, N]: state word 0 (Connect Four: the side to move's stones; a view)."""
        return self.node_state[..., 0]

    @property
    def node_mask(self) -> np.ndarray:
        """uint64 [B, N]: state word 1 (Connect Four: the occupied cells; a view)."""
        return self.node_state[..., 1]

    def root_states(self) -> np.ndarray:
        """uint64 [B, W]: the B root positions' state words."""
        return self.node_state[:, 0].copy()

    def root_positions(self):
        """The B root positions, as the game's position batch."""
        return self.game.positions(self.root_states())


def _zeros(batch: int, capacity: int, evaluator: str, game: SearchGame) -> Tree:
    # All zeros, so the pages of unused slots are never touched (calloc); a
    # slot's fields are written when its node is created.
    a = game.num_actions
    return Tree(
        node_state=np.zeros((batch, capacity, game.state_words), np.uint64),
        node_terminal=np.zeros((batch, capacity), np.int8),
        node_visits=np.zeros((batch, capacity), np.int32),
        node_parent=np.zeros((batch, capacity), np.int32),
        node_action=np.zeros((batch, capacity), game.action_dtype),
        children=np.zeros((batch, capacity, a), np.int32),
        edge_visits=np.zeros((batch, capacity, a), np.int32),
        edge_value=np.zeros((batch, capacity, a), np.float32),
        edge_vloss=np.zeros((batch, capacity, a), np.int32),
        prior=np.zeros((batch, capacity, a), np.float32),
        num_nodes=np.zeros(batch, np.int32),
        evaluator=evaluator,
        game=game,
    )


_NODE_FIELDS = ("node_state", "node_terminal", "node_visits", "node_parent", "node_action")
_EDGE_FIELDS = ("children", "edge_visits", "edge_value", "edge_vloss", "prior")


def solve(children: np.ndarray, child_codes: np.ndarray) -> np.ndarray:
    """int8 [M]: what the solver proves of M nodes from their children (the
    negamax of known results): PROVEN_WIN if a child's side to move has lost,
    else, once every legal child's result is known, the best of them for the
    node (PROVEN_WIN, PROVEN_DRAW or PROVEN_LOSS); NOT_TERMINAL otherwise.

    Args:
        children: int32 [M, A]: child slots, UNEXPANDED or ILLEGAL.
        child_codes: int8 [M, A]: each child's ``node_terminal`` code
            (NOT_TERMINAL where there is no child).
    """
    legal = children != ILLEGAL
    known = legal & (children >= 0) & (child_codes != NOT_TERMINAL)
    wins = (known & np.isin(child_codes, LOST)).any(axis=1)
    best = np.where(known, -OUTCOME_VALUE[child_codes], -np.inf).max(axis=1)
    settled = (known == legal).all(axis=1) & legal.any(axis=1)
    by_best = np.where(best > 0, PROVEN_WIN, np.where(best < 0, PROVEN_LOSS, PROVEN_DRAW))
    return np.where(wins, PROVEN_WIN, np.where(settled, by_best, NOT_TERMINAL)).astype(np.int8)


def edges(legal: np.ndarray, terminal: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(children int32 [M, A], prior float32 [M, A]) for fresh nodes whose
    legal actions are ``legal`` (bool [M, A]) and known results ``terminal``
    (int8 [M]): UNEXPANDED legal moves with a uniform prior; ILLEGAL (prior 0)
    elsewhere and everywhere in finished or proven positions."""
    legal = legal & (terminal == NOT_TERMINAL)[:, None]
    children = np.where(legal, UNEXPANDED, ILLEGAL).astype(np.int32)
    prior = legal / np.maximum(legal.sum(axis=1, keepdims=True), 1)
    return children, prior.astype(np.float32)


def init_edges(mask: np.ndarray, terminal: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`edges` of fresh Connect Four nodes of occupied cells ``mask`` (uint64 [M])."""
    return edges(connect4.legal_bits(mask), terminal)


def new_trees(roots, capacity: int, evaluator: str = "rollout", game: SearchGame = CONNECT_FOUR) -> Tree:
    """Fresh trees of ``game`` holding only their root (``roots``: B positions
    of the game, or their states uint64 [B, W]), with pools of ``capacity``
    slots (>= 1)."""
    states = game.as_states(roots)
    tree = _zeros(states.shape[0], max(int(capacity), 1), evaluator, game)
    set_roots(tree, np.arange(states.shape[0]), states)
    return tree


def set_roots(tree: Tree, index: np.ndarray, roots) -> None:
    """Resets trees ``index`` (int [M]) to just their root ``roots`` (M
    positions of the tree's game, or their states uint64 [M, W])."""
    game = tree.game
    states = game.as_states(roots).astype(np.uint64)
    terminal = game.terminal_code(states)
    children, prior = edges(game.legal(states), terminal)
    tree.node_state[index, 0] = states
    tree.node_terminal[index, 0] = terminal
    tree.node_visits[index, 0] = 0
    tree.node_parent[index, 0] = -1
    tree.node_action[index, 0] = -1
    tree.children[index, 0] = children
    tree.prior[index, 0] = prior
    for name in ("edge_visits", "edge_value", "edge_vloss"):
        getattr(tree, name)[index, 0] = 0
    tree.num_nodes[index] = 1


def grow(tree: Tree, capacity: int) -> Tree:
    """A copy of ``tree`` with pools of ``capacity`` slots (>= the current one)."""
    if capacity <= tree.capacity:
        return tree
    bigger = _zeros(tree.batch, capacity, tree.evaluator, tree.game)
    used = int(tree.num_nodes.max())
    for name in _NODE_FIELDS + _EDGE_FIELDS:
        getattr(bigger, name)[:, :used] = getattr(tree, name)[:, :used]
    bigger.num_nodes[:] = tree.num_nodes
    return bigger


def take(tree: Tree, index: np.ndarray) -> Tree:
    """The trees ``index`` (int [M] or bool [B]) of ``tree``, as one batch (copies)."""
    return replace(tree, **{name: getattr(tree, name)[index] for name in _NODE_FIELDS + _EDGE_FIELDS + ("num_nodes",)})


def split(tree: Tree) -> list[Tree]:
    """The B trees as batches of one (views: no copy)."""
    return [
        replace(tree, **{name: getattr(tree, name)[b : b + 1] for name in _NODE_FIELDS + _EDGE_FIELDS + ("num_nodes",)})
        for b in range(tree.batch)
    ]


def gather(trees: list[Tree], capacity: int, game: SearchGame | None = None) -> Tree:
    """One batch holding copies of single trees (each of batch 1, all of one
    game), with pools of ``capacity`` slots (at least the largest tree's node
    count); ``game``: the batch's where ``trees`` is empty (None: the first
    tree's, else Connect Four)."""
    used = [int(t.num_nodes[0]) for t in trees]
    game = game or (trees[0].game if trees else CONNECT_FOUR)
    out = _zeros(len(trees), max([capacity, *used]), trees[0].evaluator if trees else "rollout", game)
    for b, (t, n) in enumerate(zip(trees, used)):
        for name in _NODE_FIELDS + _EDGE_FIELDS:
            getattr(out, name)[b, :n] = getattr(t, name)[0, :n]
        out.num_nodes[b] = n
    return out


def find_node(tree: Tree, actions: list[int]) -> int | None:
    """The slot reached from the root of a single tree by ``actions`` (0-based), or None."""
    _check_single(tree)
    node = 0
    for a in actions:
        if not 0 <= int(a) < tree.game.num_actions:
            return None
        child = int(tree.children[0, node, int(a)])
        if child < 0:
            return None
        node = child
    return node


def reroot(tree: Tree, actions: list[int]) -> Tree | None:
    """A single tree re-rooted at the node that ``actions`` (0-based, played
    from the current root) reach, or None if that node is not in the tree.

    The promoted node keeps its statistics and subtree (renumbered
    breadth-first, root = slot 0); everything else is dropped, freeing its
    slots. ``actions == []`` returns ``tree`` itself. The input is not modified.

    Raises:
        ValueError: ``tree`` holds more than one tree.
    """
    node = find_node(tree, actions)
    if node is None:
        return None
    if node == 0:
        return tree
    return _compact(tree, node)


def reroot_to(tree: Tree, position) -> Tree | None:
    """A single tree re-rooted at a node holding ``position`` (a batch of one
    position of the tree's game, or its states uint64 [1, W]), or None if none
    does. Any node with that position will do: the subtree below a
    position does not depend on the path to it (transpositions are separate
    nodes; the lowest slot is taken)."""
    _check_single(tree)
    n = int(tree.num_nodes[0])
    state = tree.game.as_states(position)[0]
    hit = np.flatnonzero((tree.node_state[0, :n] == state).all(axis=1))
    if hit.size == 0:
        return None
    node = int(hit[0])
    return tree if node == 0 else _compact(tree, node)


def _check_single(tree: Tree) -> None:
    if tree.batch != 1:
        raise ValueError(f"expected a single tree (batch of 1), got a batch of {tree.batch}")


def _compact(tree: Tree, node: int) -> Tree:
    # Breadth-first walk of the subtree, one level per step.
    levels, frontier = [np.array([node], np.int64)], np.array([node], np.int64)
    while frontier.size:
        kids = tree.children[0, frontier].reshape(-1)
        frontier = kids[kids >= 0].astype(np.int64)
        levels.append(frontier)
    order = np.concatenate(levels)
    remap = np.full(tree.capacity, -1, np.int64)
    remap[order] = np.arange(order.size)
    out = _zeros(1, tree.capacity, tree.evaluator, tree.game)
    n = order.size
    for name in _NODE_FIELDS + _EDGE_FIELDS:
        getattr(out, name)[0, :n] = getattr(tree, name)[0, order]
    kids = out.children[0, :n]
    out.children[0, :n] = np.where(kids >= 0, remap[np.maximum(kids, 0)], kids)
    parents = out.node_parent[0, :n]
    out.node_parent[0, :n] = np.where(parents >= 0, remap[np.maximum(parents, 0)], -1)
    out.node_parent[0, 0] = -1
    out.node_action[0, 0] = -1
    out.edge_vloss[0, :n] = 0
    out.num_nodes[0] = n
    return out
