// search.cu -- the search kernels.
//
// Work split: tree b gets W warps; warp w of a tree runs waves of up to G_w
// simulations (G for every warp but the last, which takes K - (W - 1) * G),
// so K = parallel_sims simulations are in flight per tree. A wave of a warp:
//   1. select: the warp descends once per simulation, one after another, each
//      descent seeing the virtual losses of the earlier ones (select.cu:
//      select_wave);
//   2. expand: one node per distinct stopping edge, slots from one atomicAdd
//      (expand.cu: expand_wave); lane i keeps simulation i's leaf;
//   3. evaluate: lane i plays simulation i's random rollout (connect4.cu), or,
//      for the value model, the wave returns to the host (mcts_vm_*);
//   4. backup (backup.cu), then __threadfence() so the next wave of this warp,
//      whose lanes read records other lanes updated, sees every update.
// With W = 1 each tree is searched by one warp, in the CPU reference's order:
// the same waves, selections, node slots and Philox counters. With W > 1 the
// warps of a tree run free (asynchronous parallel MCTS): results depend on
// timing and differ from the reference.
//
// Counters, per tree (TS_* in common.cu): a warp claims the simulation indices
// s0 .. s0 + g - 1, g = min(G_w, budget - s0), by atomicCAS on TS_STARTED
// (retried if another warp of the tree claimed first), so TS_STARTED never
// passes `budget`: exactly `budget` simulations run per tree, and a later
// launch with a larger budget continues where this one stopped (the host
// runs a search in slices when it must poll a stop request). The deadline is
// checked by lane 0 before each claim against %globaltimer, from one start
// time per launch (the first warp to read the timer stores it by atomicCAS),
// and stops a warp only once its tree has claimed a wave (at least one wave
// per tree always runs). A tree whose root the solver has proven claims no
// more simulations (backup.cu: solve_wave).

#if GAME_VALUE_MODEL
// A position's OBS row: the side to move's stones, then the opponent's, [row][col].
__device__ __forceinline__ void write_obs(unsigned char* o, u64 cur, u64 msk) {
  const u64 opp = cur ^ msk;
  for (int i = 0; i < CELLS; ++i) {
    const int bit = (i % 7) * 7 + i / 7;  // [row][col] -> col * 7 + row
    o[OBS_CURRENT + i] = (unsigned char)((cur >> bit) & 1ull);
    o[OBS_OPPONENT + i] = (unsigned char)((opp >> bit) & 1ull);
  }
}
#endif

// Fills a tree's root (fresh trees) and its search state (TS row) from its
// INIT row (u32 [B][INIT_WORDS]; the u64 bitboards as (low, high) words).
// One thread per tree; also zeroes the tree's phase cycle counters (CYC row)
// and, thread 0, the launch start time of the deadline clock (t0). With `obs`
// (not null: the value model's device waves), a fresh tree b's root also gets
// its OBS row b there, for the model to value it (mcts_vm_root_priors).
extern "C" __global__ void init_trees(unsigned char* pool, long long cap, int n_trees, const u32* init, int* tsa,
                                      u64* cyc, u64* t0, unsigned char* obs) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b == 0) *t0 = 0ull;
  if (b >= n_trees) return;
  const u32* in = init + (long long)b * INIT_WORDS;
  int* ts = tsa + (long long)b * TS_WORDS;
#pragma unroll
  for (int f = 0; f < TS_WORDS; ++f) ts[f] = 0;
#pragma unroll
  for (int p = 0; p < CYC_WORDS; ++p) cyc[(long long)b * CYC_WORDS + p] = 0ull;
  ts[TS_NODES] = (int)in[INIT_NODES];
  ts[TS_WAVE_BASE] = (int)in[INIT_NODES];
  if (!in[INIT_FRESH]) return;
  const GameState st = init_state(in);
  const TreeView t = tree_view(pool, cap, b);
  init_node(t, 0, st, state_code(st), -1, -1);
