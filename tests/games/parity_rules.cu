// The parity game's device rules, the twin of parity_rules.py: one state
// word, bits 0-7 the plies played, bits 8.. the sum of the digits so far.
#define RULES_NUM_ACTIONS 8
#define RULES_STATE_WORDS 1
#define RULE __device__ __forceinline__
#define PARITY_PLIES 4ull

RULE void game_initial(u64* s) { s[0] = 0; }
RULE bool game_is_terminal(const u64* s) { return (s[0] & 0xFFull) == PARITY_PLIES; }
RULE float game_returns(const u64* s) {
  if (!game_is_terminal(s)) return 0.0f;
  const bool first_wins = ((s[0] >> 8) & 1ull) == 0;
  const bool mover_is_first = (PARITY_PLIES & 1ull) == 0;  // who would move after the last ply
  return first_wins == mover_is_first ? 1.0f : -1.0f;
}
RULE void game_legal(const u64* s, u32* legal) { legal[0] = game_is_terminal(s) ? 0u : 0xFFu; }
RULE bool game_step(u64* s, int a, float& reward) {
  s[0] = ((s[0] & 0xFFull) + 1ull) | (((s[0] >> 8) + (u64)a) << 8);
  const bool over = game_is_terminal(s);
  reward = over ? -game_returns(s) : 0.0f;
  return over;
}
