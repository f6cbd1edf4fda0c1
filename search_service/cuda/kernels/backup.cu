// backup.cu -- the two backup strategies (negamax signs: the value is for the
// leaf's side to move; the edge at depth d of a path of length D gains it
// when D - d is even and loses it when odd).
//
// Every update is an atomic in global memory, so backups of different warps
// and concurrent selections interleave safely: an edge gets visits += k and
// vloss -= k in one 64-bit atomicAdd, value_sum += sum in one float
// atomicAdd, and its node's N += k in one int atomicAdd. vloss returns to 0
// once every simulation that added one has backed up.
//
//  * global_atomic (AGG = 0): each simulation's lane walks its own path and
//    issues 3 atomics per edge, plus one for its leaf node.
//  * warp_aggregated (AGG = 1): with several simulations per warp, the lanes
//    group by edge at each depth (__match_any_sync); the lowest lane of a
//    group sums the group's signed values (in lane order, from shared memory)
//    and issues the 3 atomics once for the group -- the root edge of a wave
//    of 32 simulations is one update instead of 32. With one simulation per
//    warp there is nothing to combine; its path is then split over the lanes
//    (lane l updates depths l and l + 32) so the whole path's atomics issue at once.

// The known-result word of node `node`'s header (HEAD_TERMINAL).
__device__ __forceinline__ int* node_code(const TreeView& t, int node) {
  return (int*)(t.rows + (long long)node * ROW + HEADER) + HEAD_TERMINAL;
}

// MCTS-Solver (Winands, Bjornsson & Saito 2008) at one node: what its
// children's known results prove of it -- PROVEN_WIN if a child's side to
// move has lost, else, once every legal child's result is known, the best of
// them for the node; NOT_TERMINAL otherwise (the CPU reference's tree.solve).
__device__ int solve_node(const TreeView& t, int node) {
  bool known = true, any = false;
  float best = -2.0f;
  for (int a = 0; a < NUM_ACTIONS; ++a) {
    const int c = __ldcg(t.child + (long long)node * ROW + a);
    if (c == ILLEGAL) continue;
    any = true;
    const int code = c >= 0 ? __ldcg(node_code(t, c)) : NOT_TERMINAL;
    if (code == NOT_TERMINAL) {
      known = false;
      continue;
    }
    const float mine = -outcome_value(code);
    if (mine > 0.0f) return PROVEN_WIN;
    best = fmaxf(best, mine);
  }
  if (!known || !any) return NOT_TERMINAL;
  return best < 0.0f ? PROVEN_LOSS : PROVEN_DRAW;
}

// The solver's pass after a wave's backup: a simulation whose leaf has a
// known result proves what it can up its path, deepest node first, and stops
// at the first node it cannot prove (nothing above it changed). Lane i < g
// holds simulation i (its path at path + i * MAX_DEPTH, its depth and leaf
// code). The warp's simulations take turns, in simulation order, so each
// sees the codes the earlier ones wrote: with one warp per tree the tree
// reaches the CPU reference's fixpoint (it solves every path after the wave).
__device__ void solve_wave(const TreeView& t, const int* path, int lane, int g, int depth, int leaf_code) {
  __threadfence();
  __syncwarp();
  for (int i = 0; i < g; ++i) {
    if (lane == i && leaf_code != NOT_TERMINAL) {
      const int* p = path + i * MAX_DEPTH;
      for (int d = depth - 1; d >= 0; --d) {
        const int node = p[d] / ROW;
        if (__ldcg(node_code(t, node)) != NOT_TERMINAL) break;  // proven already, by another warp
        const int proven = solve_node(t, node);
        if (proven == NOT_TERMINAL) break;
        *(volatile int*)node_code(t, node) = proven;
        __threadfence();
      }
    }
    __syncwarp();
  }
}

// The N word of node `node`'s header (backup's atomicAdd target).
__device__ __forceinline__ int* node_visits(const TreeView& t, int node) {
  return (int*)(t.rows + (long long)node * ROW + HEADER) + HEAD_VISITS;
}

__device__ __forceinline__ void edge_update(const TreeView& t, int e, int count, float value) {
  int4* rec = t.rows + e;
  atomicAdd((unsigned long long*)rec, (u64)count - ((u64)count << 32));
  atomicAdd((float*)rec + EDGE_VALUE_SUM, value);
  atomicAdd((int*)(t.rows + ROW_START(e) + HEADER) + HEAD_VISITS, count);  // the row's header: N
}

// Lane i < g holds simulation i: its path (path + i * MAX_DEPTH, written by
// select_one), its depth, its leaf value and its leaf slot (-1: none).
// `vals`/`deps` are 32-entry shared scratch of the warp.
template <int AGG>
__device__ void backup_wave(const TreeView& t, int* ts, const int* path, float* vals, int* deps, int lane, int g,
                            int depth, float v, int leaf) {
  const bool active = lane < g;
  if (AGG == 0) {
    if (active) {
      const int* p = path + lane * MAX_DEPTH;
      for (int d = 0; d < depth; ++d) edge_update(t, p[d], 1, ((depth - d) & 1) ? -v : v);
      if (leaf >= 0) atomicAdd(node_visits(t, leaf), 1);
      atomicMax(ts + TS_MAX_DEPTH, depth);
    }
  } else if (g == 1) {
    const int dd = __shfl_sync(FULL_MASK, depth, 0);
    const float v0 = __shfl_sync(FULL_MASK, v, 0);
    for (int d = lane; d < dd; d += 32) edge_update(t, path[d], 1, ((dd - d) & 1) ? -v0 : v0);
    if (lane == 0) {
      if (leaf >= 0) atomicAdd(node_visits(t, leaf), 1);
      atomicMax(ts + TS_MAX_DEPTH, depth);
    }
  } else {
    vals[lane] = v;
    deps[lane] = active ? depth : 0;
    __syncwarp();
    const int max_d = (int)__reduce_max_sync(FULL_MASK, active ? (u32)depth : 0u);
    for (int d = 0; d < max_d; ++d) {
      const bool on = active && d < depth;
      const unsigned am = __ballot_sync(FULL_MASK, on);
      if (on) {
        const int e = path[lane * MAX_DEPTH + d];
        const unsigned peers = __match_any_sync(am, e);
        if (lane == __ffs(peers) - 1) {
          float sum = 0.0f;
          for (unsigned m = peers; m; m &= m - 1) {
            const int j = __ffs(m) - 1;
            sum += ((deps[j] - d) & 1) ? -vals[j] : vals[j];
          }
          edge_update(t, e, __popc(peers), sum);
        }
      }
    }
    const bool has_leaf = active && leaf >= 0;
    const unsigned lm = __ballot_sync(FULL_MASK, has_leaf);
    if (has_leaf) {
      const unsigned peers = __match_any_sync(lm, leaf);
      if (lane == __ffs(peers) - 1) atomicAdd(node_visits(t, leaf), __popc(peers));
    }
    if (lane == 0) atomicMax(ts + TS_MAX_DEPTH, max_d);
    __syncwarp();
  }
}
