"""The bundled Othello plug-in: known positions (the start, a forced pass, a
game over before the board is full, a full game), the notation, the batch,
and 2,000 random games against OpenSpiel's ``othello``."""
from __future__ import annotations

import numpy as np
import pytest

from search_service.games.conformance import check_folder
from search_service.games.plugin import bundled_folder, load_game

rules = load_game(bundled_folder("othello")).rules
PASS = 64
# Found by random play and checked against OpenSpiel (test_known_games_agree_with_openspiel):
FORCED_PASS = "f5f6c4g5h5h4g7h6"  # Black to move, and no square brackets a White disc
WIPE_OUT = "d3c3b3e3f5f4f3d6d7"  # Black takes White's last disc: over after 9 moves, 13 discs to 0
FULL_GAME = ("c4c3c2f4f6b4c5c6a5b3b2g7f5a1d3d2d1a2f7e3h8c1b7e1f3g6g5c7d7h7f2e7b1h6d6a8b5a3h4b6a4g3g4h3e6a6b8a7"
             "g1e2f1h1c8d8g8h5f8g2e8--h2")  # Black passes before the last disc; White wins 37 to 27


def actions_of(text: str) -> list[int]:
    return [PASS if text[i:i + 2] == "--" else (int(text[i + 1]) - 1) * 8 + "abcdefgh".index(text[i])
            for i in range(0, len(text), 2)]


def discs(state: np.ndarray) -> tuple[int, int]:
    """(the player to move's discs, the opponent's) of a batch of one."""
    return bin(int(state[0, 0])).count("1"), bin(int(state[0, 1])).count("1")


# -- positions ---------------------------------------------------------------------


def test_the_start_black_to_move_with_four_moves():
    start = rules.initial(1)
    legal = np.flatnonzero(rules.legal_mask(start)[0])
    assert legal.tolist() == [19, 26, 37, 44]  # OpenSpiel's ids: row * 8 + column
    assert [rules.move_to_text(a) for a in legal] == ["d3", "c4", "f5", "e6"]
    assert rules.to_play(start).tolist() == [0] and not rules.is_terminal(start)[0]
    obs = rules.observation(start)[0]
    assert [tuple(x) for x in np.argwhere(obs[0])] == [(3, 4), (4, 3)]  # Black: e4, d5 ([row, column])
    assert [tuple(x) for x in np.argwhere(obs[1])] == [(3, 3), (4, 4)]  # White: d4, e5


def test_a_move_flips_and_hands_the_turn_over():
    state, terminal, reward = rules.step(rules.initial(1), np.array([19]))  # d3 flips d4
    assert not terminal[0] and reward[0] == 0
    assert rules.to_play(state).tolist() == [1] and discs(state) == (1, 4)
    assert [rules.move_to_text(a) for a in np.flatnonzero(rules.legal_mask(state)[0])] == ["c3", "e3", "c5"]
    assert rules.observation(state)[0, 1, 3, 3] == 1  # d4 is Black's now, seen by White as the opponent's


def test_a_forced_pass():
    state = rules.parse_moves(FORCED_PASS)
    assert rules.to_play(state).tolist() == [0]
    assert np.flatnonzero(rules.legal_mask(state)[0]).tolist() == [PASS]
    assert not rules.is_terminal(state)[0] and rules.returns(state)[0] == 0
    after, terminal, reward = rules.step(state, np.array([PASS]))
    assert not terminal[0] and reward[0] == 0
    assert after[0, 0] == state[0, 1] and after[0, 1] == state[0, 0]  # the same board, White to move
    assert rules.to_play(after).tolist() == [1] and not rules.legal_mask(after)[0, PASS]
    assert np.array_equal(rules.parse_moves(FORCED_PASS + "--"), after)
    with pytest.raises(ValueError, match="not legal"):
        rules.step(state, np.array([19]))


def test_a_pass_is_illegal_while_a_square_is_open():
    with pytest.raises(ValueError, match=r"state 0: action 64 \(--\) is not legal"):
        rules.step(rules.initial(1), np.array([PASS]))
    with pytest.raises(ValueError, match="character 3: -- is not legal there .a square is open"):
        rules.parse_moves("d3--")


def test_a_game_over_before_the_board_is_full():
    before = rules.parse_moves(WIPE_OUT[:-2])
    state, terminal, reward = rules.step(before, np.array([actions_of(WIPE_OUT)[-1]]))
    assert terminal[0] and reward[0] == 1  # Black moved and won
    assert rules.to_play(state).tolist() == [1] and discs(state) == (0, 13)
    assert rules.is_terminal(state)[0] and rules.returns(state)[0] == -1
    assert not rules.legal_mask(state).any()  # not even the pass: neither player can move


