// expand.cu -- node creation: one node per distinct edge where a warp's
// simulations stopped, slots claimed with ONE atomicAdd per wave.

// Writes a fresh node (no visits; uniform prior over legal moves, as
// tree.init_edges) into slot s. Called by one lane, before the node is
// published (atomicExch on its parent's child entry, after __threadfence).
__device__ void init_node(const TreeView& t, int s, u64 cur, u64 mask, int term, int parent, int action) {
  int legal[NUM_ACTIONS];
  int n_legal = 0;
#pragma unroll
  for (int a = 0; a < NUM_ACTIONS; ++a) {
    legal[a] = term == NOT_TERMINAL && !(mask & C4_TOP(a));
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
  ((ulonglong2*)t.pos)[s] = make_ulonglong2(cur, mask);
}

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
__device__ int expand_leaves(const TreeView& t, int* ts, int limit, int lane, bool missing, int key, u64 cur,
                             u64 mask, int term, int& leader) {
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
    if (won) {
      const int s = base + rank;
      if (s < limit) {
        init_node(t, s, cur, mask, term, key / ROW, key % ROW);
        __threadfence();
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
// without a node gets the position behind that edge (cur, msk) and its
// terminal code (term), and expands it (expand_leaves); one that stopped at
// an existing finished node gets that node and its code. Returns the leaf's
// slot (-1: refused by the pool, or an inactive lane); `leader` is the lane
// that evaluates the leaf (the lowest stopping at the same edge).
__device__ __forceinline__ int expand_wave(const TreeView& t, int* ts, int limit, int lane, int g, const Descent& mine,
                                           u64& cur, u64& msk, int& term, int& leader) {
  const bool active = lane < g;
  const bool missing = active && mine.tnode < 0;
  cur = 0;
  msk = 0;
  term = mine.tcode;
  if (missing) {
    const ulonglong2 pp = __ldcg((const ulonglong2*)t.pos + mine.node);
    cur = pp.x;
    msk = pp.y;
    play_column(cur, msk, mine.action);
    term = terminal_code(cur, msk);
  }
  int leaf = expand_leaves(t, ts, limit, lane, missing, mine.node * ROW + mine.action, cur, msk, term, leader);
  if (active && !missing) leaf = mine.tnode;
  return leaf;
}