#if GAME_VALUE_MODEL
  if (obs != nullptr) write_obs(obs + (long long)b * OBS_WORDS, st.cur, st.mask);
  if (in[INIT_HAS_PRIORS]) {
    for (int a = 0; a < NUM_ACTIONS; ++a) t.rows[a].w = (int)in[INIT_PRIORS + a];
  }
#endif
  t.rows[HEADER].x = (int)in[INIT_ROOT_VISITS];
}

// The game's rollout tables and per-warp scratch in dynamic shared memory (the
// host asks for ROLLOUT_SMEM_BYTES + WARPS_PER_BLOCK * warp_scratch_ints(G) * 4
// bytes): [rollout tables, ROLLOUT_SMEM_BYTES (Connect Four: its kth-free-column
// table; a game folder: none)][per warp: path G * MAX_DEPTH int, vals 32 float, deps 32 int].
__device__ __forceinline__ int warp_scratch_ints(int G) { return G * MAX_DEPTH + 64; }

struct WarpJob {
  int b;      // tree
  int first;  // index of this warp's first simulation slot within its tree's K
  int sims;   // G_w
};

__device__ __forceinline__ bool warp_job(int n_trees, int W, int G, int K, WarpJob& job) {
  const long long gw = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (gw >= (long long)n_trees * W) return false;
  const int w = (int)(gw % W);
  job.b = (int)(gw / W);
  job.first = w * G;
  job.sims = (w < W - 1) ? G : K - (W - 1) * G;
  return true;
}

