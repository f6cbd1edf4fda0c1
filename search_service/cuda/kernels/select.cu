// select.cu -- edge scores and the warp-cooperative descent of one simulation.
//
// Scores (float64, evaluated in exactly the order cpu_reference.py documents,
// with no fused multiply-add): n = visits, j = virtual losses on the edge,
// W = value sum, ne = n + j, Q = (W - vl * j) / max(ne, 1), N = the node's
// visits plus its edges' virtual losses;
//   UCT  (Kocsis & Szepesvari 2006): +inf if ne == 0, else Q + scale(N) * (1 / sqrt(max(ne, 1)))
//        with scale(N) = c_uct * sqrt(ln max(N, 1)) read from a table the host
//        computes with NumPy (bit-identical logarithms), computed here past it;
//   PUCT (Silver et al. 2017): Q + sqrt(N) * ((c_puct * P) / (1 + ne));
// illegal edges -inf; ties to the lowest index. Virtual loss: Chaslot,
// Winands & van den Herik 2008.

HD double uct_score(int n, int j, float w, double vl, double scale) {
  const double ne = (double)n + (double)j;
  if (ne == 0.0) return pos_inf();
  const double q = ((double)w - vl * (double)j) / fmax(ne, 1.0);
  const double g = 1.0 / sqrt(fmax(ne, 1.0));
  return q + scale * g;
}

HD double puct_score(int n, int j, float w, float prior, double vl, double c_puct, double sqrt_parent) {
  const double ne = (double)n + (double)j;
  const double q = ((double)w - vl * (double)j) / fmax(ne, 1.0);
  const double g = (c_puct * (double)prior) / (1.0 + ne);
  return q + sqrt_parent * g;
}

struct SelectParams {
  int puct;               // 0 UCT (rollouts), 1 PUCT (value model)
  double c;               // c_uct or c_puct
  double vl;              // virtual_loss
  const double* scale;    // UCT: scale(N) for N < n_scale
  int n_scale;
};

// Where one descent stopped. `node`/`action` name its last edge; `tnode` is the
// existing terminal child it stopped at (then `tcode` is its code), or -1 when
// it stopped at an edge without a node (UNEXPANDED or EXPANDING).
struct Descent {
  int depth;
  int node;
  int action;
  int tnode;
  int tcode;
};

#if GAME_EIGHT_LANES  // Connect Four's 8-record rows; a game folder's wide nodes: the #else branch below
// One simulation's selection, run by the whole warp: lane e (mod 8) owns edge
// e of the node at hand, so the lane that adds an edge's virtual loss is the
// lane that reads that edge's record in the next selection (same thread, same
// address: program order makes the add visible). Lanes 8..31 mirror 0..7
// (same loads, same scores, possibly staler values: they did not add the
// virtual loss); nothing they compute is used -- the argmax is lane 0's group,
// the virtual-loss sum takes lanes 0..6, the header comes from lane 7.
// Writes the path (node * 8 + action per edge, root first) to path[0..depth)
// (lane 0 writes). Reads go through L2 (__ldcg): other warps update the tree.
// Concurrency: the records read here may be stale by the time the argmax is
// taken (other warps' backups and virtual losses land concurrently); this is
// the usual benign race of parallel MCTS -- each atomic itself is exact, and
// with one warp per tree (W = 1) there is no other writer at all.
__device__ Descent select_one(const TreeView& t, const SelectParams& sp, int* path, int lane) {
  const int e = lane & 7;
  int node = 0, d = 0;
  Descent out;
  out.tnode = -1;
  out.tcode = NOT_TERMINAL;
  out.node = 0;
  out.action = 0;
  while (true) {
    const int4 r = __ldcg(t.rows + node * ROW + e);
    const int ch = __ldcg(t.child + node * ROW + e);
    const int n_node = __shfl_sync(FULL_MASK, r.x, HEADER);
    const int term = __shfl_sync(FULL_MASK, r.y, HEADER);
    // An existing child with a known result (terminal or proven). Never the
    // root: a tree whose root is proven claims no more simulations, and one
    // claimed before another warp proved it descends as usual.
    if (node != 0 && term != NOT_TERMINAL) {
      out.tnode = node;
      out.tcode = term;
      break;
    }
    // N + the virtual losses on the node's edges: lanes 0..6 only (8..31 are mirrors).
    const int parent = n_node + (int)__reduce_add_sync(FULL_MASK, lane < NUM_ACTIONS ? (u32)r.y : 0u);
    double s = neg_inf();
    if (e < NUM_ACTIONS && ch != ILLEGAL) {
      if (sp.puct) {
        s = puct_score(r.x, r.y, __int_as_float(r.z), __int_as_float(r.w), sp.vl, sp.c, sqrt((double)parent));
      } else {
        const double scale = parent < sp.n_scale ? __ldg(sp.scale + parent) : sp.c * sqrt(log((double)parent));
        s = uct_score(r.x, r.y, __int_as_float(r.z), sp.vl, scale);
      }
    }
    // Argmax over the 8 lanes of each group (shfl_xor butterfly), ties to the lower edge.
    int best = e;
#pragma unroll
    for (int off = 4; off >= 1; off >>= 1) {
      const double os = __shfl_xor_sync(FULL_MASK, s, off, 8);
      const int ob = __shfl_xor_sync(FULL_MASK, best, off, 8);
      if (os > s || (os == s && ob < best)) {
        s = os;
        best = ob;
      }
    }
    best = __shfl_sync(FULL_MASK, best, 0);
    if (lane == best) atomicAdd((unsigned long long*)(t.rows + node * ROW + best), VLOSS_ONE);
    const int c = __shfl_sync(FULL_MASK, ch, best);
    if (lane == 0) path[d] = node * ROW + best;
    ++d;
    out.node = node;
    out.action = best;
    if (c < 0) break;  // UNEXPANDED or EXPANDING: the simulation stops at this edge
    if (d == MAX_DEPTH) __trap();  // impossible in a well-formed tree: 42 moves fill the board
    node = c;
  }
  out.depth = d;
  return out;
}
#else
#define EDGES_PER_LANE ((NUM_ACTIONS + 31) / 32)

