// Tic-tac-toe's device rules, the twin of tic_tac_toe_rules.py (a test's game
// folder outside the repository): one state word, bits 0-8 X's marks, 9-17 O's.
#define RULES_NUM_ACTIONS 9
#define RULES_STATE_WORDS 1
#define RULE __device__ __forceinline__

RULE bool ttt_line(u64 m) {
  const u64 lines[8] = {0x7, 0x38, 0x1C0, 0x49, 0x92, 0x124, 0x111, 0x54};
  for (int i = 0; i < 8; ++i)
    if ((m & lines[i]) == lines[i]) return true;
  return false;
}
RULE u64 ttt_x(const u64* s) { return s[0] & 0x1FFull; }
RULE u64 ttt_o(const u64* s) { return (s[0] >> 9) & 0x1FFull; }
RULE void game_initial(u64* s) { s[0] = 0; }
RULE bool game_is_terminal(const u64* s) {
  return ttt_line(ttt_x(s)) || ttt_line(ttt_o(s)) || (ttt_x(s) | ttt_o(s)) == 0x1FFull;
}
RULE float game_returns(const u64* s) { return (ttt_line(ttt_x(s)) || ttt_line(ttt_o(s))) ? -1.0f : 0.0f; }
RULE void game_legal(const u64* s, u32* legal) {
  legal[0] = game_is_terminal(s) ? 0u : (u32)(~(ttt_x(s) | ttt_o(s)) & 0x1FFull);
}
RULE bool game_step(u64* s, int a, float& reward) {
  const int o_to_play = __popcll(ttt_x(s)) > __popcll(ttt_o(s));
  s[0] |= 1ull << (a + 9 * o_to_play);
  reward = -game_returns(s);
  return game_is_terminal(s);
}
