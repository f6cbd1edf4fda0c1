"""The ABI between the host and the MCTS kernels: ONE table of the constants
the two share and of every record they exchange, field by field.

The kernels' header ``abi.h`` is generated from it (:func:`header`;
:func:`search_service.cuda.module.source` puts it ahead of ``kernels/*.cu``,
which define none of these names themselves), and the host reads and writes
the records through the NumPy structured dtypes built from the same table
(``LAYOUT.dtype``). So a field has one name, one offset and one place to
change it; ``tests/search/test_cuda_abi.py`` checks the table (no overlaps,
widths, the header) on a machine without a GPU.

A :class:`Layout` is a record of ``words`` words of one type (``word``: the
element type of the kernels' pointer to the records; a B-row array of them is
``[B][words]`` in C and a ``[B]`` structured array in NumPy). A field is
``count`` elements of ``dtype`` from word ``offset``; in C, field ``name`` of
layout ``PFX`` is ``PFX_NAME`` (its word offset, so row ``b``'s field is
``p[b * PFX_WORDS + PFX_NAME]``) and ``PFX_WORDS`` is the record's width. A
uint64 field in a layout of 32-bit words spans two words, the low one first
(the host and the device are both little-endian).

=======  ==================  ====================================================
layout   C array             written by -> read by
=======  ==================  ====================================================
EDGE     int4 rows[n][a]     the node pool: edge a < 7 of node n (pool.py)
HEAD     int4 rows[n][7]     the node pool: node n's header
POS      ulonglong2 pos[n]   the node pool: node n's position
INIT     u32 [B][16]         host -> init_trees: a tree's root and set-up
TS       int32 [B][8]        the search kernels' per-tree counters -> finish_trees
CYC      u64 [B][4]          the rollout kernels' phase cycles -> finish_trees
RES      int32 [B][72]       finish_trees -> host: a tree's result
META     int32 [B*K][4]      mcts_vm_select -> host, mcts_vm_backup_*
OBS      uint8 [B*K][84]     mcts_vm_select -> evaluator (device waves: backup)
EVAL     float [B*K][8]      host -> mcts_vm_backup_*: a leaf's value and priors
=======  ==================  ====================================================

The node pool (a region of ``cap * NODE_BYTES`` bytes per tree, ``rows``,
``child`` and ``pos`` back to back) is described in ``pool.py`` and
``kernels/common.cu``; its records and sizes are here. The kernels access
the pool's records as vector members (``.x .y .z .w`` = words 0..3), which
``static_assert``s in ``common.cu`` hold to this table.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from search_service.games import connect4
from search_service.mcts import tree as tr

I32, U32, F32, U64, U8 = (np.dtype(t) for t in (np.int32, np.uint32, np.float32, np.uint64, np.uint8))

# -- constants ------------------------------------------------------------------------------
NUM_ACTIONS = connect4.NUM_ACTIONS  # moves per position: the columns (7)
MAX_DEPTH = connect4.MAX_MOVES  # edges on a selection path: a game has at most 42 moves
CELLS = connect4.ROWS * connect4.COLUMNS  # cells of the board: one observation plane (42)
EXPANDING = -3  # transient child code, only inside a running search kernel
NO_SIMULATION = -1  # a META row's terminal when its tree's root was proven: no simulation ran in the slot
ROW = NUM_ACTIONS + 1  # 16-byte records per node row: 7 edges, then the header
HEADER = NUM_ACTIONS  # the header's record in a row
WARPS_PER_BLOCK = 4  # the search kernels run 128-thread blocks (their __launch_bounds__)
COLUMN_TABLE_BYTES = 128 * 8  # rollouts' kth-free-column table, uint8 [128 full-column codes][8]


# -- layouts -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """``count`` elements of ``dtype`` from word ``offset`` of a record."""

    name: str  # the structured dtype's field; in C, PREFIX_NAME (upper case) is ``offset``
    offset: int  # in words of the layout, from the record's start
    dtype: np.dtype
    count: int  # 1: a scalar (shape ()), else an array of shape (count,)
    doc: str  # what it holds, in which unit

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * self.count


@dataclass(frozen=True)
class Layout:
    """A record of ``words`` words of type ``word``, as named fields."""

    prefix: str  # the C macros' prefix
    word: np.dtype  # element type of the kernels' pointer to these records
    words: int  # record width, in words (padding included)
    doc: str  # the C array, who writes it and who reads it
    fields: tuple[Field, ...]

    @property
    def nbytes(self) -> int:
        """Bytes per record."""
        return self.words * self.word.itemsize

    @cached_property
    def dtype(self) -> np.dtype:
        """The NumPy structured dtype of one record (``nbytes`` long, padding
        included): an array of B records has the kernels' ``[B][words]`` bytes."""
        return np.dtype({
            "names": [f.name for f in self.fields],
            "formats": [f.dtype if f.count == 1 else (f.dtype, (f.count,)) for f in self.fields],
            "offsets": [f.offset * self.word.itemsize for f in self.fields],
            "itemsize": self.nbytes,
        })

    def macro(self, name: str) -> str:
        """The C name of field ``name`` (``WORDS``: of the width)."""
        return f"{self.prefix}_{name.upper()}"