// Rollout search: the whole search in one launch (select, expand, rollout,
// backup per wave, waves until the budget or the deadline). cyc: the CYC rows,
// clock64 cycles spent per phase, summed over the tree's warps (lane 0's clock).
//
// A batch of trees from several searches (search_service/cuda/tree_batch.py)
// gives each tree its own budget (`budgets` int [n_trees], the simulations it
// may have claimed by the launch's end; null: `budget` for all) and its own
// Philox key and tree word (`keys` u32 [n_trees][3]: k0, k1, the tree's index
// within its own search call; null: k0, k1 and the tree's index b).
template <int AGG>
__device__ void rollout_search(unsigned char* pool, long long cap, int limit, int n_trees, int W, int G, int K,
                               int budget, long long deadline_ns, u64* t0, int* tsa, u64* cyc, double c,
                               double vl, const double* scale, int n_scale, u32 k0, u32 k1, const int* budgets,
                               const u32* keys) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* table = smem;
  rollout_smem_init(table);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  int* wbuf = (int*)(smem + ROLLOUT_SMEM_BYTES) + (threadIdx.x >> 5) * warp_scratch_ints(G);
  int* path = wbuf;
  float* vals = (float*)(wbuf + G * MAX_DEPTH);
  int* deps = wbuf + G * MAX_DEPTH + 32;
  WarpJob job;
  if (!warp_job(n_trees, W, G, K, job)) return;
  const TreeView t = tree_view(pool, cap, job.b);
  int* ts = tsa + (long long)job.b * TS_WORDS;
  const SelectParams sp = {0, c, vl, scale, n_scale};
  if (budgets != nullptr) budget = budgets[job.b];
  u32 tree_word = (u32)job.b;
  if (keys != nullptr) {
    k0 = keys[(long long)job.b * 3];
    k1 = keys[(long long)job.b * 3 + 1];
    tree_word = keys[(long long)job.b * 3 + 2];
  }
  u64 start = 0;
  if (deadline_ns > 0 && lane == 0) {
    const u64 now = global_timer_ns();
    const u64 old = atomicCAS((unsigned long long*)t0, 0ull, (unsigned long long)now);
    start = old ? old : now;
  }
  long long cy[CYC_WORDS] = {0, 0, 0, 0};
  while (true) {
    int s0 = 0, g = 0;
    if (lane == 0) {
      s0 = *(volatile int*)(ts + TS_STARTED);
      if (deadline_ns > 0 && (long long)(global_timer_ns() - start) >= deadline_ns && s0 > 0) {
        ts[TS_DEADLINE] = 1;
      } else if (__ldcg(node_code(t, 0)) == NOT_TERMINAL) {
        while (s0 < budget) {  // claim min(G_w, budget - s0) indices; never past the budget
          const int want = min(job.sims, budget - s0);
          const int old = atomicCAS(ts + TS_STARTED, s0, s0 + want);
          if (old == s0) {
            g = want;
            break;
          }
          s0 = old;
        }
      }
    }
    s0 = __shfl_sync(FULL_MASK, s0, 0);
    g = __shfl_sync(FULL_MASK, g, 0);
    if (g <= 0) break;
    const long long c0 = clock64();
    Descent mine;
    select_wave(t, sp, path, lane, g, mine);
    const long long c1 = clock64();
    const bool active = lane < g;
    GameState st;
    int term, leader;  // leader: not needed here (each lane plays its own rollout)
    const int leaf = expand_wave(t, ts, limit, lane, g, mine, st, term, leader);
    const long long c2 = clock64();
    float v = 0.0f;
    if (active) {
      v = term != NOT_TERMINAL ? outcome_value(term)  // terminal or proven: exact
                               : game_rollout(st, (u32)(s0 + lane), tree_word, k0, k1, table);
    }
    const long long c3 = clock64();
    backup_wave<AGG>(t, ts, path, vals, deps, lane, g, mine.depth, v, leaf);
    solve_wave(t, path, lane, g, mine.depth, term);
    __threadfence();
    __syncwarp();
    if (lane == 0) atomicAdd(ts + TS_DONE, g);
    const long long c4 = clock64();
    cy[CYC_SELECT] += c1 - c0;
    cy[CYC_EXPAND] += c2 - c1;
    cy[CYC_EVALUATE] += c3 - c2;
    cy[CYC_BACKUP] += c4 - c3;
  }
  if (lane == 0) {
#pragma unroll
    for (int p = 0; p < CYC_WORDS; ++p) {
      atomicAdd((unsigned long long*)(cyc + (long long)job.b * CYC_WORDS + p), (unsigned long long)cy[p]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK) mcts_rollout_global(
    unsigned char* pool, long long cap, int limit, int n_trees, int W, int G, int K, int budget,
    long long deadline_ns, u64* t0, int* tsa, u64* cyc, double c, double vl, const double* scale, int n_scale,
    u32 k0, u32 k1, const int* budgets, const u32* keys) {
  rollout_search<0>(pool, cap, limit, n_trees, W, G, K, budget, deadline_ns, t0, tsa, cyc, c, vl, scale, n_scale, k0, k1,
                    budgets, keys);
}

extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK) mcts_rollout_aggregated(
    unsigned char* pool, long long cap, int limit, int n_trees, int W, int G, int K, int budget,
    long long deadline_ns, u64* t0, int* tsa, u64* cyc, double c, double vl, const double* scale, int n_scale,
    u32 k0, u32 k1, const int* budgets, const u32* keys) {
  rollout_search<1>(pool, cap, limit, n_trees, W, G, K, budget, deadline_ns, t0, tsa, cyc, c, vl, scale, n_scale, k0, k1,
                    budgets, keys);
}

#if GAME_VALUE_MODEL
// A warp's share of a value-model wave: its tree, its simulations g (0: none
// this wave) and the META/path row q0 of its first one.
struct VmWarp {
  WarpJob job;
  int lane, g;
  TreeView t;
  int* ts;
  long long q0;
};

// `ks` (int [n_trees]; null: k_wave for every tree): a batch of trees from
// several searches, each taking its own number of simulations this wave
// (search_service/mcts/plan.py); its slots j >= ks[b] are not written.
__device__ __forceinline__ bool vm_warp(unsigned char* pool, long long cap, int n_trees, int W, int G, int K,
                                        int k_wave, const int* ks, int* tsa, VmWarp& v) {
  if (!warp_job(n_trees, W, G, K, v.job)) return false;
  v.lane = threadIdx.x & 31;
  v.g = min(v.job.sims, (ks != nullptr ? ks[v.job.b] : k_wave) - v.job.first);
  if (v.g <= 0) return false;
  v.t = tree_view(pool, cap, v.job.b);
  v.ts = tsa + (long long)v.job.b * TS_WORDS;
  v.q0 = (long long)v.job.b * K + v.job.first;
  return true;
}

// Value model, first half of a wave: selection and expansion for k_wave
// simulations per tree. Per simulation slot q = b * K + j (j < k_wave): its
// META row (leaf slot, depth, terminal code, the q of the simulation that
// evaluates this leaf), paths[q][0..depth) its path, and its OBS row (the
// side to move's stones, then the opponent's) where the leaf is unfinished.
// A tree whose root is proven runs no simulation: its slots' META rows say
// NO_SIMULATION (terminal), depth 0, leaf -1.
extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK) mcts_vm_select(
    unsigned char* pool, long long cap, int limit, int n_trees, int W, int G, int K, int k_wave, double c,
    double vl, int* tsa, int* meta, int* paths, unsigned char* obs, const int* ks) {
  VmWarp v;
  if (!vm_warp(pool, cap, n_trees, W, G, K, k_wave, ks, tsa, v)) return;
  const int lane = v.lane, g = v.g;
  const TreeView& t = v.t;
  int* ts = v.ts;
  const long long q0 = v.q0;
  if (__ldcg(node_code(t, 0)) != NOT_TERMINAL) {
    if (lane < g) ((int4*)meta)[q0 + lane] = make_int4(-1, 0, NO_SIMULATION, (int)(q0 + lane));
    return;
  }
  int* path = paths + q0 * MAX_DEPTH;
  const SelectParams sp = {1, c, vl, nullptr, 0};
  Descent mine;
  select_wave(t, sp, path, lane, g, mine);
  const bool active = lane < g;
  GameState st;
  int term, leader;
  const int leaf = expand_wave(t, ts, limit, lane, g, mine, st, term, leader);
  if (active) {
    const long long q = q0 + lane;
    __align__(16) int m[META_WORDS];  // stored as one int4
    m[META_LEAF] = leaf;
    m[META_DEPTH] = mine.depth;
    m[META_TERMINAL] = term;
    m[META_LEADER] = (int)(q0 + leader);
    ((int4*)meta)[q] = *(const int4*)m;
    if (term == NOT_TERMINAL) write_obs(obs + q * OBS_WORDS, st.cur, st.mask);
  }
}

