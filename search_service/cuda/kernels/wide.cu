// wide.cu -- a game folder's rules (its rules.cu, compiled just before this
// file) as the game module the search kernels call, with nodes of any width:
// the same functions connect4.cu gives Connect Four (GameState, load_state,
// play_code, init_node, game_rollout, ...), over the rules interface below.
//
// The rules interface (docs/search.md, "Device rules"): a folder's rules.cu
// defines, against the generated game.h (NUM_ACTIONS, STATE_WORDS,
// MASK_WORDS, MAX_MOVES, OBS_*) and the types of common.cu (u64, u32):
//
//   #define RULES_NUM_ACTIONS a      what the code is written for: checked
//   #define RULES_STATE_WORDS w      against game.yaml's at compile time
//   RULE void game_initial(u64* s)                     the starting state
//   RULE void game_legal(const u64* s, u32* legal)     MASK_WORDS words: bit a % 32
//                                                      of word a / 32; all 0 when over
//   RULE bool game_step(u64* s, int a, float& reward)  plays legal a in place; returns
//                                                      whether the game is over, reward
//                                                      the mover's result (+1, 0, -1)
//   RULE bool game_is_terminal(const u64* s)
//   RULE float game_returns(const u64* s)              the side to move's result where
//                                                      over (+1, 0, -1), else 0
//
// (RULE = __device__ __forceinline__.) The words are rules.py's, bit for bit
// (the conformance kit plays random games with both and compares them).
// The turn passes after every action, so a value backed up one edge higher
// changes sign (search_service/mcts/games.py).

#ifndef RULES_NUM_ACTIONS
#error "rules.cu must #define RULES_NUM_ACTIONS (the action count its code is written for)"
#endif
#ifndef RULES_STATE_WORDS
#error "rules.cu must #define RULES_STATE_WORDS (the state words its code is written for)"
#endif
static_assert(RULES_NUM_ACTIONS == NUM_ACTIONS, "game.yaml's num_actions differs from rules.cu's RULES_NUM_ACTIONS");
static_assert(RULES_STATE_WORDS == STATE_WORDS, "game.yaml's state_words differs from rules.cu's RULES_STATE_WORDS");
static_assert(POS_WORDS == STATE_WORDS, "a node's position is the state words");

#define GAME_VALUE_MODEL 0    // rollouts only: no mcts_vm_* kernels
#define GAME_WARP_INIT 1      // a node's edges are written by the whole warp (init_node_warp)
// Wide nodes whatever NUM_ACTIONS: the 8-lane paths read a row of exactly 8 records with the header
// 8th, which a folder's ROW (NUM_ACTIONS + 1 rounded up to 4) is only for 7 actions.
#define GAME_EIGHT_LANES 0
#define ROLLOUT_SMEM_BYTES 0  // no rollout tables in shared memory

struct GameState {
  u64 w[STATE_WORDS];
};

// The rules interface on GameState (what playout.cu and the search call).
__device__ __forceinline__ void game_initial(GameState& s) { game_initial(s.w); }
__device__ __forceinline__ void game_legal(const GameState& s, u32* legal) { game_legal(s.w, legal); }
__device__ __forceinline__ bool game_step(GameState& s, int a, float& reward) { return game_step(s.w, a, reward); }
__device__ __forceinline__ bool game_is_terminal(const GameState& s) { return game_is_terminal(s.w); }
__device__ __forceinline__ float game_returns(const GameState& s) { return game_returns(s.w); }

// A finished position's code for its side to move from its result r
// (PluginSearch.terminal_code): lost, drawn, or won (PROVEN_WIN: as exact as a proof).
__device__ __forceinline__ int result_code(float r) {
  return r < 0.0f ? TERMINAL_LOSS : (r > 0.0f ? PROVEN_WIN : TERMINAL_DRAW);
}

// Plays `action` (legal) and returns the new position's terminal code (the
// mover's reward, seen from the new side to move, is its negation).
__device__ __forceinline__ int play_code(GameState& s, int action) {
  float r;
  return game_step(s.w, action, r) ? result_code(-r) : NOT_TERMINAL;
}

__device__ __forceinline__ int state_code(const GameState& s) {
  return game_is_terminal(s.w) ? result_code(game_returns(s.w)) : NOT_TERMINAL;
}

__device__ __forceinline__ GameState load_state(const TreeView& t, int node) {
  GameState s;
#pragma unroll
  for (int i = 0; i < STATE_WORDS; ++i) s.w[i] = __ldcg(t.pos + (long long)node * STATE_WORDS + i);
  return s;
}

