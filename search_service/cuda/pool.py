"""Search trees in device memory: the node-pool layout, :class:`CudaTree`, and
tree reuse (re-rooting by device-side compaction).

Layout (the records and sizes are :mod:`.abi`'s; who writes which field, and
how, is in ``kernels/common.cu``): a tree of ``cap`` node slots is one region
of ``cap * NODE_BYTES`` bytes, three arrays back to back:

=======  =====================  ===========  ======================================
array    dtype, shape           bytes/node   contents
=======  =====================  ===========  ======================================
rows     abi.NODE_ROW [cap]     128          ``edges``: 7 EDGE_RECORDs (visits,
                                             vloss, value_sum f32, prior f32);
                                             ``header``: a HEADER_RECORD (N,
                                             terminal, parent, action)
child    int32 [cap, 8]         32           child slot, UNEXPANDED or ILLEGAL (7 used)
pos      abi.POSITION [cap]     16           (current, mask) bitboards, uint64
=======  =====================  ===========  ======================================

**176 bytes per node** (the NumPy tree: 166). Each node's selection record
is one 128-byte cache line (its 7 edges' 16-byte records and its header), so
a selection step reads one line plus one 32-byte sector of child slots.
The trees of a batch share one allocation, its slab (``[S, cap * 176]``
bytes, tree_batch.py); a tree that leaves it is a compact copy of its own.

Re-rooting is a device-side compaction (``kernels/reroot.cu``): one block
walks the played moves and numbers the kept subtree breadth-first, one
thread per node copies it into a fresh region, so the new root is slot 0,
freed slots are reclaimed and the numbering equals :func:`tree.reroot`'s.
"""
from __future__ import annotations

import cupy
import numpy as np

from search_service.cuda import abi
from search_service.cuda.abi import CHILD_BYTES, NODE_BYTES, POS_BYTES, ROW, ROWS_BYTES
from search_service.cuda.module import kernel
from search_service.games import connect4
from search_service.games.connect4 import Positions
from search_service.mcts import tree as tr

MAX_CAPACITY = 1 << 27  # node slots per tree: node * 8 + action must fit an int32


def offsets(cap: int) -> tuple[int, int, int]:
    """Byte offsets of rows, child and pos inside a region of ``cap`` slots."""
    return 0, cap * ROWS_BYTES, cap * (ROWS_BYTES + CHILD_BYTES)


class CudaTree:
    """One search tree in device memory (the CUDA backend's ``Tree``).

    Its pool is row ``index`` of ``pool`` (uint8 [n, capacity * 176], a CuPy
    array that several trees may share); slots ``[0, num_nodes)`` are in
    use, slot 0 is the root. The root position and the evaluator are kept on
    the host so a tree can be checked and re-rooted without reading the device.
    """

    __slots__ = ("pool", "index", "capacity", "num_nodes", "root_current", "root_mask", "evaluator")

    def __init__(self, pool: cupy.ndarray, index: int, capacity: int, num_nodes: int, root_current: int,
                 root_mask: int, evaluator: str = "rollout"):
        self.pool = pool
        self.index = index
        self.capacity = capacity
        self.num_nodes = num_nodes
        self.root_current = root_current
        self.root_mask = root_mask
        self.evaluator = evaluator

    def __repr__(self) -> str:
        return (f"CudaTree(capacity={self.capacity}, num_nodes={self.num_nodes}, root_current={self.root_current}, "
                f"root_mask={self.root_mask}, evaluator={self.evaluator!r})")

    @property
    def buffer(self) -> cupy.ndarray:
        """uint8 [capacity * 176]: this tree's region (a view)."""
        return self.pool[self.index]

    @property
    def ptr(self) -> int:
        """Device address of this tree's region."""
        return self.pool.data.ptr + self.index * self.capacity * NODE_BYTES

    @property
    def batch(self) -> int:
        return 1

    @property
    def nbytes(self) -> int:
        """Device bytes of the pool (capacity * 176)."""
        return self.capacity * NODE_BYTES

    def root_positions(self) -> Positions:
        """The root position (batch of 1)."""
        mask = np.array([self.root_mask], np.uint64)
        return Positions(np.array([self.root_current], np.uint64), mask, connect4.popcount(mask))

    def to_host(self) -> tr.Tree:
        """A NumPy :class:`~search_service.mcts.tree.Tree` (batch of 1) with
        the same slots and fields; slots past ``num_nodes`` are zero, as in
        the CPU reference's trees. Copies the pool to the host (synchronises)."""
        cap, n = self.capacity, self.num_nodes
        raw = cupy.asnumpy(self.buffer[: cap * NODE_BYTES])
        o_rows, o_child, o_pos = offsets(cap)
        rows = raw[o_rows:o_child].view(abi.NODE_ROW).copy()  # [cap]
        child = raw[o_child:o_pos].view(np.int32).reshape(cap, ROW).copy()
        pos = raw[o_pos:].view(abi.POSITION.dtype).copy()  # [cap]
        rows[n:] = 0
        child[n:] = 0
        pos[n:] = 0
        edges, head = rows["edges"][None], rows["header"][None]  # [1, cap, 7], [1, cap]
        return tr.Tree(
            node_state=np.stack([pos["current"], pos["mask"]], axis=-1)[None],  # Connect Four's [current, mask]
            node_terminal=head["terminal"].astype(np.int8),
            node_visits=head["visits"].copy(),
            node_parent=head["parent"].copy(),
            node_action=head["action"].astype(np.int8),
            children=child[None, :, : connect4.NUM_ACTIONS].copy(),
            edge_visits=edges["visits"].copy(),
            edge_value=edges["value_sum"].copy(),
            edge_vloss=edges["vloss"].copy(),
            prior=edges["prior"].copy(),
            num_nodes=np.array([n], np.int32),
            evaluator=self.evaluator,
        )

    @classmethod
    def from_host(cls, tree: tr.Tree) -> "CudaTree":
        """Uploads a single NumPy tree (same slots; capacity = its node count).

        Raises:
            ValueError: ``tree`` holds more than one tree.
        """
        if tree.batch != 1:
            raise ValueError(f"expected a single tree (batch of 1), got a batch of {tree.batch}")
        n = int(tree.num_nodes[0])
        rows = np.zeros(n, abi.NODE_ROW)
        edges, head = rows["edges"], rows["header"]  # views: [n, 7], [n]
        edges["visits"] = tree.edge_visits[0, :n]
        edges["vloss"] = tree.edge_vloss[0, :n]
        edges["value_sum"] = tree.edge_value[0, :n]
        edges["prior"] = tree.prior[0, :n]
        head["visits"] = tree.node_visits[0, :n]
        head["terminal"] = tree.node_terminal[0, :n]
        head["parent"] = tree.node_parent[0, :n]
        head["action"] = tree.node_action[0, :n]
        child = np.full((n, ROW), tr.ILLEGAL, np.int32)
        child[:, : connect4.NUM_ACTIONS] = tree.children[0, :n]
        pos = np.zeros(n, abi.POSITION.dtype)
        pos["current"] = tree.node_current[0, :n]
        pos["mask"] = tree.node_mask[0, :n]
        raw = np.concatenate([rows.view(np.uint8), child.view(np.uint8).ravel(), pos.view(np.uint8)])
        return cls(cupy.asarray(raw)[None], 0, n, n, int(tree.node_current[0, 0]), int(tree.node_mask[0, 0]),
                   tree.evaluator)