// The priors of a position the model valued, by the rules of
// search_service.mcts.backend.model_answer applied to the softmax of its policy
// logits (evaluators.values_and_priors), in float32: softmax(l) masked to the
// legal moves (the empty top cells of its OBS row `o`), negatives and
// non-finite as 0, renormalised, uniform over the legal moves where nothing is
// left (zeros where none is). `l` float [NUM_ACTIONS]; `p` float [NUM_ACTIONS] out.
__device__ void masked_priors(const float* l, const unsigned char* o, float* p) {
  const unsigned char* top = o + (CELLS - NUM_ACTIONS);  // row 5 of each plane
  float mx = l[0];
  for (int a = 1; a < NUM_ACTIONS; ++a) mx = (isnan(mx) || isnan(l[a])) ? __int_as_float(0x7fc00000) : fmaxf(mx, l[a]);  // NumPy's max (NaN wins)
  float e[NUM_ACTIONS], sum = 0.0f, total = 0.0f;
  int legal = 0;
  for (int a = 0; a < NUM_ACTIONS; ++a) {
    e[a] = expf(l[a] - mx);
    sum += e[a];
  }
  for (int a = 0; a < NUM_ACTIONS; ++a) {
    const bool ok = top[OBS_CURRENT + a] == 0 && top[OBS_OPPONENT + a] == 0;
    legal += ok;
    const float x = e[a] / sum;
    e[a] = (ok && isfinite(x)) ? fmaxf(x, 0.0f) : 0.0f;
    total += e[a];
  }
  if (!(total > 0.0f)) {  // nothing legal left: uniform over the legal moves (zeros where none is)
    total = (float)max(legal, 1);
    for (int a = 0; a < NUM_ACTIONS; ++a)
      e[a] = (top[OBS_CURRENT + a] == 0 && top[OBS_OPPONENT + a] == 0) ? 1.0f : 0.0f;
  }
  for (int a = 0; a < NUM_ACTIONS; ++a) p[a] = e[a] / total;
}