INIT = Layout("INIT", U32, 16, "init u32 [B][16]: host -> init_trees, a tree's root and set-up", (
    Field("current", 0, U64, 1, "the root's side-to-move stones (Pons bitboard)"),
    Field("mask", 2, U64, 1, "the root's occupied cells"),
    Field("nodes", 4, U32, 1, "node slots in use: 1 (a fresh tree) or a kept tree's node count"),
    Field("fresh", 5, U32, 1, "1: write the root node; 0: the slots already hold a kept tree"),
    Field("root_visits", 6, U32, 1, "a fresh root's N: 1 after the model evaluated it (sqrt(N) > 0), else 0"),
    Field("has_priors", 7, U32, 1, "1: `priors` replace a fresh root's uniform prior"),
    Field("priors", 8, F32, NUM_ACTIONS, "the model's priors of the root's edges"),
))
TREE_STATE = Layout("TS", I32, 8, "tsa int32 [B][8]: a tree's search counters (common.cu: who updates how)", (
    Field("started", 0, I32, 1, "simulations claimed (atomicCAS, never past the budget)"),
    Field("done", 1, I32, 1, "simulations completed (atomicAdd at the end of a wave)"),
    Field("nodes", 2, I32, 1, "node slots claimed (atomicAdd; may pass cap: slots >= limit are refused)"),
    Field("exhausted", 3, I32, 1, "1 once a claim was refused (plain store of 1)"),
    Field("max_depth", 4, I32, 1, "longest selection path, in edges (atomicMax)"),
    Field("deadline", 5, I32, 1, "1 if the deadline stopped a warp of this tree (plain store of 1)"),
    Field("wave_base", 6, I32, 1, "value model: TS_NODES before the wave (init_trees, then each backup or undo)"),
))
CYCLES = Layout("CYC", U64, 4, "cyc u64 [B][4]: clock64 cycles per phase of a rollout search, over a tree's warps", (
    Field("select", 0, U64, 1, "selection"),
    Field("expand", 1, U64, 1, "leaf positions and node creation"),
    Field("evaluate", 2, U64, 1, "rollouts"),
    Field("backup", 3, U64, 1, "backup, up to the end of the wave"),
))
RESULT = Layout("RES", I32, 74, "res int32 [B][74]: finish_trees -> host, a tree's result", (
    Field("visits", 0, I32, NUM_ACTIONS, "the root edges' completed simulations"),
    Field("value_sum", 7, F32, NUM_ACTIONS, "the root edges' value sums, for the root's side to move"),
    Field("root_visits", 14, I32, 1, "the root's N"),
    Field("nodes", 15, I32, 1, "TS_NODES: node slots claimed (may pass the pool's limit)"),
    Field("max_depth", 16, I32, 1, "TS_MAX_DEPTH"),
    Field("done", 17, I32, 1, "TS_DONE: simulations completed"),
    Field("exhausted", 18, I32, 1, "TS_EXHAUSTED"),
    Field("deadline", 19, I32, 1, "TS_DEADLINE"),
    Field("pv_length", 20, I32, 1, "moves in the principal variation"),
    Field("pv", 21, I32, MAX_DEPTH, "the principal variation's actions, from the root (pv_length used)"),
    Field("cycles", 64, U64, len(CYCLES.fields), "the tree's CYC row: cycles per phase"),
    Field("outcome", 72, U8, 1 + NUM_ACTIONS,
          "known results (terminal or proven codes): [0] the root's, [1 + a] root child a's (NOT_TERMINAL: none)"),
))
META = Layout("META", I32, 4, "meta int32 [B*K][4]: mcts_vm_select -> host and mcts_vm_backup_*, per simulation", (
    Field("leaf", 0, I32, 1, "the leaf's slot, -1 where the pool refused it"),
    Field("depth", 1, I32, 1, "edges on the simulation's path"),
    Field("terminal", 2, I32, 1,
          "the leaf's known result (NOT_TERMINAL: the model evaluates it; NO_SIMULATION: the root is proven)"),
    Field("leader", 3, I32, 1, "the simulation that evaluates this leaf: the warp's lowest stopping at its edge"),
))
OBS = Layout("OBS", U8, 2 * CELLS, (
    "obs uint8 [B*K][84] = [2][6][7]: mcts_vm_select -> the evaluator (and mcts_vm_backup_*), a leaf's observation"), (
    Field("current", 0, U8, CELLS, "the side to move's stones, [row][col], row 0 at the bottom"),
    Field("opponent", CELLS, U8, CELLS, "the opponent's stones, likewise"),
))
EVAL = Layout("EVAL", F32, 8, "vin float [B*K][8]: host -> mcts_vm_backup_*, a simulation's leaf evaluation", (
    Field("value", 0, F32, 1, "the leaf's value for its side to move, in [-1, 1]"),
    Field("priors", 1, F32, NUM_ACTIONS, "a new node's priors (read from its evaluating simulation's row)"),
))

