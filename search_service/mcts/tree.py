"""Search trees as a structure of arrays over a batch of B trees (mctx style).

Each tree owns a pool of ``capacity`` node slots; node 0 is the root and slots
``[0, num_nodes)`` are in use. A node is one position; its A outgoing edges
are stored contiguously in row ``[b, node, :]`` of the edge arrays, so the
statistics read during selection (visits, value sum, virtual loss, prior) of
one node's children sit side by side. Edge statistics live on the edge, not
on the child node: an edge can be visited before (or without, once the pool
is full) its child node exists.

Memory per node slot, A = 7: 26 bytes of node fields + A * 20 bytes of edge
fields = 166 bytes (a 200,000-node pool is 33 MB per tree). The CPU reference
allocates lazily (grows the arrays, never past ``max_nodes``), so small
searches stay small; the limit on nodes is the same as a preallocated pool's.

Edge child codes: ``>= 0`` child node index, ``UNEXPANDED`` (-1) a legal move
whose child is not in the tree, ``ILLEGAL`` (-2) a move that may not be played.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from search_service.games import connect4
from search_service.games.connect4 import Positions

UNEXPANDED = -1
ILLEGAL = -2
NOT_TERMINAL, TERMINAL_LOSS, TERMINAL_DRAW = 0, 1, 2
# Results proven by the solver (MCTS-Solver, Winands, Bjornsson & Saito 2008,
# "Monte-Carlo Tree Search Solver"), for the side to move at the node: the
# node's value is known exactly, as at a terminal position.
PROVEN_WIN, PROVEN_LOSS, PROVEN_DRAW = 3, 4, 5
OUTCOME_VALUE = np.array([0.0, -1.0, 0.0, 1.0, -1.0, 0.0], np.float32)  # by code; the value of a known result
LOST = (TERMINAL_LOSS, PROVEN_LOSS)  # codes of a node whose side to move has lost
A = connect4.NUM_ACTIONS
BYTES_PER_NODE = 8 + 8 + 1 + 4 + 4 + 1 + A * (4 + 4 + 4 + 4 + 4)


@dataclass
class Tree:
    """B trees; every array's first axis is the tree, the second the node slot (N = capacity)."""

    node_current: np.ndarray  # uint64 [B, N]: side to move's stones (Pons bitboard)
    node_mask: np.ndarray  # uint64 [B, N]: occupied cells
    # int8 [B, N]: the node's known result for its side to move: terminal (TERMINAL_LOSS: lost,
    # TERMINAL_DRAW), proven by the solver (PROVEN_WIN, PROVEN_LOSS, PROVEN_DRAW), else NOT_TERMINAL.
    node_terminal: np.ndarray
    node_visits: np.ndarray  # int32 [B, N]: simulations that passed through or ended at the node
    node_parent: np.ndarray  # int32 [B, N]: parent slot, -1 for the root
    node_action: np.ndarray  # int8 [B, N]: action from the parent, -1 for the root
    children: np.ndarray  # int32 [B, N, A]: child slot, UNEXPANDED or ILLEGAL
    edge_visits: np.ndarray  # int32 [B, N, A]: completed simulations through the edge
    edge_value: np.ndarray  # float32 [B, N, A]: sum of their values, for the player to move at the node
    edge_vloss: np.ndarray  # int32 [B, N, A]: simulations in flight through the edge (0 between searches)
    prior: np.ndarray  # float32 [B, N, A]: policy prior (uniform over legal moves without a model)
    num_nodes: np.ndarray  # int32 [B]: slots in use
    evaluator: str = "rollout"  # what valued the leaves; a tree is only reused with the same evaluator

    @property
    def batch(self) -> int:
        return int(self.num_nodes.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.node_visits.shape[1])

    def root_positions(self) -> Positions:
        """The B root positions."""
        mask = self.node_mask[:, 0].copy()
        return Positions(self.node_current[:, 0].copy(), mask, connect4.popcount(mask))


