// cuda_emu.h -- the CUDA features tandem's kernels use, emulated on the CPU
// (tests/cuda_emulation/README.md): the kernels' source compiles as C++ with
// g++ behind this header, each thread of a block runs as a std::thread, and
// a warp collective (__shfl_sync, __ballot_sync, __match_any_sync, ...) is a
// rendezvous of the lanes its mask names. What it checks: index arithmetic,
// record layouts, launch arguments, warp-uniform control flow (lanes that
// take different branches before a collective hang, as they may on a GPU),
// 16-byte alignment of int4 loads and 8-byte alignment of 64-bit atomics.
// What it does not: the GPU's memory model (every atomic here is sequentially
// consistent), timing, NVRTC's dialect, registers and shared-memory limits.
#pragma once
#include <math.h>

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __align__(n) alignas(n)
#define __shared__ static thread_local  // per thread, not per block: only for kernels never launched here

struct dim3e {
  unsigned x = 0, y = 0, z = 0;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(16) ulonglong2 {
  unsigned long long x, y;
};
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline ulonglong2 make_ulonglong2(unsigned long long x, unsigned long long y) { return ulonglong2{x, y}; }

namespace emu {
struct Warp;
struct Block;
extern thread_local dim3e tl_thread, tl_block, tl_bdim, tl_gdim;
extern thread_local Warp* tl_warp;
extern thread_local Block* tl_blk;
extern thread_local unsigned char* tl_smem;  // the block's dynamic shared memory
extern thread_local long long tl_clock;
[[noreturn]] void trap(const char* why);

// One rendezvous of the lanes of a mask: their values (and a per-lane
// argument, e.g. a shuffle's source lane) in, their results out.
struct Round {
  int arrived = 0, left = 0;
  unsigned long long gen = 0;
  unsigned long long vals[32];
  unsigned long long aux[32];
  unsigned long long res[32];
};
struct Warp {
  std::mutex m;
  std::condition_variable cv;
  std::map<unsigned, Round> rounds;  // by mask: lanes outside a partial mask meet elsewhere
};
struct Block {
  std::mutex m;
  std::condition_variable cv;
  int n = 0, arrived = 0;  // threads still running, threads at the barrier
  unsigned long long gen = 0;
};

inline int lane_id() { return (int)(tl_thread.x & 31); }

// A warp collective: every lane of `mask` calls it with its value `v` and
// argument `aux`; `f(mask, vals, auxs, results)` runs once, in the last lane
// to arrive, and each lane gets its result. A lane outside `mask` is an error.
template <class F>
unsigned long long collective(unsigned mask, unsigned long long v, F f, unsigned long long aux = 0) {
  const int lane = lane_id();
  if (!((mask >> lane) & 1u)) trap("a lane called a collective outside its mask");
  Warp* w = tl_warp;
  std::unique_lock<std::mutex> lk(w->m);
  Round& r = w->rounds[mask];
  w->cv.wait(lk, [&] { return r.left == 0; });  // the previous round of this mask is collected
  r.vals[lane] = v;
  r.aux[lane] = aux;
  const unsigned long long my = r.gen;
  if (++r.arrived == __builtin_popcount(mask)) {
    f(mask, r.vals, r.aux, r.res);
    r.arrived = 0;
    r.left = __builtin_popcount(mask);
    ++r.gen;
    w->cv.notify_all();
  } else {
    w->cv.wait(lk, [&] { return r.gen != my; });
  }
  const unsigned long long out = r.res[lane];
  if (--r.left == 0) w->cv.notify_all();
  return out;
}

template <class T>
unsigned long long bits(T v) {
  unsigned long long u = 0;
  memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
T unbits(unsigned long long u) {
  T v;
  memcpy(&v, &u, sizeof(T));
  return v;
}

// Runs `body` in every thread of `grid` blocks of `block` threads, one block
// at a time, with `smem` bytes of dynamic shared memory per block.
void run_grid(dim3e grid, dim3e block, size_t smem, std::function<void()> body);
}  // namespace emu

#define threadIdx (emu::tl_thread)
#define blockIdx (emu::tl_block)
#define blockDim (emu::tl_bdim)
#define gridDim (emu::tl_gdim)

template <class T>
inline T __ldcg(const T* p) {
  T v;
  __atomic_load(p, &v, __ATOMIC_RELAXED);
  return v;
}
inline int4 __ldcg(const int4* p) {
  if (((uintptr_t)p) & 15) emu::trap("a misaligned int4 load");
  return int4{__ldcg(&p->x), __ldcg(&p->y), __ldcg(&p->z), __ldcg(&p->w)};
}
inline ulonglong2 __ldcg(const ulonglong2* p) {
  if (((uintptr_t)p) & 15) emu::trap("a misaligned ulonglong2 load");
  return ulonglong2{__ldcg(&p->x), __ldcg(&p->y)};
}
template <class T>
inline T __ldg(const T* p) {
  return *p;
}

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::collective(mask, 0, [](unsigned, unsigned long long*, unsigned long long*, unsigned long long*) {});
}
void __syncthreads();
[[noreturn]] inline void __trap() { emu::trap("__trap()"); }

inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  if (((uintptr_t)p) & 7) emu::trap("a misaligned 64-bit atomic");
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* p, float v) {
  unsigned* u = (unsigned*)p;
  unsigned old = __atomic_load_n(u, __ATOMIC_SEQ_CST), nw;
  do {
    float f;
    memcpy(&f, &old, 4);
    f += v;
    memcpy(&nw, &f, 4);
  } while (!__atomic_compare_exchange_n(u, &old, nw, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  float r;
  memcpy(&r, &old, 4);
  return r;
}
inline int atomicCAS(int* p, int cmp, int v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long cmp, unsigned long long v) {
  if (((uintptr_t)p) & 7) emu::trap("a misaligned 64-bit atomic");
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline int atomicMax(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline float __int_as_float(int i) { return emu::unbits<float>((unsigned)i); }
inline int __float_as_int(float f) { return (int)(unsigned)emu::bits(f); }
inline double __longlong_as_double(long long i) { return emu::unbits<double>((unsigned long long)i); }
inline long long clock64() { return ++emu::tl_clock; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }

// Shuffles: the source lane, lane mask or delta, and the width may differ per
// lane, so each lane passes its own (aux: width << 32 | argument).
template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const unsigned long long aux = ((unsigned long long)(unsigned)width << 32) | (unsigned)src;
  auto f = [](unsigned m, unsigned long long* in, unsigned long long* ax, unsigned long long* out) {
    for (int l = 0; l < 32; ++l) {
      if (!((m >> l) & 1u)) continue;
      const int w = (int)(ax[l] >> 32), s = (l & ~(w - 1)) + ((int)(unsigned)ax[l] & (w - 1));
      if (!((m >> s) & 1u)) emu::trap("a shuffle from a lane outside the mask");
      out[l] = in[s];
    }
  };
  return emu::unbits<T>(emu::collective(mask, emu::bits(v), f, aux));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int x, int width = 32) {
  const unsigned long long aux = ((unsigned long long)(unsigned)width << 32) | (unsigned)x;
  auto f = [](unsigned m, unsigned long long* in, unsigned long long* ax, unsigned long long* out) {
    for (int l = 0; l < 32; ++l) {
      if (!((m >> l) & 1u)) continue;
      const int w = (int)(ax[l] >> 32), s = l ^ (int)(unsigned)ax[l];
      out[l] = ((s & ~(w - 1)) == (l & ~(w - 1))) ? in[s] : in[l];
    }
  };
  return emu::unbits<T>(emu::collective(mask, emu::bits(v), f, aux));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  const unsigned long long aux = ((unsigned long long)(unsigned)width << 32) | d;
  auto f = [](unsigned m, unsigned long long* in, unsigned long long* ax, unsigned long long* out) {
    for (int l = 0; l < 32; ++l) {
      if (!((m >> l) & 1u)) continue;
      const int w = (int)(ax[l] >> 32), s = l - (int)(unsigned)ax[l];
      out[l] = (s >= (l & ~(w - 1))) ? in[s] : in[l];
    }
  };
  return emu::unbits<T>(emu::collective(mask, emu::bits(v), f, aux));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  auto f = [](unsigned m, unsigned long long* in, unsigned long long*, unsigned long long* out) {
    unsigned b = 0;
    for (int l = 0; l < 32; ++l)
      if (((m >> l) & 1u) && in[l]) b |= 1u << l;
    for (int l = 0; l < 32; ++l) out[l] = b;
  };
  return (unsigned)emu::collective(mask, pred ? 1 : 0, f);
}
template <class T>
unsigned __match_any_sync(unsigned mask, T v) {
  auto f = [](unsigned m, unsigned long long* in, unsigned long long*, unsigned long long* out) {
    for (int l = 0; l < 32; ++l) {
      if (!((m >> l) & 1u)) continue;
      unsigned b = 0;
      for (int k = 0; k < 32; ++k)
        if (((m >> k) & 1u) && in[k] == in[l]) b |= 1u << k;
      out[l] = b;
    }
  };
  return (unsigned)emu::collective(mask, emu::bits(v), f);
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  auto f = [](unsigned m, unsigned long long* in, unsigned long long*, unsigned long long* out) {
    unsigned s = 0;
    for (int l = 0; l < 32; ++l)
      if ((m >> l) & 1u) s += (unsigned)in[l];
    for (int l = 0; l < 32; ++l) out[l] = s;
  };
  return (unsigned)emu::collective(mask, v, f);
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
  auto f = [](unsigned m, unsigned long long* in, unsigned long long*, unsigned long long* out) {
    unsigned s = 0;
    for (int l = 0; l < 32; ++l)
      if (((m >> l) & 1u) && (unsigned)in[l] > s) s = (unsigned)in[l];
    for (int l = 0; l < 32; ++l) out[l] = s;
  };
  return (unsigned)emu::collective(mask, v, f);
}