def as_cuda_tree(tree) -> CudaTree:
    """``tree`` itself if it is a :class:`CudaTree`, else a NumPy tree uploaded."""
    return tree if isinstance(tree, CudaTree) else CudaTree.from_host(tree)


def copy_into(dst: int, dst_cap: int, src: CudaTree) -> None:
    """Copies the used slots of ``src`` into the region at device address
    ``dst`` (dst_cap * 176 bytes, dst_cap >= src.num_nodes): three
    device-to-device copies on the current stream."""
    n = src.num_nodes
    stream = cupy.cuda.get_current_stream().ptr
    for (d_off, s_off), per_node in zip(
        zip(offsets(dst_cap), offsets(src.capacity)), (ROWS_BYTES, CHILD_BYTES, POS_BYTES)
    ):
        cupy.cuda.runtime.memcpyAsync(
            dst + d_off, src.ptr + s_off, n * per_node, cupy.cuda.runtime.memcpyDeviceToDevice, stream
        )


def reroot(tree, actions: list[int]) -> CudaTree | None:
    """``tree`` re-rooted at the node that ``actions`` (0-based, played from its
    root) reach, or None if that node is not in the tree; ``[]`` returns
    ``tree``. The result is a compacted copy (capacity = the old node count,
    slots renumbered breadth-first as :func:`tree.reroot` does, virtual losses
    cleared); the input is not modified. Costs two small kernels and one
    8-byte read back (to learn whether the node exists).

    Raises:
        ValueError: a NumPy ``tree`` holding more than one tree.
    """
    if not actions:
        return tree
    src = as_cuda_tree(tree)
    acts = [int(a) for a in actions]
    n_old = src.num_nodes
    scratch = cupy.empty(2 * n_old + 2 + len(acts), np.int32)
    order, remap = scratch[:n_old], scratch[n_old : 2 * n_old]
    out, acts_dev = scratch[2 * n_old : 2 * n_old + 2], scratch[2 * n_old + 2 :]
    acts_dev.set(np.asarray(acts, np.int32))
    kernel("reroot_bfs")(
        (1,), (1024,), (src.buffer, np.int64(src.capacity), acts_dev, np.int32(len(acts)), order, remap, out)
    )
    dst = cupy.empty((1, n_old * NODE_BYTES), np.uint8)
    kernel("reroot_copy")(
        ((n_old + 255) // 256,), (256,), (src.buffer, np.int64(src.capacity), dst, np.int64(n_old), order, remap, out)
    )
    n = int(out.get()[0])
    if n == 0:
        return None
    cur = np.array([src.root_current], np.uint64)
    mask = np.array([src.root_mask], np.uint64)
    for a in acts:
        cur, mask = connect4.play_bits(cur, mask, np.array([a]))
    return CudaTree(dst, 0, n_old, n, int(cur[0]), int(mask[0]), src.evaluator)
