// connect4.cu -- Connect Four on Pons bitboards (bit = col * 7 + row, one
// sentinel bit per column), the device twin of search_service/games/connect4.py,
// and the random rollout of search_service/mcts/rollout.py.

#define C4_COLUMN_MASK(c) (0x3Full << (7 * (c)))
#define C4_BOTTOM(c) (1ull << (7 * (c)))
#define C4_TOP(c) (1ull << (7 * (c) + 5))
#define C4_BOARD_MASK 0x0FDFBF7EFDFBFull  // every playable cell (6 of each 7 bits)
#define C4_TOPS 0x0810204081020ull        // the top cell of each column (bits 5 + 7c)

// Four in a row on bitboard b, along the four directions (shifts 1, 7, 6, 8).
HD bool has_four(u64 b) {
  const u64 v = b & (b >> 1);
  const u64 h = b & (b >> 7);
  const u64 d1 = b & (b >> 6);
  const u64 d2 = b & (b >> 8);
  return ((v & (v >> 2)) | (h & (h >> 14)) | (d1 & (d1 >> 12)) | (d2 & (d2 >> 16))) != 0;
}

// NOT_TERMINAL, TERMINAL_LOSS (the side to move lost) or TERMINAL_DRAW.
HD int terminal_code(u64 current, u64 mask) {
  if (has_four(current ^ mask)) return TERMINAL_LOSS;
  return mask == C4_BOARD_MASK ? TERMINAL_DRAW : NOT_TERMINAL;
}

// Drops a stone of the side to move in column c (not full); swaps sides.
HD void play_column(u64& current, u64& mask, int c) {
  const u64 move = (mask + C4_BOTTOM(c)) & C4_COLUMN_MASK(c);
  current ^= mask;
  mask |= move;
}

// 7-bit code, bit c set where column c is full.
HD u32 full_columns(u64 mask) {
  u32 code = 0;
#pragma unroll
  for (int c = 0; c < NUM_ACTIONS; ++c) code |= (u32)((mask >> (7 * c + 5)) & 1ull) << c;
  return code;
}

// The k-th (0-based) column that is not full, counting from the left, for a
// 7-bit full-columns code; 0 when there is none (the table below caches it).
HD int kth_free_column(u32 full, u32 k) {
  for (int c = 0; c < NUM_ACTIONS; ++c) {
    if (!((full >> c) & 1u)) {
      if (k == 0) return c;
      --k;
    }
  }
  return 0;
}

// One random game from an unfinished position, for its side to move: +1 win,
// 0 draw, -1 loss. Move i uses word i % 4 of philox((s, t, i / 4, 0), key) and
// plays the (word % n)-th of the n free columns (counted from the left), as
// rollout.py does; `table[full * 8 + k]` is kth_free_column(full, k). The
// rollout ends at the first four in a row or a full board.
HD float rollout_value(u64 cur, u64 mask, u32 s, u32 t, u32 k0, u32 k1, const unsigned char* table) {
  u32 full = full_columns(mask);
  for (u32 blk = 0;; ++blk) {
    u32 w[4];
    philox4x32_10(s, t, blk, STREAM_ROLLOUT, k0, k1, w[0], w[1], w[2], w[3]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (full == 127u) return 0.0f;  // board full: a draw
      const u32 n = (u32)(NUM_ACTIONS - popc32(full));
      const int c = table[full * 8u + w[q] % n];
      const u64 move = (mask + C4_BOTTOM(c)) & C4_COLUMN_MASK(c);
      cur ^= mask;
      mask |= move;
      if (has_four(cur ^ mask)) return ((blk * 4u + (u32)q) & 1u) ? -1.0f : 1.0f;  // the mover of ply i won
      if (move & C4_TOPS) full |= 1u << c;
    }
  }
}

// -- Connect Four as a game module (the interface of docs/search.md, "Device
// rules"), specialised: the search kernels call the functions below, whose
// bodies are the bitboard code above, so the compiled search is the one it
// was before game modules existed (checked by comparing the PTX). --------------

#define GAME_VALUE_MODEL 1  // the value-model kernels (mcts_vm_*) and OBS rows are compiled in
#define GAME_WARP_INIT 0    // a node's 7 edges are written by one lane (init_node)
#define GAME_EIGHT_LANES 1  // a node row is 8 records, the header 8th: lane e % 8 owns record e (select.cu, finish_trees)
#define MASK_WORDS 1        // a legal mask is one u32 word (7 bits)
#define ROLLOUT_SMEM_BYTES COLUMN_TABLE_BYTES  // the rollouts' kth-free-column table

static_assert(POS_CURRENT == 0 && POS_MASK == 1 && POS_WORDS == 2, "position: ulonglong2 (current, mask)");
static_assert(ROW == 8 && NUM_ACTIONS == 7, "Connect Four: a node row is one 128-byte line");

