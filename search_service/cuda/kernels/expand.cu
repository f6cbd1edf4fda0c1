// expand.cu -- node creation: one node per distinct edge where a warp's
// simulations stopped, slots claimed with ONE atomicAdd per wave. The game
// module writes a node (init_node: one lane, Connect Four's 7 edges;
// init_node_warp: the whole warp, a game folder's wide nodes).

// Expansion for a warp's wave. Lane i (a simulation) passes missing = it
// stopped at an edge without a node, that edge's key (node * 8 + action) and
// the leaf position it leads to. Returns the leaf's slot, or -1 when the pool
// refused it (the leaf is then evaluated without a node: pool exhausted);
// `leader` gets the lane that leads the lane's key (itself if not missing).
//
// Protocol (who writes what):
//  1. Lanes with the same key share one node (the CPU reference's rule for
//     simulations of one wave that stop at one edge); the lowest such lane
//     leads and claims the edge: atomicCAS(child, UNEXPANDED -> EXPANDING).
//     Exactly one claimant in the whole grid wins an edge.
//  2. The winners of the warp get consecutive slots from ONE
//     atomicAdd(TS_NODES, winners), assigned in key order (= the CPU
//     reference's slot order for a wave: parent slot, then action).
//  3. A winner whose slot is < limit writes the node, __threadfence()s, then
//     publishes the slot with atomicExch(child). A refused winner puts
//     UNEXPANDED back and sets TS_EXHAUSTED. Slots >= limit are never written.
//  4. Only then does a leader that lost to another warp (it saw EXPANDING)
//     spin until that warp publishes. Every warp publishes its own claims
//     before it waits on others', so waits never form a cycle; the awaited
//     warp is running (it made the claim), so the spin ends.
//  5. Followers take their leader's slot.
__device__ int expand_leaves(const TreeView& t, int* ts, int limit, int lane, bool missing, int key,
                             const GameState& st, int term, int& leader) {
  const unsigned mm = __ballot_sync(FULL_MASK, missing);
  leader = lane;
  if (missing) leader = __ffs(__match_any_sync(mm, key)) - 1;
  const bool lead = missing && leader == lane;
  int old = 0;
  if (lead) old = atomicCAS(t.child + key, UNEXPANDED, EXPANDING);
  const bool won = lead && old == UNEXPANDED;
  const unsigned wm = __ballot_sync(FULL_MASK, won);
  int slot = -1;
  if (wm) {
    int rank = 0;
    for (unsigned m = wm; m; m &= m - 1) {
      const int kj = __shfl_sync(FULL_MASK, key, __ffs(m) - 1);
      rank += kj < key;
    }
    int base = 0;
    if (lane == 0) base = atomicAdd(ts + TS_NODES, __popc(wm));
    base = __shfl_sync(FULL_MASK, base, 0);
#if GAME_WARP_INIT
    // Wide nodes: the whole warp writes each winner's node (init_node_warp),
    // every lane fences its own stores, and the __syncwarp orders those
    // fences before the winner's publication.
    for (unsigned m = wm; m; m &= m - 1) {
      const int j = __ffs(m) - 1;
      const int sj = __shfl_sync(FULL_MASK, base + rank, j);
      const int kj = __shfl_sync(FULL_MASK, key, j);
      const int tj = __shfl_sync(FULL_MASK, term, j);
      const GameState stj = shfl_state(st, j);
      if (sj < limit) init_node_warp(t, sj, stj, tj, kj / ROW, kj % ROW, lane);
    }
    __threadfence();
    __syncwarp();
#endif
    if (won) {
      const int s = base + rank;
      if (s < limit) {
#if !GAME_WARP_INIT  // narrow nodes: each winner writes its own, fenced before its publication
        init_node(t, s, st, term, key / ROW, key % ROW);
        __threadfence();
#endif
        atomicExch(t.child + key, s);
        slot = s;
      } else {
        atomicExch(t.child + key, UNEXPANDED);
        ts[TS_EXHAUSTED] = 1;
      }
    }
  }
  __syncwarp();
  if (lead && !won) {
    int c = old;
    while (c == EXPANDING) c = *(volatile int*)(t.child + key);
    __threadfence();
    slot = c >= 0 ? c : -1;
  }
  const int got = __shfl_sync(FULL_MASK, slot, leader);
  return missing ? got : -1;
}

// The expansion step of a wave, after select_wave (`mine`: the lane's
// Descent; lanes < g are active). An active lane that stopped at an edge
// without a node gets the position behind that edge (st) and its
// terminal code (term), and expands it (expand_leaves); one that stopped at
// an existing finished node gets that node and its code. Returns the leaf's
// slot (-1: refused by the pool, or an inactive lane); `leader` is the lane
// that evaluates the leaf (the lowest stopping at the same edge).
__device__ __forceinline__ int expand_wave(const TreeView& t, int* ts, int limit, int lane, int g, const Descent& mine,
                                           GameState& st, int& term, int& leader) {
  const bool active = lane < g;
  const bool missing = active && mine.tnode < 0;
  st = GameState{};
  term = mine.tcode;
  if (missing) {
    st = load_state(t, mine.node);
    term = play_code(st, mine.action);
  }
  int leaf = expand_leaves(t, ts, limit, lane, missing, mine.node * ROW + mine.action, st, term, leader);
  if (active && !missing) leaf = mine.tnode;
  return leaf;
}