# The node pool's records (pool.py; kernels/common.cu: who writes them, how).
EDGE_RECORD = Layout("EDGE", I32, 4, "rows[n][a], a < NUM_ACTIONS: int4, edge a of node n", (
    Field("visits", 0, I32, 1, "completed simulations through the edge"),
    Field("vloss", 1, I32, 1, "simulations in flight through it (virtual loss); with visits one u64 for atomics"),
    Field("value_sum", 2, F32, 1, "sum of the backed-up values, for the player to move at n"),
    Field("prior", 3, F32, 1, "policy prior (uniform over legal moves without a model)"),
))
HEADER_RECORD = Layout("HEAD", I32, 4, "rows[n][HEADER]: int4, node n's header", (
    Field("visits", 0, I32, 1, "N: simulations that passed through or ended at n"),
    Field("terminal", 1, I32, 1, "known result: terminal code, or proven by the solver (plain store, once)"),
    Field("parent", 2, I32, 1, "parent slot, -1 for the root"),
    Field("action", 3, I32, 1, "action from the parent, -1 for the root"),
))
POSITION = Layout("POS", U64, 2, "pos[n]: ulonglong2, node n's position (Pons bitboards)", (
    Field("current", 0, U64, 1, "the side to move's stones"),
    Field("mask", 1, U64, 1, "occupied cells"),
))
# One node's row of records, 128 bytes: what selection reads in one cache line.
NODE_ROW = np.dtype([("edges", EDGE_RECORD.dtype, (NUM_ACTIONS,)), ("header", HEADER_RECORD.dtype)])
ROWS_BYTES = NODE_ROW.itemsize  # rows int4 [cap][ROW]: 128 bytes per node
CHILD_BYTES = ROW * I32.itemsize  # child int32 [cap][ROW] (7 used)
POS_BYTES = POSITION.nbytes  # pos u64 [cap][2]
NODE_BYTES = ROWS_BYTES + CHILD_BYTES + POS_BYTES  # 176 bytes per node slot

LAYOUTS = (EDGE_RECORD, HEADER_RECORD, POSITION, INIT, TREE_STATE, CYCLES, RESULT, META, OBS, EVAL)
PHASES = tuple(f.name for f in CYCLES.fields)  # RESULT's cycles, in order


# -- the header ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Constant:
    """A constant of both sides; in C, ``#define name value``."""

    name: str  # the C macro, also this module's attribute
    value: int
    doc: str


