// philox.cu -- Philox4x32-10 (Salmon, Moraes, Dror & Shaw, "Parallel random
// numbers: as easy as 1, 2, 3", SC 2011), bit for bit the generator of
// search_service/mcts/philox.py: the same round, the same key schedule, and
// the same counter layout for rollouts, (s, t, i / 4, STREAM_ROLLOUT), where
// s is the simulation's index within its tree in this call, t the tree's
// index in the batch and i the rollout move.

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define STREAM_ROLLOUT 0u

// out[0..3] = philox4x32_10((c0, c1, c2, c3), (k0, k1)).
HD void philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1, u32& o0, u32& o1, u32& o2, u32& o3) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += PHILOX_W0;
      k1 += PHILOX_W1;
    }
    const u64 p0 = (u64)PHILOX_M0 * c0;
    const u64 p1 = (u64)PHILOX_M1 * c2;
    const u32 n0 = (u32)(p1 >> 32) ^ c1 ^ k0;
    const u32 n1 = (u32)p1;
    const u32 n2 = (u32)(p0 >> 32) ^ c3 ^ k1;
    const u32 n3 = (u32)p0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
  }
  o0 = c0;
  o1 = c1;
  o2 = c2;
  o3 = c3;
}
