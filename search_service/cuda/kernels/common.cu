// common.cu -- types, device-only constants and the device node-pool layout
// shared by every tandem MCTS kernel. The .cu files of this folder are
// concatenated in the order search_service/cuda/module.py lists them, behind
// the header abi.h that search_service/cuda/abi.py generates (every constant
// and record layout the host shares: NUM_ACTIONS, ROW, NODE_BYTES, the child
// and terminal codes, TS_*, INIT_*, RES_*, ...), and compiled by NVRTC as one
// translation unit (-std=c++17, --fmad=false: the selection scores must be
// rounded exactly like the NumPy reference's float64, so no fused multiply-add).
//
// Node pool (one region per tree, preallocated per search call; see pool.py)
// ---------------------------------------------------------------------------
// A tree of `cap` node slots owns `cap * 176` bytes, three arrays back to back:
//
//   rows   int4  [cap][8]   128 B/node  selection records (one cache line)
//   child  int32 [cap][8]    32 B/node  child slot per edge (7 used, 1 pad)
//   pos    u64   [cap][2]    16 B/node  (current, mask) Pons bitboards
//
// rows[n][a], a < 7, is edge a's 16-byte record, the fields selection reads:
//   .x int32 visits     completed simulations through the edge
//   .y int32 vloss      simulations in flight through the edge (virtual loss)
//   .z float value_sum  sum of backed-up values, for the player to move at n
//   .w float prior      policy prior (uniform over legal moves without a model)
// (abi.h: EDGE_*). .x and .y form one little-endian u64 so that backup retires
// a visit and its virtual loss with a single 64-bit atomicAdd (VISIT_DONE below).
// rows[n][HEADER], HEADER = 7, is the node header: .x int32 N (simulations
// that passed through or ended at n), .y terminal code, .z parent slot (-1
// root), .w action from the parent (-1 root) (abi.h: HEAD_*). So one 128-byte line holds everything selection needs
// about a node and its 7 edges; `child` is a second, 32-byte sector.
//
// Child codes: >= 0 slot, UNEXPANDED legal move without a node, ILLEGAL, and
// EXPANDING (transient, only while a search kernel runs: a warp has claimed
// the edge and is creating its node).
//
// Concurrency invariants (who writes which field, with what, and why the
// races that remain are benign). "Warp" = the warp running a simulation;
// several warps search one tree when W > 1, none when W = 1 but itself.
//
//   edge .x visits | .y vloss  only 64-bit atomicAdd: +VLOSS_ONE when a
//                    selection takes the edge (by the lane that owns the edge,
//                    which is also the lane that reads it next), +count -
//                    count<<32 at backup. Never a plain store during a search,
//                    so no update is lost; vloss returns to 0 when every
//                    selection has backed up (tests check it).
//   edge .z value    only float atomicAdd at backup.
//   edge .w prior    plain stores: init_node (before the node is published),
//                    init_trees, mcts_vm_root_priors (a fresh root, before
//                    the first selection), and mcts_vm_backup (the node's evaluating
//                    simulation only; selection reads priors in a later launch).
//   header .x N      only int atomicAdd at backup (+1 per simulation through
//                    or ending at the node); init stores before publication.
//   header .z/.w     written once by init_node, before publication.
//   header .y        the known result: written by init_node (terminal code),
//                    then at most once more, NOT_TERMINAL -> PROVEN_*, by the
//                    solver (backup.cu: solve_wave) with a plain store. Racing
//                    solvers write the same code: a proven result is a fact of
//                    the game, whoever derives it from whichever children.
//   child[a]         UNEXPANDED -> EXPANDING by atomicCAS (one winner per edge
//                    in the grid), EXPANDING -> slot or back to UNEXPANDED by
//                    the winner's atomicExch after a __threadfence() that
//                    makes the new node's rows, child and pos visible first.
//                    ILLEGAL never changes. Readers that follow a published
//                    slot read the node through L2 (__ldcg), after the fence.
//   pos              written once by init_node, before publication.
//   TS_NODES         atomicAdd only (one per wave per warp); values >= the
//                    limit are refused slots, never written.
//   TS_STARTED       atomicCAS only (claims never pass the budget).
//   TS_DONE          atomicAdd at the end of each wave.
//   TS_MAX_DEPTH     atomicMax.  TS_EXHAUSTED, TS_DEADLINE: plain stores of 1.
//   TS_WAVE_BASE     value model only: plain stores between launches
//                    (init_trees; vm_backup and vm_undo, warp 0 of the tree,
//                    while no warp claims slots).
//
// Benign races: a selection reads records while other warps' backups and
// virtual losses land, so it may score a slightly stale snapshot (as in any
// parallel MCTS with virtual loss; Chaslot et al. 2008); each counter itself
// stays exact. Reads never race with initialisation: a slot is read only
// after its publication. With W = 1 a tree has no concurrent writer at all:
// within a warp, a wave's selections see earlier selections' virtual losses
// (same lane, same address, program order) and the next wave sees the backup
// (__threadfence + __syncwarp at the end of every wave), which is what makes
// the search equal to the CPU reference's.