// A position: the side to move's stones and the occupied cells (POS_*).
struct GameState {
  u64 cur;
  u64 mask;
};

// The rules interface (what a game folder's rules.cu defines), for the
// conformance playouts (playout.cu); the search uses the specialised paths.
HD void game_initial(GameState& s) {
  s.cur = 0;
  s.mask = 0;
}

HD bool game_is_terminal(const GameState& s) { return terminal_code(s.cur, s.mask) != NOT_TERMINAL; }

HD float game_returns(const GameState& s) { return terminal_code(s.cur, s.mask) == TERMINAL_LOSS ? -1.0f : 0.0f; }

HD void game_legal(const GameState& s, u32* legal) {
  legal[0] = game_is_terminal(s) ? 0u : (~full_columns(s.mask) & 127u);
}

HD bool game_step(GameState& s, int action, float& reward) {
  play_column(s.cur, s.mask, action);
  const int code = terminal_code(s.cur, s.mask);
  reward = code == TERMINAL_LOSS ? 1.0f : 0.0f;  // the side to move lost: the mover won
  return code != NOT_TERMINAL;
}

// -- what the search kernels call -------------------------------------------------
__device__ __forceinline__ GameState load_state(const TreeView& t, int node) {
  const ulonglong2 pp = __ldcg((const ulonglong2*)t.pos + node);
  GameState s;
  s.cur = pp.x;
  s.mask = pp.y;
  return s;
}

__device__ __forceinline__ void store_state(const TreeView& t, int node, const GameState& s) {
  ((ulonglong2*)t.pos)[node] = make_ulonglong2(s.cur, s.mask);
}

// Plays `action` (legal) and returns the new position's terminal code.
HD int play_code(GameState& s, int action) {
  play_column(s.cur, s.mask, action);
  return terminal_code(s.cur, s.mask);
}

HD int state_code(const GameState& s) { return terminal_code(s.cur, s.mask); }

// A tree's root position from its INIT row (the bitboards as (low, high) words).
__device__ __forceinline__ GameState init_state(const u32* in) {
  GameState s;
  s.cur = (u64)in[INIT_CURRENT] | ((u64)in[INIT_CURRENT + 1] << 32);
  s.mask = (u64)in[INIT_MASK] | ((u64)in[INIT_MASK + 1] << 32);
  return s;
}

// The block's rollout table in shared memory (ROLLOUT_SMEM_BYTES), before __syncthreads.
__device__ __forceinline__ void rollout_smem_init(unsigned char* table) {
  for (int i = threadIdx.x; i < COLUMN_TABLE_BYTES; i += blockDim.x) {
    table[i] = (unsigned char)kth_free_column(i >> 3, i & 7);
  }
}

__device__ __forceinline__ float game_rollout(const GameState& s, u32 sim, u32 tree, u32 k0, u32 k1,
                                              const unsigned char* table) {
  return rollout_value(s.cur, s.mask, sim, tree, k0, k1, table);
}

// Connect Four's node initialisation (expand.cu: expand_leaves). Writes a fresh node (no visits; uniform prior over legal moves, as
// tree.init_edges) into slot s. Called by one lane, before the node is
// published (atomicExch on its parent's child entry, after __threadfence).
__device__ void init_node(const TreeView& t, int s, const GameState& st, int term, int parent, int action) {
  int legal[NUM_ACTIONS];
  int n_legal = 0;
#pragma unroll
  for (int a = 0; a < NUM_ACTIONS; ++a) {
    legal[a] = term == NOT_TERMINAL && !(st.mask & C4_TOP(a));
    n_legal += legal[a];
  }
  const float prior = n_legal ? (float)(1.0 / (double)n_legal) : 0.0f;
  int4* row = t.rows + (long long)s * ROW;
#pragma unroll
  for (int a = 0; a < NUM_ACTIONS; ++a) row[a] = make_int4(0, 0, 0, legal[a] ? __float_as_int(prior) : 0);
  row[HEADER] = make_int4(0, term, parent, action);
  int4* ch = (int4*)(t.child + (long long)s * ROW);
  ch[0] = make_int4(legal[0] ? UNEXPANDED : ILLEGAL, legal[1] ? UNEXPANDED : ILLEGAL,
                    legal[2] ? UNEXPANDED : ILLEGAL, legal[3] ? UNEXPANDED : ILLEGAL);
  ch[1] = make_int4(legal[4] ? UNEXPANDED : ILLEGAL, legal[5] ? UNEXPANDED : ILLEGAL,
                    legal[6] ? UNEXPANDED : ILLEGAL, ILLEGAL);
  store_state(t, s, st);
}

// Node `n` of tree d gets node `old`'s position of tree s (reroot.cu).
__device__ __forceinline__ void copy_state(const TreeView& d, int n, const TreeView& s, int old) {
  ((ulonglong2*)d.pos)[n] = ((const ulonglong2*)s.pos)[old];
}
