// connect4.cu -- Connect Four on Pons bitboards (bit = col * 7 + row, one
// sentinel bit per column), the device twin of search_service/games/connect4.py,
// and the random rollout of search_service/mcts/rollout.py.

#define C4_COLUMN_MASK(c) (0x3Full << (7 * (c)))
#define C4_BOTTOM(c) (1ull << (7 * (c)))
#define C4_TOP(c) (1ull << (7 * (c) + 5))
#define C4_BOARD_MASK 0x0FDFBF7EFDFBFull  // every playable cell (6 of each 7 bits)
#define C4_TOPS 0x0810204081020ull        // the top cell of each column (bits 5 + 7c)

// Four in a row on bitboard b, along the four directions (shifts 1, 7, 6, 8).
HD bool has_four(u64 b) {
  const u64 v = b & (b >> 1);
  const u64 h = b & (b >> 7);
  const u64 d1 = b & (b >> 6);
  const u64 d2 = b & (b >> 8);
  return ((v & (v >> 2)) | (h & (h >> 14)) | (d1 & (d1 >> 12)) | (d2 & (d2 >> 16))) != 0;
}

// NOT_TERMINAL, TERMINAL_LOSS (the side to move lost) or TERMINAL_DRAW.
HD int terminal_code(u64 current, u64 mask) {
  if (has_four(current ^ mask)) return TERMINAL_LOSS;
  return mask == C4_BOARD_MASK ? TERMINAL_DRAW : NOT_TERMINAL;
}

// Drops a stone of the side to move in column c (not full); swaps sides.
HD void play_column(u64& current, u64& mask, int c) {
  const u64 move = (mask + C4_BOTTOM(c)) & C4_COLUMN_MASK(c);
  current ^= mask;
  mask |= move;
}

// 7-bit code, bit c set where column c is full.
HD u32 full_columns(u64 mask) {
  u32 code = 0;
#pragma unroll
  for (int c = 0; c < NUM_ACTIONS; ++c) code |= (u32)((mask >> (7 * c + 5)) & 1ull) << c;
  return code;
}

// The k-th (0-based) column that is not full, counting from the left, for a
// 7-bit full-columns code; 0 when there is none (the table below caches it).
HD int kth_free_column(u32 full, u32 k) {
  for (int c = 0; c < NUM_ACTIONS; ++c) {
    if (!((full >> c) & 1u)) {
      if (k == 0) return c;
      --k;
    }
  }
  return 0;
}

// One random game from an unfinished position, for its side to move: +1 win,
// 0 draw, -1 loss. Move i uses word i % 4 of philox((s, t, i / 4, 0), key) and
// plays the (word % n)-th of the n free columns (counted from the left), as
// rollout.py does; `table[full * 8 + k]` is kth_free_column(full, k). The
// rollout ends at the first four in a row or a full board.
HD float rollout_value(u64 cur, u64 mask, u32 s, u32 t, u32 k0, u32 k1, const unsigned char* table) {
  u32 full = full_columns(mask);
  for (u32 blk = 0;; ++blk) {
    u32 w[4];
    philox4x32_10(s, t, blk, STREAM_ROLLOUT, k0, k1, w[0], w[1], w[2], w[3]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (full == 127u) return 0.0f;  // board full: a draw
      const u32 n = (u32)(NUM_ACTIONS - popc32(full));
      const int c = table[full * 8u + w[q] % n];
      const u64 move = (mask + C4_BOTTOM(c)) & C4_COLUMN_MASK(c);
      cur ^= mask;
      mask |= move;
      if (has_four(cur ^ mask)) return ((blk * 4u + (u32)q) & 1u) ? -1.0f : 1.0f;  // the mover of ply i won
      if (move & C4_TOPS) full |= 1u << c;
    }
  }
}