__device__ __forceinline__ void store_state(const TreeView& t, int node, const GameState& s) {
#pragma unroll
  for (int i = 0; i < STATE_WORDS; ++i) t.pos[(long long)node * STATE_WORDS + i] = s.w[i];
}

__device__ __forceinline__ void copy_state(const TreeView& d, int n, const TreeView& s, int old) {
#pragma unroll
  for (int i = 0; i < STATE_WORDS; ++i) d.pos[(long long)n * STATE_WORDS + i] = s.pos[(long long)old * STATE_WORDS + i];
}

__device__ __forceinline__ GameState shfl_state(const GameState& s, int src) {
  GameState o;
#pragma unroll
  for (int i = 0; i < STATE_WORDS; ++i) o.w[i] = __shfl_sync(FULL_MASK, s.w[i], src);
  return o;
}

// A tree's root from its INIT row (each state word as (low, high) u32 words).
__device__ __forceinline__ GameState init_state(const u32* in) {
  GameState s;
#pragma unroll
  for (int i = 0; i < STATE_WORDS; ++i) s.w[i] = (u64)in[INIT_STATE + 2 * i] | ((u64)in[INIT_STATE + 2 * i + 1] << 32);
  return s;
}

__device__ __forceinline__ void rollout_smem_init(unsigned char*) {}

// One random game from an unfinished state, for its side to move: move i
// plays the (word % n)-th of the n legal actions, word i % 4 of
// philox((sim, tree, i / 4, STREAM_ROLLOUT), key), as
// rollout.plugin_rollout_values does. A game that has not ended after
// MAX_MOVES plies, or a state with no legal action that is not over, counts
// as a draw here (the NumPy rollouts raise; the conformance kit catches such rules).
__device__ float game_rollout(const GameState& from, u32 sim, u32 tree, u32 k0, u32 k1, const unsigned char*) {
  GameState s = from;
  for (u32 blk = 0; blk * 4u < (u32)MAX_MOVES; ++blk) {
    u32 w[4];
    philox4x32_10(sim, tree, blk, STREAM_ROLLOUT, k0, k1, w[0], w[1], w[2], w[3]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const u32 i = blk * 4u + (u32)q;
      if (i >= (u32)MAX_MOVES) return 0.0f;
      u32 legal[MASK_WORDS];
      game_legal(s.w, legal);
      const int a = kth_legal<MASK_WORDS>(legal, w[q]);
      if (a < 0) return 0.0f;
      float r;
      if (game_step(s.w, a, r)) return (i & 1u) ? -r : r;  // the leaf's side to move plays plies 0, 2, ...
    }
  }
  return 0.0f;
}

// Writes node s (edges first .. NUM_ACTIONS-1 in steps of `stride`; the
// header and state where first == 0): uniform priors over the legal actions
// (as tree.edges: 1 / n rounded to float32), UNEXPANDED / ILLEGAL child codes,
// no visits. Called before the node is published (expand.cu).
__device__ __forceinline__ void write_node(const TreeView& t, int s, const GameState& st, int term, int parent,
                                           int action, int first, int stride) {
  u32 legal[MASK_WORDS];
#pragma unroll
  for (int i = 0; i < MASK_WORDS; ++i) legal[i] = 0u;
  if (term == NOT_TERMINAL) game_legal(st.w, legal);
  int n = 0;
#pragma unroll
  for (int i = 0; i < MASK_WORDS; ++i) n += __popc(legal[i]);
  const float prior = n ? (float)(1.0 / (double)n) : 0.0f;
  int4* row = t.rows + (long long)s * ROW;
  int* ch = t.child + (long long)s * ROW;
  for (int a = first; a < ROW; a += stride) {
    const bool ok = a < NUM_ACTIONS && ((legal[a >> 5] >> (a & 31)) & 1u);
    if (a != HEADER) row[a] = make_int4(0, 0, 0, ok ? __float_as_int(prior) : 0);
    ch[a] = ok ? UNEXPANDED : ILLEGAL;
  }
  if (first == 0) {
    row[HEADER] = make_int4(0, term, parent, action);
    store_state(t, s, st);
  }
}

// One thread writes the node (init_trees' roots).
__device__ void init_node(const TreeView& t, int s, const GameState& st, int term, int parent, int action) {
  write_node(t, s, st, term, parent, action, 0, 1);
}

// The warp writes the node, lane l the edges l, l + 32, ... (expand.cu).
__device__ void init_node_warp(const TreeView& t, int s, const GameState& st, int term, int parent, int action,
                               int lane) {
  write_node(t, s, st, term, parent, action, lane, 32);
}
