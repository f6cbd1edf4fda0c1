// cuda_emu.cpp -- the emulation's grid runner and block barrier (cuda_emu.h).
#include "cuda_emu.h"

#include <atomic>
#include <chrono>

namespace emu {
thread_local dim3e tl_thread, tl_block, tl_bdim, tl_gdim;
thread_local Warp* tl_warp;
thread_local Block* tl_blk;
thread_local unsigned char* tl_smem;
thread_local long long tl_clock;
static thread_local long long tl_block_start;  // steady_clock ns when this thread's block started
static long long grid_start;                  // steady_clock ns when the running grid started

static long long steady_ns() {
  return (long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

static double clock_slowdown() {
  const char* s = getenv("EMU_CLOCK_SLOWDOWN");
  return s ? atof(s) : 100.0;
}

unsigned long long global_timer_ns() {
  static const double slowdown = clock_slowdown();
  return (unsigned long long)(grid_start + (long long)((double)(steady_ns() - tl_block_start) / slowdown));
}

void run_blocks(dim3e grid, dim3e block, size_t smem, std::function<void()>& body, std::atomic<unsigned>& current);

void trap(const char* why) {
  fprintf(stderr, "cuda emulation: %s (block %u, thread %u)\n", why, tl_block.x, tl_thread.x);
  fflush(stderr);
  abort();
}

// One grid at a time in the process: blocks run one after another, and
// launches from several host threads (ctypes lets go of the GIL) queue here.
static std::mutex grid_lock;

// A grid that runs longer than EMU_KERNEL_TIMEOUT_S seconds (default 600) is
// taken for a hang (a spin-wait on memory that nothing writes while the host
// waits for this launch, or lanes of a warp that branched apart before a
// collective): the process aborts with the kernel's block, not silently.
static double kernel_timeout_s() {
  const char* s = getenv("EMU_KERNEL_TIMEOUT_S");
  return s ? atof(s) : 600.0;
}

void run_grid(dim3e grid, dim3e block, size_t smem, std::function<void()> body) {
  if (block.x % 32 && block.x != 1) trap("a block size that is not a multiple of 32");
  std::lock_guard<std::mutex> one(grid_lock);
  grid_start = steady_ns();
  std::mutex wm;
  std::condition_variable wcv;
  bool over = false;
  std::atomic<unsigned> current{0};
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lk(wm);
    if (!wcv.wait_for(lk, std::chrono::duration<double>(kernel_timeout_s()), [&] { return over; })) {
      fprintf(stderr, "cuda emulation: a grid still running after %.0f s (block %u of %u): a hang\n",
              kernel_timeout_s(), current.load(), grid.x);
      fflush(stderr);
      abort();
    }
  });
  run_blocks(grid, block, smem, body, current);
  {
    std::lock_guard<std::mutex> lk(wm);
    over = true;
  }
  wcv.notify_all();
  watchdog.join();
}

void run_blocks(dim3e grid, dim3e block, size_t smem, std::function<void()>& body, std::atomic<unsigned>& current) {
  for (unsigned b = 0; b < grid.x; ++b) {
    current = b;
    const long long block_start = steady_ns();
    std::vector<unsigned char> mem(smem + 16, 0xCD);  // garbage, not zeros, like a GPU's
    unsigned char* base = (unsigned char*)(((uintptr_t)mem.data() + 15) & ~(uintptr_t)15);
    Block blk;
    blk.n = (int)block.x;
    std::vector<std::unique_ptr<Warp>> warps;
    for (unsigned w = 0; w < (block.x + 31) / 32; ++w) warps.emplace_back(new Warp);
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block.x; ++t) {
      threads.emplace_back([&, t] {
        tl_thread = {t, 0, 0};
        tl_block = {b, 0, 0};
        tl_bdim = block;
        tl_gdim = grid;
        tl_warp = warps[t / 32].get();
        tl_blk = &blk;
        tl_smem = base;
        tl_clock = 0;
        tl_block_start = block_start;
        body();
        // An exited thread no longer holds back the block's barrier.
        std::unique_lock<std::mutex> lk(blk.m);
        --blk.n;
        if (blk.arrived > 0 && blk.arrived >= blk.n) {
          blk.arrived = 0;
          ++blk.gen;
          blk.cv.notify_all();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
}
}  // namespace emu

void __syncthreads() {
  emu::Block* b = emu::tl_blk;
  std::unique_lock<std::mutex> lk(b->m);
  const unsigned long long my = b->gen;
  if (++b->arrived >= b->n) {
    b->arrived = 0;
    ++b->gen;
    b->cv.notify_all();
  } else {
    b->cv.wait(lk, [&] { return b->gen != my; });
  }
}