// Takes a wave back out of a tree: the warp's simulations' virtual losses
// released and, by the tree's first warp, the nodes the wave created (slots
// TS_WAVE_BASE .. TS_NODES, below the limit) unlinked from their parents,
// TS_NODES back to the base. Nothing is backed up (mcts_vm_undo).
__device__ void vm_undo_warp(const VmWarp& v, int limit, const int* meta, const int* paths) {
  const int lane = v.lane, g = v.g;
  const TreeView& t = v.t;
  int* ts = v.ts;
  const long long q0 = v.q0;
  if (lane < g) {
    const int depth = ((const int4*)meta)[q0 + lane].y;
    const int* p = paths + (q0 + lane) * MAX_DEPTH;
    for (int d = 0; d < depth; ++d) atomicAdd((unsigned long long*)(t.rows + p[d]), (u64)0 - VLOSS_ONE);
  }
  if (v.job.first != 0) return;
  const int base = ts[TS_WAVE_BASE], top = min(ts[TS_NODES], limit);
  for (int s = base + lane; s < top; s += 32) {
    const int4 h = t.rows[(long long)s * ROW + HEADER];  // .z parent, .w action
    t.child[(long long)h.z * ROW + h.w] = UNEXPANDED;
  }
  __syncwarp();
  if (lane == 0) ts[TS_NODES] = base;
}