// Wide nodes (every game folder's, whatever its NUM_ACTIONS): lane l owns edges l, l + 32,
// l + 64, ... of the node at hand -- it loads their records, scores them and
// adds the virtual loss to the one chosen among them, so again the lane that
// adds an edge's virtual loss is the lane that reads that edge next (same
// thread, same address). Each lane keeps its best edge (ties: the lower
// index, as it scans upwards), then a 32-lane butterfly takes the argmax
// (ties: the lower index), so the choice is the reference's: the first
// maximum. N (the node's visits plus its edges' virtual losses) is the
// header's visits plus a warp sum of the lanes' virtual losses. The header
// and the chosen child entry are lane 0's loads, shuffled to the warp: the
// loop's branches must be the same in every lane (warp-wide shuffles follow),
// and with W > 1 another warp's solver or expansion may write them between
// two lanes' loads. The same concurrency as above: reads through L2
// (__ldcg), possibly stale with W > 1, exact with one warp per tree.
__device__ Descent select_one(const TreeView& t, const SelectParams& sp, int* path, int lane) {
  int node = 0, d = 0;
  Descent out;
  out.tnode = -1;
  out.tcode = NOT_TERMINAL;
  out.node = 0;
  out.action = 0;
  while (true) {
    const int4* rows = t.rows + (long long)node * ROW;
    const int* child = t.child + (long long)node * ROW;
    const int4 h = __ldcg(rows + HEADER);
    const int n_node = __shfl_sync(FULL_MASK, h.x, 0), term = __shfl_sync(FULL_MASK, h.y, 0);
    if (node != 0 && term != NOT_TERMINAL) {  // an existing child with a known result (never the root)
      out.tnode = node;
      out.tcode = term;
      break;
    }
    // Checked here, not when the edge is taken: a finished node MAX_DEPTH edges down (a game
    // that lasts exactly max_moves plies) is a leaf, and only an unfinished one is impossible.
    if (d == MAX_DEPTH) __trap();
    int4 r[EDGES_PER_LANE];
    bool legal[EDGES_PER_LANE];
    u32 vl_sum = 0u;
#pragma unroll
    for (int i = 0; i < EDGES_PER_LANE; ++i) {
      const int a = lane + 32 * i;
      legal[i] = false;
      r[i] = make_int4(0, 0, 0, 0);
      if (a < NUM_ACTIONS) {
        r[i] = __ldcg(rows + a);
        legal[i] = __ldcg(child + a) != ILLEGAL;
        vl_sum += (u32)r[i].y;
      }
    }
    const int parent = n_node + (int)__reduce_add_sync(FULL_MASK, vl_sum);
    double scale = 0.0;
    if (!sp.puct) scale = parent < sp.n_scale ? __ldg(sp.scale + parent) : sp.c * sqrt(log((double)parent));
    double s = neg_inf();
    int best = lane;
#pragma unroll
    for (int i = 0; i < EDGES_PER_LANE; ++i) {
      if (!legal[i]) continue;
      const double si = sp.puct ? puct_score(r[i].x, r[i].y, __int_as_float(r[i].z), __int_as_float(r[i].w), sp.vl,
                                             sp.c, sqrt((double)parent))
                                : uct_score(r[i].x, r[i].y, __int_as_float(r[i].z), sp.vl, scale);
      if (si > s) {
        s = si;
        best = lane + 32 * i;
      }
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
      const double os = __shfl_xor_sync(FULL_MASK, s, off);
      const int ob = __shfl_xor_sync(FULL_MASK, best, off);
      if (os > s || (os == s && ob < best)) {
        s = os;
        best = ob;
      }
    }
    best = __shfl_sync(FULL_MASK, best, 0);
    if (lane == (best & 31)) atomicAdd((unsigned long long*)(rows + best), VLOSS_ONE);
    const int c = __shfl_sync(FULL_MASK, __ldcg(child + best), 0);
    if (lane == 0) path[d] = node * ROW + best;
    ++d;
    out.node = node;
    out.action = best;
    if (c < 0) break;  // UNEXPANDED or EXPANDING: the simulation stops at this edge
    node = c;
  }
  out.depth = d;
  return out;
}
#endif

// A warp's selections for one wave: simulation i < g descends after
// simulations 0..i-1 (so it sees their virtual losses), writing its path to
// path + i * MAX_DEPTH; lane i keeps simulation i's Descent, lanes >= g an
// empty one. The closing __syncwarp makes the paths visible to the warp.
__device__ __forceinline__ void select_wave(const TreeView& t, const SelectParams& sp, int* path, int lane, int g,
                                            Descent& mine) {
  mine.depth = 0;
  mine.node = 0;
  mine.action = 0;
  mine.tnode = -1;
  mine.tcode = NOT_TERMINAL;
  for (int i = 0; i < g; ++i) {
    const Descent dsc = select_one(t, sp, path + i * MAX_DEPTH, lane);
    if (lane == i) mine = dsc;
  }
  __syncwarp();
}