CONSTANTS = (
    Constant("NUM_ACTIONS", NUM_ACTIONS, "moves per position (the columns)"),
    Constant("MAX_DEPTH", MAX_DEPTH, "edges on a selection path (a game has 42 moves)"),
    Constant("CELLS", CELLS, "cells of the board: one observation plane, [row][col]"),
    Constant("UNEXPANDED", tr.UNEXPANDED, "child code: a legal move without a node"),
    Constant("ILLEGAL", tr.ILLEGAL, "child code: a move that may not be played"),
    Constant("EXPANDING", EXPANDING, "child code, transient: a warp is creating the node"),
    Constant("NOT_TERMINAL", tr.NOT_TERMINAL, "terminal code: the game goes on"),
    Constant("TERMINAL_LOSS", tr.TERMINAL_LOSS, "terminal code: the side to move lost"),
    Constant("TERMINAL_DRAW", tr.TERMINAL_DRAW, "terminal code: a full board"),
    Constant("PROVEN_WIN", tr.PROVEN_WIN, "proven by the solver: the side to move wins"),
    Constant("PROVEN_LOSS", tr.PROVEN_LOSS, "proven by the solver: the side to move loses"),
    Constant("PROVEN_DRAW", tr.PROVEN_DRAW, "proven by the solver: a draw"),
    Constant("NO_SIMULATION", NO_SIMULATION, "META terminal: the slot ran no simulation (its tree's root is proven)"),
    Constant("ROW", ROW, "16-byte records per node row: 7 edges + header"),
    Constant("HEADER", HEADER, "the header's record in a node row"),
    Constant("ROWS_BYTES", ROWS_BYTES, "bytes per node of rows (int4 [cap][ROW])"),
    Constant("CHILD_BYTES", CHILD_BYTES, "bytes per node of child (int32 [cap][ROW])"),
    Constant("POS_BYTES", POS_BYTES, "bytes per node of pos (u64 [cap][2])"),
    Constant("NODE_BYTES", NODE_BYTES, "bytes per node slot: rows + child + pos"),
    Constant("WARPS_PER_BLOCK", WARPS_PER_BLOCK, "warps per block of the search kernels"),
    Constant("COLUMN_TABLE_BYTES", COLUMN_TABLE_BYTES, "the rollouts' kth-free-column table in shared memory"),
)


def header() -> str:
    """The kernels' header ``abi.h``: ``#define``s of every constant and
    layout field above, each with its doc (deterministic text)."""
    return render([
        "// abi.h -- GENERATED from search_service/cuda/abi.py (module.source() puts",
        "// it ahead of the kernels): the constants and records the host and the",
        "// kernels share. Change the table there, never this text. Record fields",
        "// are word offsets: row b's field F of layout P is p[b * P_WORDS + P_F].",
    ], CONSTANTS, LAYOUTS)


def render(intro: list[str], constants, layouts) -> str:
    """A header's text: the ``intro`` comment lines, then ``#define``s of
    ``constants`` and of every field of ``layouts`` (deterministic text)."""
    lines = [*intro, "", "// Constants"]
    lines += [_define(c.name, c.value, c.doc) for c in constants]
    for layout in layouts:
        lines += ["", f"// {layout.prefix}: {layout.doc}"]
        for f in layout.fields:
            kind = f.dtype.name + (f" [{f.count}]" if f.count > 1 else "")
            if f.dtype.itemsize > layout.word.itemsize:  # e.g. a u64 in 32-bit words: low word first
                kind += f", {f.nbytes // layout.word.itemsize} words"
            lines.append(_define(layout.macro(f.name), f.offset, f"{kind}: {f.doc}"))
        lines.append(_define(layout.macro("words"), layout.words, f"{layout.word.name} words per record"))
    return "\n".join(lines) + "\n"


def _define(name: str, value: int, doc: str) -> str:
    text = f"#define {name} {value if value >= 0 else f'({value})'}"
    return f"{text:<32}// {doc}"


def carve(buffer, *sizes: int) -> list:
    """Consecutive byte slices of ``buffer`` (a flat uint8 NumPy or CuPy
    array of exactly ``sum(sizes)`` bytes), one per size, in order: several
    arrays in one allocation. Every slice starts 8-byte aligned (relative to
    the buffer), so it can be viewed as any word type.

    Raises:
        ValueError: ``buffer`` is not ``sum(sizes)`` bytes, or a slice would start unaligned.
    """
    if buffer.nbytes != sum(sizes) or buffer.itemsize != 1:
        raise ValueError(f"expected {sum(sizes)} bytes of uint8, got {buffer.nbytes} bytes of {buffer.dtype}")
    out, at = [], 0
    for size in sizes:
        if at % 8:
            raise ValueError(f"a slice would start at byte {at}, not a multiple of 8")
        out.append(buffer[at : at + size])
        at += size
    return out
