// cuda_emu.cpp -- the emulation's grid runner and block barrier (cuda_emu.h).
#include "cuda_emu.h"

namespace emu {
thread_local dim3e tl_thread, tl_block, tl_bdim, tl_gdim;
thread_local Warp* tl_warp;
thread_local Block* tl_blk;
thread_local unsigned char* tl_smem;
thread_local long long tl_clock;

void trap(const char* why) {
  fprintf(stderr, "cuda emulation: %s (block %u, thread %u)\n", why, tl_block.x, tl_thread.x);
  fflush(stderr);
  abort();
}

void run_grid(dim3e grid, dim3e block, size_t smem, std::function<void()> body) {
  if (block.x % 32) trap("a block size that is not a multiple of 32");
  for (unsigned b = 0; b < grid.x; ++b) {
    std::vector<unsigned char> mem(smem + 16, 0xCD);  // garbage, not zeros, like a GPU's
    unsigned char* base = (unsigned char*)(((uintptr_t)mem.data() + 15) & ~(uintptr_t)15);
    Block blk;
    blk.n = (int)block.x;
    std::vector<std::unique_ptr<Warp>> warps;
    for (unsigned w = 0; w < block.x / 32; ++w) warps.emplace_back(new Warp);
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