// Value model, second half of a wave. Each simulation's leaf value (for the
// leaf's side to move) and, for the evaluating simulation of each new node,
// its priors come either from vin, the EVAL rows the host built (priors
// where has_priors), or, where from_outputs, straight from the model's
// outputs on the device (the device waves' output region), by the rules of
// search_service.mcts.backend.model_answer: a known result's exact value
// (outcome_value), else the value of the row of the leaf's evaluating
// simulation (NaN as 0, clipped to [-1, 1]), and masked_priors of that
// simulation's OBS row and logits (none without a policy head: logits null).
// `values` float [n] (one per row; null only where no leaf was valued: a
// wave of known results), `logits` float [n][NUM_ACTIONS], `obs` the OBS
// rows. The evaluating simulation is the only writer of its node's .w
// (selection of the next wave runs in a later launch). Then backup as in
// rollout_search. (One launch: a kernel of its own that built the EVAL rows
// from the outputs first cost every wave ~10 µs of GPU and a launch.)
// `limit` goes unused: the launch passes the selection's leading arguments.
template <int AGG>
__device__ void vm_backup(unsigned char* pool, long long cap, int limit, int n_trees, int W, int G, int K, int k_wave,
                          int* tsa, const int* meta, const int* paths, const float* vin, int has_priors,
                          int from_outputs, const float* values, const float* logits, const unsigned char* obs,
                          const int* ks) {
  __shared__ float s_vals[WARPS_PER_BLOCK][32];
  __shared__ int s_deps[WARPS_PER_BLOCK][32];
  VmWarp vw;
  if (!vm_warp(pool, cap, n_trees, W, G, K, k_wave, ks, tsa, vw)) return;
  const int lane = vw.lane, g = vw.g, warp = threadIdx.x >> 5;
  const TreeView& t = vw.t;
  int* ts = vw.ts;
  const long long q0 = vw.q0;
  const WarpJob& job = vw.job;
  if (((const int4*)meta)[q0].z == NO_SIMULATION) return;  // the root is proven: nothing ran
  int depth = 0, leaf = -1, code = NOT_TERMINAL;
  float v = 0.0f;
  if (lane < g) {
    const long long q = q0 + lane;
    __align__(16) int m[META_WORDS];  // loaded as one int4
    *(int4*)m = ((const int4*)meta)[q];
    leaf = m[META_LEAF];
    depth = m[META_DEPTH];
    code = m[META_TERMINAL];
    const bool evaluates = m[META_LEADER] == (int)q && leaf >= 0 && code == NOT_TERMINAL;
    int4* edges = t.rows + (long long)max(leaf, 0) * ROW;  // written only where `evaluates`
    if (!from_outputs) {  // the host's EVAL rows
      const float* ev = vin + q * EVAL_WORDS;
      v = ev[EVAL_VALUE];
      if (has_priors && evaluates) {
        for (int a = 0; a < NUM_ACTIONS; ++a) edges[a].w = __float_as_int(ev[EVAL_PRIORS + a]);
      }
    } else if (code != NOT_TERMINAL) {
      v = outcome_value(code);
    } else if (values != nullptr) {  // null: no leaf was valued, so no open slot (v stays 0 if one were)
      const float x = values[m[META_LEADER]];
      v = isnan(x) ? 0.0f : fminf(fmaxf(x, -1.0f), 1.0f);
      if (logits != nullptr && evaluates) {
        float p[NUM_ACTIONS];
        masked_priors(logits + q * NUM_ACTIONS, obs + q * OBS_WORDS, p);
        for (int a = 0; a < NUM_ACTIONS; ++a) edges[a].w = __float_as_int(p[a]);
      }
    }
  }
  backup_wave<AGG>(t, ts, paths + q0 * MAX_DEPTH, s_vals[warp], s_deps[warp], lane, g, depth, v, leaf);
  solve_wave(t, paths + q0 * MAX_DEPTH, lane, g, depth, code);
  __threadfence();
  __syncwarp();
  if (lane == 0) atomicAdd(ts + TS_DONE, g);
  // No warp claims slots during a backup launch, so TS_NODES is the next wave's base.
  if (lane == 0 && job.first == 0) ts[TS_WAVE_BASE] = __ldcg(ts + TS_NODES);
}

// Value model, instead of the backup when the wave's evaluation failed (the
// reward service failed, or could not answer by the deadline): takes the
// wave back out of the trees (vm_undo_warp). The same grid as mcts_vm_select.
extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK) mcts_vm_undo(
    unsigned char* pool, long long cap, int limit, int n_trees, int W, int G, int K, int k_wave, int* tsa,
    const int* meta, const int* paths, const int* ks) {
  VmWarp v;
  if (!vm_warp(pool, cap, n_trees, W, G, K, k_wave, ks, tsa, v)) return;
  if (((const int4*)meta)[v.q0].z == NO_SIMULATION) return;
  vm_undo_warp(v, limit, meta, paths);
}

// Value model with device waves, after init_trees wrote each fresh root's OBS
// row and the model valued those rows: a fresh tree b's root edges get the
// priors of row b (masked_priors), as init_trees stores the host's
// (INIT_PRIORS). One thread per tree; `logits` float [n_trees][NUM_ACTIONS].
// The search's first selection runs in a later launch.
extern "C" __global__ void mcts_vm_root_priors(unsigned char* pool, long long cap, int n_trees, const u32* init,
                                               const unsigned char* obs, const float* logits) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= n_trees || !init[(long long)b * INIT_WORDS + INIT_FRESH]) return;
  float p[NUM_ACTIONS];
  masked_priors(logits + (long long)b * NUM_ACTIONS, obs + (long long)b * OBS_WORDS, p);
  const TreeView t = tree_view(pool, cap, b);
  for (int a = 0; a < NUM_ACTIONS; ++a) t.rows[a].w = __float_as_int(p[a]);
}

extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK) mcts_vm_backup_global(
    unsigned char* pool, long long cap, int limit, int n_trees, int W, int G, int K, int k_wave, int* tsa,
    const int* meta, const int* paths, const float* vin, int has_priors, int from_outputs, const float* values,
    const float* logits, const unsigned char* obs, const int* ks) {
  vm_backup<0>(pool, cap, limit, n_trees, W, G, K, k_wave, tsa, meta, paths, vin, has_priors, from_outputs, values,
                 logits, obs, ks);
}

extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_BLOCK) mcts_vm_backup_aggregated(
    unsigned char* pool, long long cap, int limit, int n_trees, int W, int G, int K, int k_wave, int* tsa,
    const int* meta, const int* paths, const float* vin, int has_priors, int from_outputs, const float* values,
    const float* logits, const unsigned char* obs, const int* ks) {
  vm_backup<1>(pool, cap, limit, n_trees, W, G, K, k_wave, tsa, meta, paths, vin, has_priors, from_outputs, values,
                 logits, obs, ks);
}

#endif  // GAME_VALUE_MODEL

#if GAME_EIGHT_LANES  // Connect Four's 8-record rows; a game folder's wide nodes: the #else branch below
// Results, one warp per tree, after the search: a RES row per tree (the root's
// edges and N, the TS counters, the principal variation, the CYC row). The
// principal variation follows, from the root, the edge with the most visits
// (ties: the higher mean value Q = W / n in float64, then the lower index)
// while it has a visit, as cpu_reference._principal_variations does.
extern "C" __global__ void finish_trees(unsigned char* pool, long long cap, int n_trees, const int* tsa,
                                        const u64* cyc, int* res) {
  const long long gw = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (gw >= n_trees) return;
  const int b = (int)gw, lane = threadIdx.x & 31, e = lane & 7;
  const TreeView t = tree_view(pool, cap, b);
  int* out = res + (long long)b * RES_WORDS;
  const int* ts = tsa + (long long)b * TS_WORDS;
  int node = 0, len = 0;
  for (int step = 0; step < MAX_DEPTH; ++step) {
    const int4 r = __ldcg(t.rows + (long long)node * ROW + e);
    const int ch = __ldcg(t.child + (long long)node * ROW + e);
    if (step == 0 && lane < ROW) {
      unsigned char* outcome = (unsigned char*)(out + RES_OUTCOME);
      if (e < NUM_ACTIONS) {
        out[RES_VISITS + e] = r.x;
        out[RES_VALUE_SUM + e] = r.z;
        outcome[1 + e] = (unsigned char)(ch >= 0 ? __ldcg(node_code(t, ch)) : NOT_TERMINAL);
      } else {
        out[RES_ROOT_VISITS] = r.x;
        outcome[0] = (unsigned char)r.y;
      }
    }
    int vis = e < NUM_ACTIONS ? r.x : -1;
    double q = vis > 0 ? (double)__int_as_float(r.z) / (double)vis : 0.0;
    int best = e;
#pragma unroll
    for (int off = 4; off >= 1; off >>= 1) {
      const int ov = __shfl_xor_sync(FULL_MASK, vis, off, 8);
      const double oq = __shfl_xor_sync(FULL_MASK, q, off, 8);
      const int ob = __shfl_xor_sync(FULL_MASK, best, off, 8);
      if (ov > vis || (ov == vis && (oq > q || (oq == q && ob < best)))) {
        vis = ov;
        q = oq;
        best = ob;
      }
    }
    best = __shfl_sync(FULL_MASK, best, 0);
    vis = __shfl_sync(FULL_MASK, vis, 0);
    if (vis <= 0) break;
    if (lane == 0) out[RES_PV + len] = best;
    ++len;
    const int c = __shfl_sync(FULL_MASK, ch, best);
    if (c < 0) break;
    node = c;
  }
  if (lane == 0) {
    out[RES_NODES] = ts[TS_NODES];
    out[RES_MAX_DEPTH] = ts[TS_MAX_DEPTH];
    out[RES_DONE] = ts[TS_DONE];
    out[RES_EXHAUSTED] = ts[TS_EXHAUSTED];
    out[RES_DEADLINE] = ts[TS_DEADLINE];
    out[RES_PV_LENGTH] = len;
  }
  // The CYC row, copied as int words (two per u64).
  if (lane < 2 * CYC_WORDS) out[RES_CYCLES + lane] = ((const int*)(cyc + (long long)b * CYC_WORDS))[lane];
}
#else
// Results of wide nodes (every game folder's, whatever its NUM_ACTIONS): as above, lane l
// taking edges l, l + 32, ...; each lane keeps its best edge by (visits, then
// Q = W / n in float64, then the lower index), then a 32-lane butterfly.
extern "C" __global__ void finish_trees(unsigned char* pool, long long cap, int n_trees, const int* tsa,
                                        const u64* cyc, int* res) {
  const long long gw = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (gw >= n_trees) return;
  const int b = (int)gw, lane = threadIdx.x & 31;
  const TreeView t = tree_view(pool, cap, b);
  int* out = res + (long long)b * RES_WORDS;
  const int* ts = tsa + (long long)b * TS_WORDS;
  unsigned char* outcome = (unsigned char*)(out + RES_OUTCOME);
  for (int a = lane; a < NUM_ACTIONS; a += 32) {
    const int4 r = __ldcg(t.rows + a);
    const int ch = __ldcg(t.child + a);
    out[RES_VISITS + a] = r.x;
    out[RES_VALUE_SUM + a] = r.z;
    outcome[1 + a] = (unsigned char)(ch >= 0 ? __ldcg(node_code(t, ch)) : NOT_TERMINAL);
  }
  if (lane == 0) {
    const int4 h = __ldcg(t.rows + HEADER);
    out[RES_ROOT_VISITS] = h.x;
    outcome[0] = (unsigned char)h.y;
  }
  int node = 0, len = 0;
  for (int step = 0; step < MAX_DEPTH; ++step) {
    int vis = -1, best = lane;
    double q = 0.0;
    for (int a = lane; a < NUM_ACTIONS; a += 32) {
      const int4 r = __ldcg(t.rows + (long long)node * ROW + a);
      const double qa = r.x > 0 ? (double)__int_as_float(r.z) / (double)r.x : 0.0;
      if (r.x > vis || (r.x == vis && qa > q)) {
        vis = r.x;
        q = qa;
        best = a;
      }
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
      const int ov = __shfl_xor_sync(FULL_MASK, vis, off);
      const double oq = __shfl_xor_sync(FULL_MASK, q, off);
      const int ob = __shfl_xor_sync(FULL_MASK, best, off);
      if (ov > vis || (ov == vis && (oq > q || (oq == q && ob < best)))) {
        vis = ov;
        q = oq;
        best = ob;
      }
    }
    best = __shfl_sync(FULL_MASK, best, 0);
    vis = __shfl_sync(FULL_MASK, vis, 0);
    if (vis <= 0) break;
    if (lane == 0) out[RES_PV + len] = best;
    ++len;
    const int c = __ldcg(t.child + (long long)node * ROW + best);
    if (c < 0) break;
    node = c;
  }
  if (lane == 0) {
    out[RES_NODES] = ts[TS_NODES];
    out[RES_MAX_DEPTH] = ts[TS_MAX_DEPTH];
    out[RES_DONE] = ts[TS_DONE];
    out[RES_EXHAUSTED] = ts[TS_EXHAUSTED];
    out[RES_DEADLINE] = ts[TS_DEADLINE];
    out[RES_PV_LENGTH] = len;
  }
  if (lane < 2 * CYC_WORDS) out[RES_CYCLES + lane] = ((const int*)(cyc + (long long)b * CYC_WORDS))[lane];
}
#endif