def _zeros(batch: int, capacity: int, evaluator: str) -> Tree:
    # All zeros, so the pages of unused slots are never touched (calloc); a
    # slot's fields are written when its node is created.
    return Tree(
        node_current=np.zeros((batch, capacity), np.uint64),
        node_mask=np.zeros((batch, capacity), np.uint64),
        node_terminal=np.zeros((batch, capacity), np.int8),
        node_visits=np.zeros((batch, capacity), np.int32),
        node_parent=np.zeros((batch, capacity), np.int32),
        node_action=np.zeros((batch, capacity), np.int8),
        children=np.zeros((batch, capacity, A), np.int32),
        edge_visits=np.zeros((batch, capacity, A), np.int32),
        edge_value=np.zeros((batch, capacity, A), np.float32),
        edge_vloss=np.zeros((batch, capacity, A), np.int32),
        prior=np.zeros((batch, capacity, A), np.float32),
        num_nodes=np.zeros(batch, np.int32),
        evaluator=evaluator,
    )


_NODE_FIELDS = ("node_current", "node_mask", "node_terminal", "node_visits", "node_parent", "node_action")
_EDGE_FIELDS = ("children", "edge_visits", "edge_value", "edge_vloss", "prior")


def terminal_code(current: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """int8 [...]: NOT_TERMINAL, TERMINAL_LOSS or TERMINAL_DRAW for positions (current, mask)."""
    lost = connect4.has_four(current ^ mask)
    full = mask == connect4.BOARD_MASK
    return np.where(lost, TERMINAL_LOSS, np.where(full, TERMINAL_DRAW, NOT_TERMINAL)).astype(np.int8)


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


def init_edges(mask: np.ndarray, terminal: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(children int32 [M, A], prior float32 [M, A]) for fresh nodes: UNEXPANDED
    legal moves with a uniform prior; ILLEGAL (prior 0) elsewhere and everywhere
    in finished positions."""
    legal = connect4.legal_bits(mask) & (terminal == NOT_TERMINAL)[:, None]
    children = np.where(legal, UNEXPANDED, ILLEGAL).astype(np.int32)
    prior = legal / np.maximum(legal.sum(axis=1, keepdims=True), 1)
    return children, prior.astype(np.float32)


def new_trees(roots: Positions, capacity: int, evaluator: str = "rollout") -> Tree:
    """Fresh trees holding only their root, with pools of ``capacity`` slots (>= 1)."""
    tree = _zeros(len(roots), max(int(capacity), 1), evaluator)
    set_roots(tree, np.arange(len(roots)), roots)
    return tree


def set_roots(tree: Tree, index: np.ndarray, roots: Positions) -> None:
    """Resets trees ``index`` (int [M]) to just their root ``roots`` (M positions)."""
    current, mask = roots.current.astype(np.uint64), roots.mask.astype(np.uint64)
    terminal = terminal_code(current, mask)
    children, prior = init_edges(mask, terminal)
    tree.node_current[index, 0] = current
    tree.node_mask[index, 0] = mask
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
    bigger = _zeros(tree.batch, capacity, tree.evaluator)
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


def gather(trees: list[Tree], capacity: int) -> Tree:
    """One batch holding copies of single trees (each of batch 1), with pools of
    ``capacity`` slots (at least the largest tree's node count)."""
    used = [int(t.num_nodes[0]) for t in trees]
    out = _zeros(len(trees), max([capacity, *used]), trees[0].evaluator if trees else "rollout")
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
        if not 0 <= int(a) < A:
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


def reroot_to(tree: Tree, position: Positions) -> Tree | None:
    """A single tree re-rooted at a node holding ``position`` (batch of 1), or
    None if none does. Any node with that position will do: the subtree below a
    position does not depend on the path to it (transpositions are separate
    nodes; the lowest slot is taken)."""
    _check_single(tree)
    n = int(tree.num_nodes[0])
    hit = np.flatnonzero(
        (tree.node_current[0, :n] == position.current[0]) & (tree.node_mask[0, :n] == position.mask[0])
    )
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
    out = _zeros(1, tree.capacity, tree.evaluator)
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