typedef unsigned long long u64;

// The value of a known result (terminal or proven code) for the node's side
// to move: the CPU reference's tree.OUTCOME_VALUE.
__host__ __device__ __forceinline__ float outcome_value(int code) {
  if (code == TERMINAL_LOSS || code == PROVEN_LOSS) return -1.0f;
  return code == PROVEN_WIN ? 1.0f : 0.0f;
}
typedef unsigned int u32;

#define HD __host__ __device__ __forceinline__
#define FULL_MASK 0xffffffffu

// visits += 1 (low word) and vloss -= 1 (high word) in one 64-bit add: the low
// word cannot carry (visits < 2^31), the high word wraps to vloss - 1.
#define VISIT_DONE 0xFFFFFFFF00000001ull
#define VLOSS_ONE 0x0000000100000000ull

// What the code assumes of the header's table (abi.h for Connect Four,
// game.h for a game folder): a node's records are int4s (edges, then the
// header at HEADER, then padding to ROW) read as members .x .y .z .w (words
// 0..3; an edge's visits and vloss one u64), its child row int32s (ROW, of
// which NUM_ACTIONS used), its position POS_WORDS u64s (the game's state
// words); a key node * ROW + action names an edge; a META row moves as one int4.
static_assert(EDGE_VISITS == 0 && EDGE_VLOSS == 1 && EDGE_VALUE_SUM == 2 && EDGE_PRIOR == 3 && EDGE_WORDS == 4,
              "edge record: int4 (visits, vloss, value_sum, prior)");
static_assert(HEAD_VISITS == 0 && HEAD_TERMINAL == 1 && HEAD_PARENT == 2 && HEAD_ACTION == 3 && HEAD_WORDS == 4,
              "node header: int4 (N, terminal, parent, action)");
static_assert(ROWS_BYTES == ROW * sizeof(int4) && CHILD_BYTES == ROW * sizeof(int) &&
              POS_BYTES == POS_WORDS * sizeof(unsigned long long) && NODE_BYTES == ROWS_BYTES + CHILD_BYTES + POS_BYTES,
              "node pool layout");
static_assert(HEADER == NUM_ACTIONS && ROW > NUM_ACTIONS && ROW % 4 == 0, "node row layout");
static_assert(META_WORDS * sizeof(int) == sizeof(int4), "META row");

// The first record of the row that holds key e (node * ROW + action).
#if (ROW & (ROW - 1)) == 0
#define ROW_START(e) ((e) & ~(ROW - 1))
#else
#define ROW_START(e) ((e) / ROW * ROW)
#endif

struct TreeView {
  int4* rows;  // [cap * ROW]
  int* child;  // [cap * ROW]
  u64* pos;    // [cap * POS_WORDS]
};

__device__ __forceinline__ TreeView tree_view(unsigned char* pool, long long cap, int b) {
  unsigned char* base = pool + (long long)b * cap * NODE_BYTES;
  TreeView t;
  t.rows = (int4*)base;
  t.child = (int*)(base + cap * ROWS_BYTES);
  t.pos = (u64*)(base + cap * (ROWS_BYTES + CHILD_BYTES));
  return t;
}

HD double neg_inf() {
#ifdef __CUDA_ARCH__
  return __longlong_as_double(0xfff0000000000000LL);
#else
  return -__builtin_inf();
#endif
}

HD double pos_inf() {
#ifdef __CUDA_ARCH__
  return __longlong_as_double(0x7ff0000000000000LL);
#else
  return __builtin_inf();
#endif
}

HD int popc32(u32 x) {
#ifdef __CUDA_ARCH__
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}

__device__ __forceinline__ u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The k-th (0-based) set bit of a legal mask of WORDS u32 words, k = word % n over its n set
// bits (the rollouts' rule, search_service/mcts/rollout.py); -1 when n = 0.
template <int WORDS>
__device__ __forceinline__ int kth_legal(const u32* legal, u32 word) {
  int n = 0;
#pragma unroll
  for (int i = 0; i < WORDS; ++i) n += __popc(legal[i]);
  if (n == 0) return -1;
  u32 k = word % (u32)n;
#pragma unroll
  for (int i = 0; i < WORDS; ++i) {
    u32 m = legal[i];
    const u32 c = (u32)__popc(m);
    if (k < c) {
      for (; k; --k) m &= m - 1;
      return 32 * i + __ffs(m) - 1;
    }
    k -= c;
  }
  return -1;
}