def test_a_full_game_ends():
    state = rules.parse_moves(FULL_GAME)
    assert len(actions_of(FULL_GAME)) == 61 and FULL_GAME.count("--") == 1
    assert rules.is_terminal(state)[0] and not rules.legal_mask(state).any()
    assert rules.to_play(state).tolist() == [1] and discs(state) == (37, 27)
    assert rules.returns(state)[0] == 1  # White, to move at the end, has more discs
    for action in (0, 63, PASS):
        with pytest.raises(ValueError, match="not legal"):
            rules.step(state, np.array([action]))
    with pytest.raises(ValueError, match=f"character {len(FULL_GAME) + 1}: -- comes after the game ended"):
        rules.parse_moves(FULL_GAME + "--")


def test_the_last_reward_is_the_negated_return():
    actions = actions_of(FULL_GAME)
    before = rules.parse_moves(rules.moves_to_text(actions[:-1]))
    after, terminal, reward = rules.step(before, np.array([actions[-1]]))
    assert terminal[0] and reward[0] == -rules.returns(after)[0] == -1  # Black made the last move and lost


def test_known_games_agree_with_openspiel():
    pyspiel = pytest.importorskip("pyspiel")
    for text in (FORCED_PASS, WIPE_OUT, FULL_GAME):
        theirs = pyspiel.load_game("othello").new_initial_state()
        for a in actions_of(text):
            theirs.apply_action(rules.to_openspiel_action(a))
        ours = rules.parse_moves(text)
        assert theirs.is_terminal() == rules.is_terminal(ours)[0]
        if theirs.is_terminal():
            assert theirs.returns()[int(rules.to_play(ours)[0])] == rules.returns(ours)[0]
        else:
            assert theirs.legal_actions() == np.flatnonzero(rules.legal_mask(ours)[0]).tolist()


# -- the batch ---------------------------------------------------------------------


def test_a_batch_of_different_states_steps_as_each_alone():
    texts = ["", "d3", FORCED_PASS, FULL_GAME[:80], WIPE_OUT[:-2]]
    states = np.concatenate([rules.parse_moves(t) for t in texts])
    actions = np.array([int(np.flatnonzero(m)[-1]) for m in rules.legal_mask(states)])
    nxt, terminal, reward = rules.step(states, actions)
    for b in range(len(texts)):
        one = rules.step(states[b:b + 1], actions[b:b + 1])
        assert np.array_equal(one[0], nxt[b:b + 1]) and one[1][0] == terminal[b] and one[2][0] == reward[b]
    assert terminal.tolist() == [False, False, False, False, True]
    assert nxt.dtype == np.uint64 and terminal.dtype == np.bool_ and reward.dtype == np.float32
    assert np.array_equal(rules.parse_moves(texts[1]), rules.step(rules.initial(1), np.array([19]))[0])


def test_step_refuses_bad_input():
    start = rules.initial(2)
    with pytest.raises(ValueError, match=r"state 1: action 65 is outside 0..64"):
        rules.step(start, np.array([19, 65]))
    with pytest.raises(ValueError, match=r"state 0: action 0 \(a1\) is not legal"):
        rules.step(start, np.array([0, 19]))
    with pytest.raises(ValueError, match=r"actions must be integers \[2\]"):
        rules.step(start, np.array([19]))
    with pytest.raises(ValueError, match=r"states must be uint64 \[B, 3\]"):
        rules.step(start.astype(np.int64), np.array([19, 19]))
    assert np.array_equal(start, rules.initial(2))  # the inputs are untouched


# -- notation ----------------------------------------------------------------------


def test_notation_round_trips():
    assert rules.move_to_text(0) == "a1" and rules.move_to_text(63) == "h8" and rules.move_to_text(PASS) == "--"
    assert rules.moves_to_text(actions_of(FULL_GAME)) == FULL_GAME
    assert [rules.to_openspiel_action(a) for a in (0, 19, PASS)] == [0, 19, 64]
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="outside 0..64"):
            rules.move_to_text(bad)
        with pytest.raises(ValueError, match="outside 0..64"):
            rules.to_openspiel_action(bad)


@pytest.mark.parametrize(("text", "message"), [
    ("d3z5", r"character 3: 'z' is not a file letter a-h"),
    ("d3c9", r"character 4: '9' is not a rank digit 1-8"),
    ("D3", r"character 1: 'D' is not a file letter"),  # lower case only
    ("d3c", r"character 3: 'c' is cut short"),
    ("d3d3", r"character 3: d3 is not legal there \(it flips nothing or the square is taken\)"),
    ("a1", r"character 1: a1 is not legal there"),
    ("d3" * 120, r"character 239: an Othello game has at most 119 moves"),
])
def test_parse_moves_names_the_character(text, message):
    with pytest.raises(ValueError, match=message):
        rules.parse_moves(text)


# -- against OpenSpiel -----------------------------------------------------------


@pytest.mark.slow
def test_2000_random_games_agree_with_openspiel():
    pytest.importorskip("pyspiel")
    report = check_folder(bundled_folder("othello"), games=2000, seed=20261205, single_games=20)
    assert report.ok, report.text()
    assert report.plies > 2000 * 55  # full games: about 60 plies each
    assert "OpenSpiel othello: legal actions" in report.openspiel
