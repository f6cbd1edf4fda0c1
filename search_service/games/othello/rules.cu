// Othello's device rules: rules.py's, bit for bit, against tandem's generated
// game.h (search_service/cuda/kernels/wide.cu describes the interface).
// State words: [0] the discs of the player to move, [1] the opponent's, [2] the
// absolute player to move. Square r * 8 + c is bit r * 8 + c; action 64 passes.

#define RULES_NUM_ACTIONS 65
#define RULES_STATE_WORDS 3
#define RULE __device__ __forceinline__

#define OT_PASS 64
#define OT_NOT_A 0xFEFEFEFEFEFEFEFEull  // after a shift towards h, nothing may land on file a
#define OT_NOT_H 0x7F7F7F7F7F7F7F7Full  // ... and towards a, nothing on file h
#define OT_ALL 0xFFFFFFFFFFFFFFFFull

// The four shift amounts (along a rank, a file, the two diagonals), each taken
// towards h8 (left shift, mask ot_left) and towards a1 (right shift, mask ot_right).
RULE int ot_shift(int d) { return d == 0 ? 1 : (d == 1 ? 8 : (d == 2 ? 9 : 7)); }
RULE u64 ot_left(int d) { return d == 1 ? OT_ALL : (d == 3 ? OT_NOT_H : OT_NOT_A); }
RULE u64 ot_right(int d) { return d == 1 ? OT_ALL : (d == 3 ? OT_NOT_A : OT_NOT_H); }

// The empty squares where `own` may place a disc (rules.py: _moves).
RULE u64 ot_moves(u64 own, u64 opp) {
  u64 reach = 0;
#pragma unroll
  for (int d = 0; d < 4; ++d) {
    const int s = ot_shift(d);
    const u64 ol = opp & ot_left(d), orr = opp & ot_right(d);
    u64 l = (own << s) & ol, r = (own >> s) & orr;
#pragma unroll
    for (int k = 0; k < 5; ++k) {
      l |= (l << s) & ol;
      r |= (r >> s) & orr;
    }
    reach |= ((l << s) & ot_left(d)) | ((r >> s) & ot_right(d));
  }
  return reach & ~(own | opp);
}

// The opponent discs a disc on `move` (one bit, 0 for a pass) flips (rules.py: _flips).
RULE u64 ot_flips(u64 own, u64 opp, u64 move) {
  u64 flipped = 0;
#pragma unroll
  for (int d = 0; d < 4; ++d) {
    const int s = ot_shift(d);
    const u64 ol = opp & ot_left(d), orr = opp & ot_right(d);
    u64 l = (move << s) & ol, r = (move >> s) & orr;
#pragma unroll
    for (int k = 0; k < 5; ++k) {
      l |= (l << s) & ol;
      r |= (r >> s) & orr;
    }
    if (((l << s) & ot_left(d)) & own) flipped |= l;
    if (((r >> s) & ot_right(d)) & own) flipped |= r;
  }
  return flipped;
}

RULE float ot_sign(int x) { return x > 0 ? 1.0f : (x < 0 ? -1.0f : 0.0f); }

RULE void game_initial(u64* s) {
  s[0] = (1ull << 28) | (1ull << 35);  // Black: e4, d5
  s[1] = (1ull << 27) | (1ull << 36);  // White: d4, e5
  s[2] = 0;
}

RULE bool game_is_terminal(const u64* s) { return ot_moves(s[0], s[1]) == 0 && ot_moves(s[1], s[0]) == 0; }

RULE float game_returns(const u64* s) {
  return game_is_terminal(s) ? ot_sign(__popcll(s[0]) - __popcll(s[1])) : 0.0f;
}

RULE void game_legal(const u64* s, u32* legal) {
  const u64 mine = ot_moves(s[0], s[1]);
  legal[0] = (u32)mine;
  legal[1] = (u32)(mine >> 32);
  legal[2] = (mine == 0 && ot_moves(s[1], s[0]) != 0) ? 1u : 0u;  // bit 0 of word 2: the pass (64)
}

RULE bool game_step(u64* s, int action, float& reward) {
  const u64 move = action == OT_PASS ? 0ull : (1ull << action);
  const u64 flips = ot_flips(s[0], s[1], move);
  const u64 mover = s[0] | move | flips, other = s[1] & ~flips;
  s[0] = other;
  s[1] = mover;
  s[2] ^= 1ull;
  const bool over = game_is_terminal(s);
  reward = over ? ot_sign(__popcll(mover) - __popcll(other)) : 0.0f;
  return over;
}
