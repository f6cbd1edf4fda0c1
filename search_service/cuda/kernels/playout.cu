// playout.cu -- the conformance kit's GPU half (search_service/games/conformance.py):
// random games played with a module's device rules, every step recorded for
// the host to replay with the NumPy rules and compare bit for bit.

#define STREAM_PLAYOUT 1u  // Philox counter word 3 of the playouts (rollouts use STREAM_ROLLOUT)

// The state words of a position (Connect Four: current, mask; a folder: its words).
__device__ __forceinline__ void state_words_out(const GameState& s, u64* out) {
#if GAME_VALUE_MODEL
  out[0] = s.cur;
  out[1] = s.mask;
#else
#pragma unroll
  for (int i = 0; i < STATE_WORDS; ++i) out[i] = s.w[i];
#endif
}

// One thread per game g < n_games, from the starting state, at most
// max_plies plies (P): ply i plays the (word % n)-th of the n legal actions,
// word i % 4 of philox((g, 0, i / 4, STREAM_PLAYOUT), (k0, k1)). Outputs
// (row g of each): states u64 [n][P + 1][POS_WORDS] (state i: before ply i),
// legal u32 [n][P + 1][MASK_WORDS], over uint8 [n][P + 1] (game_is_terminal),
// returns float [n][P + 1] (game_returns), actions int [n][P], terminal uint8
// [n][P] and reward float [n][P] (game_step's), plies int [n] (plies played:
// the game ended there, or no action was legal, or P was reached).
// Each thread writes its own rows only: no shared state.
extern "C" __global__ void game_playouts(int n_games, int max_plies, u32 k0, u32 k1, u64* states, u32* legal,
                                         unsigned char* over, float* returns, int* actions,
                                         unsigned char* terminal, float* reward, int* plies) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= n_games) return;
  const long long P = max_plies;
  GameState s;
  game_initial(s);
  int i = 0;
  while (true) {
    const long long at = (long long)g * (P + 1) + i;
    state_words_out(s, states + at * POS_WORDS);
    u32* m = legal + at * MASK_WORDS;
    game_legal(s, m);
    over[at] = game_is_terminal(s) ? 1 : 0;
    returns[at] = game_returns(s);
    if (i == max_plies) break;
    u32 w[4];
    philox4x32_10((u32)g, 0u, (u32)i / 4u, STREAM_PLAYOUT, k0, k1, w[0], w[1], w[2], w[3]);
    const int a = kth_legal<MASK_WORDS>(m, w[i % 4]);
    if (a < 0) break;
    float r;
    const bool end = game_step(s, a, r);
    actions[(long long)g * P + i] = a;
    terminal[(long long)g * P + i] = end ? 1 : 0;
    reward[(long long)g * P + i] = r;
    ++i;
    if (end) {
      const long long last = (long long)g * (P + 1) + i;
      state_words_out(s, states + last * POS_WORDS);
      game_legal(s, legal + last * MASK_WORDS);
      over[last] = game_is_terminal(s) ? 1 : 0;
      returns[last] = game_returns(s);
      break;
    }
  }
  plies[g] = i;
}
