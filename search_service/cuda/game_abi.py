"""The ABI of a game folder's kernels: the header ``game.h`` that tandem
generates from the folder's ``game.yaml``, and the records the host reads
and writes, sized by the game (issue 42's device half; decision 0010).

Connect Four keeps its own table (:mod:`.abi`: 7 edges, the 128-byte node).
A game folder's module (:mod:`.game_module`) is the same kernels compiled
against this header instead, with ``kernels/wide.cu`` between the folder's
``rules.cu`` and the search, so every size below is a compile-time constant
of that module (one module per game).

Node layout of a game folder (``A = num_actions``, ``W = state_words``,
``ROW = A + 1`` rounded up to a multiple of 4): per node slot, back to back
per tree as Connect Four's (``kernels/common.cu``),

=======  ====================  ===========================================
rows     int4 [cap][ROW]        edges 0..A-1 (visits, vloss, value_sum,
                                prior), the header at A, padding
child    int32 [cap][ROW]       child slot per edge (A used)
pos      u64 [cap][W]           the node's state words
=======  ====================  ===========================================

so ``NODE_BYTES = 20 * ROW + 8 * W``: Othello (A 65, W 3) 1384 bytes,
Gomoku (A 225, W 9) 4632 bytes. Dense per-node edge arrays (the layout of
mctx): a node holds every action's edge, legal or not, which keeps the
edge of action ``a`` at a fixed address (no search of a sparse list in the
selection) at the cost of memory for illegal actions.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


from search_service.cuda import abi
from search_service.cuda.abi import I32, U32, U64, U8, Constant, Field, Layout
from search_service.games.metadata import GameError, GameMeta
from search_service.mcts import tree as tr

MAX_DEVICE_ACTIONS = 1024  # the kernels' limit: a lane keeps ceil(A / 32) edges in registers while it selects


def _round4(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True)
class GameAbi:
    """The constants and records of one game folder's module."""

    name: str
    num_actions: int  # A
    state_words: int  # W
    max_moves: int  # a selection path's longest, and a rollout's
    observation: tuple[int, int, int]

    @classmethod
    def of(cls, meta: GameMeta) -> "GameAbi":
        """The ABI of a loaded game's metadata.

        Raises:
            GameError: more actions than the kernels take (MAX_DEVICE_ACTIONS).
        """
        if meta.num_actions > MAX_DEVICE_ACTIONS:
            raise GameError(meta.label, f"num_actions {meta.num_actions} is over the CUDA kernels' limit of "
                                        f"{MAX_DEVICE_ACTIONS} (the CPU reference searches it)")
        return cls(meta.name, meta.num_actions, meta.state_words, meta.max_moves, tuple(meta.observation))

    @property
    def row(self) -> int:
        """16-byte records per node row: A edges, the header, padding to 4."""
        return _round4(self.num_actions + 1)

    @property
    def mask_words(self) -> int:
        """u32 words of a legal mask (bit a % 32 of word a // 32)."""
        return -(-self.num_actions // 32)

    @property
    def rows_bytes(self) -> int:
        return self.row * 16

    @property
    def child_bytes(self) -> int:
        return self.row * 4

    @property
    def pos_bytes(self) -> int:
        return self.state_words * 8

    @property
    def node_bytes(self) -> int:
        """Bytes per node slot: rows + child + pos."""
        return self.rows_bytes + self.child_bytes + self.pos_bytes

    @cached_property
    def position(self) -> Layout:
        return Layout("POS", U64, self.state_words, "pos[n]: u64 [STATE_WORDS], node n's state words", (
            Field("state", 0, U64, self.state_words, "the game's state words (rules.py's)"),))

    @cached_property
    def init(self) -> Layout:
        w = self.state_words
        return Layout("INIT", U32, 4 + 2 * w, "init u32 [B][INIT_WORDS]: host -> init_trees, a tree's root", (
            Field("nodes", 0, U32, 1, "node slots in use: 1 (a fresh tree)"),
            Field("fresh", 1, U32, 1, "1: write the root node"),
            Field("root_visits", 2, U32, 1, "a fresh root's N (0: rollouts)"),
            Field("state", 4, U64, w, "the root's state words, each (low, high) u32 words"),
        ))

    @cached_property
    def result(self) -> Layout:
        a, d = self.num_actions, self.max_moves
        pv = 2 * a + 7
        cycles = pv + d + ((pv + d) & 1)  # u64 words start 8-byte aligned
        outcome = cycles + 2 * len(abi.CYCLES.fields)
        return Layout("RES", I32, outcome + -(-(1 + a) // 4), "res int32 [B][RES_WORDS]: finish_trees -> host", (
            Field("visits", 0, I32, a, "the root edges' completed simulations"),
            Field("value_sum", a, abi.F32, a, "the root edges' value sums, for the root's side to move"),
            Field("root_visits", 2 * a, I32, 1, "the root's N"),
            Field("nodes", 2 * a + 1, I32, 1, "TS_NODES"),
            Field("max_depth", 2 * a + 2, I32, 1, "TS_MAX_DEPTH"),
            Field("done", 2 * a + 3, I32, 1, "TS_DONE"),
            Field("exhausted", 2 * a + 4, I32, 1, "TS_EXHAUSTED"),
            Field("deadline", 2 * a + 5, I32, 1, "TS_DEADLINE"),
            Field("pv_length", 2 * a + 6, I32, 1, "moves in the principal variation"),
            Field("pv", pv, I32, d, "the principal variation's actions, from the root"),
            Field("cycles", cycles, U64, len(abi.CYCLES.fields), "the tree's CYC row"),
            Field("outcome", outcome, U8, 1 + a, "known results: [0] the root's, [1 + a] root child a's"),
        ))

    @property
    def layouts(self) -> tuple[Layout, ...]:
        return (abi.EDGE_RECORD, abi.HEADER_RECORD, self.position, self.init, abi.TREE_STATE, abi.CYCLES,
                self.result, abi.META)

    @property
    def constants(self) -> tuple[Constant, ...]:
        planes, rows, columns = self.observation
        return (
            Constant("NUM_ACTIONS", self.num_actions, "actions 0 .. NUM_ACTIONS-1 (game.yaml num_actions)"),
            Constant("STATE_WORDS", self.state_words, "u64 words of a state (game.yaml state_words)"),
            Constant("MASK_WORDS", self.mask_words, "u32 words of a legal mask: bit a % 32 of word a / 32"),
            Constant("MAX_MOVES", self.max_moves, "no game lasts longer (game.yaml max_moves)"),
            Constant("MAX_DEPTH", self.max_moves, "edges on a selection path"),
            Constant("OBS_PLANES", planes, "observation planes (game.yaml observation)"),
            Constant("OBS_ROWS", rows, "observation rows"),
            Constant("OBS_COLUMNS", columns, "observation columns"),
            Constant("UNEXPANDED", tr.UNEXPANDED, "child code: a legal move without a node"),
            Constant("ILLEGAL", tr.ILLEGAL, "child code: a move that may not be played"),
            Constant("EXPANDING", abi.EXPANDING, "child code, transient: a warp is creating the node"),
            Constant("NOT_TERMINAL", tr.NOT_TERMINAL, "terminal code: the game goes on"),
            Constant("TERMINAL_LOSS", tr.TERMINAL_LOSS, "terminal code: the side to move lost"),
            Constant("TERMINAL_DRAW", tr.TERMINAL_DRAW, "terminal code: a draw"),
            Constant("PROVEN_WIN", tr.PROVEN_WIN, "proven (or a finished game won by the side to move)"),
            Constant("PROVEN_LOSS", tr.PROVEN_LOSS, "proven by the solver: the side to move loses"),
            Constant("PROVEN_DRAW", tr.PROVEN_DRAW, "proven by the solver: a draw"),
            Constant("NO_SIMULATION", abi.NO_SIMULATION, "META terminal: no simulation ran"),
            Constant("ROW", self.row, "16-byte records per node row: edges, header, padding"),
            Constant("HEADER", self.num_actions, "the header's record in a node row"),
            Constant("ROWS_BYTES", self.rows_bytes, "bytes per node of rows (int4 [cap][ROW])"),
            Constant("CHILD_BYTES", self.child_bytes, "bytes per node of child (int32 [cap][ROW])"),
            Constant("POS_BYTES", self.pos_bytes, "bytes per node of pos (u64 [cap][STATE_WORDS])"),
            Constant("NODE_BYTES", self.node_bytes, "bytes per node slot: rows + child + pos"),
            Constant("WARPS_PER_BLOCK", abi.WARPS_PER_BLOCK, "warps per block of the search kernels"),
        )

    def header(self) -> str:
        """The module's header ``game.h`` (deterministic text)."""
        return abi.render([
            f"// game.h -- GENERATED by search_service/cuda/game_abi.py from game {self.name}'s",
            "// game.yaml: the constants and records its rules.cu and tandem's kernels",
            "// share. Record fields are word offsets: row b's field F of layout P is",
            "// p[b * P_WORDS + P_F].",
        ], self.constants, self.layouts)

    def smem_bytes(self, sims_per_warp: int) -> int:
        """Dynamic shared memory of a rollout search launch (search.cu:
        warp_scratch_ints per warp; no rollout tables)."""
        return abi.WARPS_PER_BLOCK * (sims_per_warp * self.max_moves + 64) * 4
