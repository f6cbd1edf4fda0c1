// Gomoku's device rules (15x15, five or more in a row): rules.py's, bit for
// bit, against tandem's generated game.h (search_service/cuda/kernels/wide.cu
// describes the interface). State words: [0..3] the stones of the player to
// move (square r * 15 + c is bit (r * 15 + c) % 64 of word (r * 15 + c) / 64),
// [4..7] the opponent's, [8] flags: bit 0 the absolute player to move, bit 1
// the last move made a line (the game is over, won by the player who moved).

#define RULES_NUM_ACTIONS 225
#define RULES_STATE_WORDS 9
#define RULE __device__ __forceinline__

#define GM_SIZE 15
#define GM_SQUARES 225
#define GM_WON 2ull
#define GM_LAST_WORD 0x1FFFFFFFFull  // word 3's 33 board bits (225 = 3 * 64 + 33)

RULE u64 gm_board_word(int i) { return i < 3 ? ~0ull : GM_LAST_WORD; }

RULE bool gm_full(const u64* own, const u64* opp) {
  bool full = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) full = full && ((own[i] | opp[i]) == gm_board_word(i));
  return full;
}

RULE bool gm_stone(const u64* stones, int sq) { return (stones[sq >> 6] >> (sq & 63)) & 1ull; }

// Whether `stones` (the mover's, the stone on `sq` among them) hold five or
// more in a row through sq: along each direction, the stones next to sq
// without a gap, at most 4 each way (rules.py: _makes_line).
RULE bool gm_makes_line(const u64* stones, int sq) {
  const int r0 = sq / GM_SIZE, c0 = sq % GM_SIZE;
  const int dr[4] = {0, 1, 1, 1}, dc[4] = {1, 0, 1, -1};
#pragma unroll
  for (int d = 0; d < 4; ++d) {
    int run = 1;
#pragma unroll
    for (int way = -1; way <= 1; way += 2) {
      for (int k = 1; k < 5; ++k) {
        const int r = r0 + way * k * dr[d], c = c0 + way * k * dc[d];
        if (r < 0 || r >= GM_SIZE || c < 0 || c >= GM_SIZE || !gm_stone(stones, r * GM_SIZE + c)) break;
        ++run;
      }
    }
    if (run >= 5) return true;
  }
  return false;
}

RULE void game_initial(u64* s) {
#pragma unroll
  for (int i = 0; i < 9; ++i) s[i] = 0;
}

RULE bool game_is_terminal(const u64* s) { return (s[8] & GM_WON) != 0 || gm_full(s, s + 4); }

RULE float game_returns(const u64* s) { return (s[8] & GM_WON) ? -1.0f : 0.0f; }

RULE void game_legal(const u64* s, u32* legal) {
  const bool over = game_is_terminal(s);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u64 empty = over ? 0ull : (~(s[i] | s[4 + i]) & gm_board_word(i));
    legal[2 * i] = (u32)empty;
    if (2 * i + 1 < MASK_WORDS) legal[2 * i + 1] = (u32)(empty >> 32);
  }
}

RULE bool game_step(u64* s, int action, float& reward) {
  u64 mover[4], opp[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    mover[i] = s[i] | (i == (action >> 6) ? (1ull << (action & 63)) : 0ull);
    opp[i] = s[4 + i];
  }
  const bool won = gm_makes_line(mover, action);
  const u64 flags = ((s[8] & 1ull) ^ 1ull) | (won ? GM_WON : 0ull);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s[i] = opp[i];
    s[4 + i] = mover[i];
  }
  s[8] = flags;
  reward = won ? 1.0f : 0.0f;
  return won || gm_full(mover, opp);
}
