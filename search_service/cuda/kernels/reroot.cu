// reroot.cu -- tree reuse: device-side compaction of the subtree below the
// node that the played moves reach, renumbered breadth-first (root = slot 0,
// then level by level, within a level by parent then action), exactly the
// order of tree.reroot on the CPU, so a re-rooted tree is the same whichever
// backend built it.

// Inclusive prefix sum over a block (blockDim.x a multiple of 32, <= 1024);
// *total gets the block's sum. Uses `wsum` (32 ints of shared memory).
__device__ int block_inclusive_scan(int x, int* wsum, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(FULL_MASK, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) wsum[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < n_warps ? wsum[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(FULL_MASK, s, off);
      if (lane >= off) s += y;
    }
    wsum[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  const int before = warp ? wsum[warp - 1] : 0;
  *total = wsum[n_warps - 1];
  __syncthreads();  // wsum is reused by the next call
  return x + before;
}

// One block. Walks `actions` (0-based) from the root of the tree at `pool`
// (`cap` slots); out[0] = nodes in the subtree there (0: not in the tree),
// out[1] = its old slot. order[n] = old slot of new node n; remap[old] = n.
extern "C" __global__ void reroot_bfs(unsigned char* pool, long long cap, const int* actions, int n_actions,
                                      int* order, int* remap, int* out) {
  __shared__ int s_node;
  __shared__ int wsum[32];
  const TreeView t = tree_view(pool, cap, 0);
  if (threadIdx.x == 0) {
    int node = 0;
    for (int i = 0; i < n_actions && node >= 0; ++i) {
      const int a = actions[i];
      node = (a < 0 || a >= NUM_ACTIONS) ? -1 : t.child[node * ROW + a];
      if (node < 0) node = -1;
    }
    s_node = node;
    if (node >= 0) {
      order[0] = node;
      remap[node] = 0;
      out[1] = node;
    } else {
      out[0] = 0;
      out[1] = -1;
    }
  }
  __syncthreads();
  if (s_node < 0) return;
  int lo = 0, hi = 1;
  while (lo < hi) {
    int next = hi;
    for (int base = lo; base < hi; base += blockDim.x) {
      const int i = base + threadIdx.x;
      const int u = i < hi ? order[i] : -1;
      int kids[NUM_ACTIONS];
      int cnt = 0;
#pragma unroll
      for (int a = 0; a < NUM_ACTIONS; ++a) {
        kids[a] = u >= 0 ? t.child[(long long)u * ROW + a] : -1;
        cnt += kids[a] >= 0;
      }
      int total;
      int at = next + block_inclusive_scan(cnt, wsum, &total) - cnt;
#pragma unroll
      for (int a = 0; a < NUM_ACTIONS; ++a) {
        if (kids[a] >= 0) {
          order[at] = kids[a];
          remap[kids[a]] = at;
          ++at;
        }
      }
      next += total;
    }
    __syncthreads();  // this level's order[] entries are read by the next level
    lo = hi;
    hi = next;
  }
  if (threadIdx.x == 0) out[0] = hi;
}

// Copies the subtree into a fresh pool of dst_cap slots with the new numbering,
// virtual losses cleared (they are 0 between searches anyway); the new root has
// no parent and no action. One thread per new node; out[0] bounds the work.
extern "C" __global__ void reroot_copy(unsigned char* src, long long src_cap, unsigned char* dst, long long dst_cap,
                                       const int* order, const int* remap, const int* out) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= out[0]) return;
  const int old = order[n];
  const TreeView s = tree_view(src, src_cap, 0);
  const TreeView d = tree_view(dst, dst_cap, 0);
#pragma unroll
  for (int a = 0; a < NUM_ACTIONS; ++a) {
    int4 r = s.rows[(long long)old * ROW + a];
    r.y = 0;
    d.rows[(long long)n * ROW + a] = r;
  }
  int4 h = s.rows[(long long)old * ROW + HEADER];
  if (n == 0) {
    h.z = -1;
    h.w = -1;
  } else {
    h.z = remap[h.z];
  }
  d.rows[(long long)n * ROW + HEADER] = h;
#pragma unroll
  for (int a = 0; a < ROW; ++a) {
    const int c = s.child[(long long)old * ROW + a];
    d.child[(long long)n * ROW + a] = c >= 0 ? remap[c] : c;
  }
  copy_state(d, n, s, old);
}
