"""The bundled Gomoku plug-in: known positions (a five in each of the four
directions, for Black and for White, an overline, lines that would wrap
round the board's edge, a full board drawn), the notation and its errors,
the batch, and random games against OpenSpiel's ``gomoku``."""
from __future__ import annotations

import re
from itertools import zip_longest

import numpy as np
import pytest

from search_service.games.conformance import check_folder
from search_service.games.plugin import bundled_folder, load_game

rules = load_game(bundled_folder("gomoku")).rules
# Where the side not under test plays: far from every line below, and no line of its own.
SPREAD = ["o8", "m8", "o10", "m10", "o12", "m12"]


def actions_of(text: str) -> list[int]:
    """The actions of a move string, read without the rules' own parser."""
    return [(int(row) - 1) * 15 + "abcdefghijklmno".index(column) for column, row in re.findall(r"([a-o])(\d+)", text)]


def alternate(first: list[str], second: list[str]) -> str:
    """The move string where Black plays ``first`` and White ``second``, in turn."""
    return "".join(b + (w or "") for b, w in zip_longest(first, second))


def full_board_draw() -> str:
    """225 moves that fill the board without five in a row for either side.

    Black takes the squares where (column + 2 * row) % 4 < 2, White the rest:
    along a row that is pairs (aabb aabb...), along a column single stones
    alternating, along either diagonal pairs again, so no line is longer than
    two. Black gets 8 squares of each odd row number and 7 of each even one,
    113 in all: one more than White, as the player who moves first."""
    squares = np.arange(225)
    row, column = np.divmod(squares, 15)
    black = squares[(column + 2 * row) % 4 < 2]
    white = squares[(column + 2 * row) % 4 >= 2]
    assert (black.size, white.size) == (113, 112)
    return alternate([rules.move_to_text(a) for a in black], [rules.move_to_text(a) for a in white])


# Black's five in a row, in the order played: the last stone completes the line.
FIVES = {
    "row": ["c3", "d3", "f3", "g3", "e3"],  # completed in the middle
    "column": ["h4", "h5", "h6", "h7", "h8"],
    "diagonal": ["b2", "c3", "d4", "e5", "f6"],
    "anti-diagonal": ["j2", "i3", "g5", "f6", "h4"],
    "column at the edge": ["a15", "a14", "a13", "a12", "a11"],
    "row at the corner": ["k15", "l15", "m15", "n15", "o15"],
}
# Five squares in a row of actions that are no line on the board: each wraps round an edge.
WRAPS = {
    "row": ["l1", "m1", "n1", "o1", "a2"],  # actions 11..15
    "diagonal": ["n1", "o2", "a4", "b5", "c6"],  # actions 13 + 16k
    "anti-diagonal": ["b1", "a2", "o2", "n3", "m4"],  # actions 1 + 14k
}
FULL_BOARD = full_board_draw()
OVERLINE = alternate(["a1", "b1", "c1", "e1", "f1", "d1"], SPREAD[:5])  # the sixth stone fills the gap
WHITE_FIVE = alternate(SPREAD[:5], ["h8", "h9", "h10", "h11", "h12"])


# -- positions ---------------------------------------------------------------------


def test_the_start_black_to_move_anywhere():
    start = rules.initial(1)
    assert rules.legal_mask(start).all() and rules.to_play(start).tolist() == [0]
    assert not rules.is_terminal(start)[0] and rules.returns(start)[0] == 0
    assert not rules.observation(start).any()


def test_a_stone_hands_the_turn_over():
    state, terminal, reward = rules.step(rules.initial(1), np.array([112]))  # h8
    assert not terminal[0] and reward[0] == 0
    assert rules.to_play(state).tolist() == [1]
    assert np.flatnonzero(~rules.legal_mask(state)[0]).tolist() == [112]
    obs = rules.observation(state)[0]
    assert not obs[0].any() and [tuple(x) for x in np.argwhere(obs[1])] == [(7, 7)]  # Black's, seen by White


@pytest.mark.parametrize("line", FIVES.values(), ids=FIVES.keys())
def test_five_in_a_row_wins(line):
    before = rules.parse_moves(alternate(line[:4], SPREAD[:4]))
    assert not rules.is_terminal(before)[0] and rules.to_play(before).tolist() == [0]
    state, terminal, reward = rules.step(before, np.array(actions_of(line[4])))
    assert terminal[0] and reward[0] == 1  # Black moved and won
    assert rules.to_play(state).tolist() == [1] and rules.returns(state)[0] == -1
    assert not rules.legal_mask(state).any()
    with pytest.raises(ValueError, match=r"state 0: action 0 \(a1\) is not legal there"):
        rules.step(state, np.array([0]))
    text = alternate(line, SPREAD[:4])
    with pytest.raises(ValueError, match=f"character {len(text) + 1}: a1 comes after the game ended"):
        rules.parse_moves(text + "a1")


def test_white_wins_too():
    state = rules.parse_moves(WHITE_FIVE)
    assert rules.is_terminal(state)[0] and rules.to_play(state).tolist() == [0]
    assert rules.returns(state)[0] == -1  # Black, to move, has lost


def test_four_is_not_enough_nor_five_with_a_gap():
    state = rules.parse_moves(alternate(["a1", "b1", "c1", "d1", "f1"], SPREAD[:4]))
    assert not rules.is_terminal(state)[0] and rules.legal_mask(state)[0].sum() == 225 - 9


def test_five_broken_by_the_opponent_does_not_win():
    state = rules.parse_moves(alternate(["o8", "a1", "b1", "d1", "e1"], ["c1", "m8", "o10", "m10"]))
    assert not rules.is_terminal(state)[0]


def test_an_overline_wins():
    # OpenSpiel's gomoku is freestyle: six or more in a row win like five.
    before = rules.parse_moves(OVERLINE[:-2])
    state, terminal, reward = rules.step(before, np.array(actions_of("d1")))
    assert terminal[0] and reward[0] == 1 and rules.returns(state)[0] == -1


@pytest.mark.parametrize("squares", WRAPS.values(), ids=WRAPS.keys())
def test_the_edge_does_not_wrap(squares):
    state = rules.parse_moves(alternate(squares, SPREAD[:4]))
    assert not rules.is_terminal(state)[0] and rules.returns(state)[0] == 0


def test_a_full_board_is_a_draw():
    text = FULL_BOARD
    actions = actions_of(text)
    before = rules.parse_moves(rules.moves_to_text(actions[:-1]))
    assert not rules.is_terminal(before)[0] and rules.legal_mask(before)[0].sum() == 1
    state, terminal, reward = rules.step(before, np.array(actions[-1:]))
    assert terminal[0] and reward[0] == 0  # Black placed the last stone: no line, a draw
    assert rules.returns(state)[0] == 0 and rules.to_play(state).tolist() == [1]
    assert not rules.legal_mask(state).any() and rules.observation(state).sum(axis=(2, 3)).tolist() == [[112, 113]]
    assert np.array_equal(rules.parse_moves(text), state)
    with pytest.raises(ValueError, match=f"character {len(text) + 1}: a1 comes after the game ended"):
        rules.parse_moves(text + "a1")


def test_known_games_agree_with_openspiel():
    pyspiel = pytest.importorskip("pyspiel")
    texts = [alternate(line, SPREAD[:4]) for line in FIVES.values()]
    texts += [alternate(line, SPREAD[:4]) for line in WRAPS.values()]
    texts += [OVERLINE, WHITE_FIVE, FULL_BOARD]
    for text in texts:
        theirs = pyspiel.load_game("gomoku").new_initial_state()
        for a in actions_of(text):
            theirs.apply_action(rules.to_openspiel_action(a))
        ours = rules.parse_moves(text)
        assert theirs.is_terminal() == rules.is_terminal(ours)[0], text
        assert theirs.returns()[int(rules.to_play(ours)[0])] == rules.returns(ours)[0], text
        assert theirs.legal_actions() == np.flatnonzero(rules.legal_mask(ours)[0]).tolist(), text
        # OpenSpiel's first two observation planes are Black's and White's stones; ours start with the mover's.
        planes = np.array(theirs.observation_tensor(0)).reshape(3, 15, 15)[:2]
        player = int(rules.to_play(ours)[0])
        assert np.array_equal(rules.observation(ours)[0], planes[[player, 1 - player]]), text


# -- the batch ---------------------------------------------------------------------


def test_a_batch_of_different_states_steps_as_each_alone():
    last_square = actions_of(FULL_BOARD)[-1]
    texts = ["", "h8", alternate(FIVES["row"][:4], SPREAD[:3]), OVERLINE[:-2],
             rules.moves_to_text(actions_of(FULL_BOARD)[:-1])]
    states = np.concatenate([rules.parse_moves(t) for t in texts])
    actions = np.array([112, 0, *actions_of(FIVES["row"][4]), *actions_of("d1"), last_square])
    nxt, terminal, reward = rules.step(states, actions)
    for b in range(len(texts)):
        one = rules.step(states[b:b + 1], actions[b:b + 1])
        assert np.array_equal(one[0], nxt[b:b + 1]) and one[1][0] == terminal[b] and one[2][0] == reward[b]
    # White's four plus a fifth stone is no win for White: the row is Black's, and White moved.
    assert terminal.tolist() == [False, False, False, True, True] and reward.tolist() == [0, 0, 0, 1, 0]
    assert rules.to_play(nxt).tolist() == [1, 0, 0, 1, 1]
    assert nxt.dtype == np.uint64 and terminal.dtype == np.bool_ and reward.dtype == np.float32


def test_step_refuses_bad_input():
    start = rules.initial(2)
    with pytest.raises(ValueError, match=r"state 1: action 225 is outside 0..224"):
        rules.step(start, np.array([112, 225]))
    with pytest.raises(ValueError, match=r"state 0: action 112 \(h8\) is not legal there"):
        rules.step(rules.parse_moves("h8"), np.array([112]))
    with pytest.raises(ValueError, match=r"actions must be integers \[2\]"):
        rules.step(start, np.array([112]))
    with pytest.raises(ValueError, match=r"states must be uint64 \[B, 9\]"):
        rules.step(start.astype(np.int64), np.array([112, 112]))
    assert np.array_equal(start, rules.initial(2))  # the inputs are untouched


# -- notation ----------------------------------------------------------------------


def test_notation_round_trips_and_matches_openspiel_numbering():
    assert [rules.move_to_text(a) for a in (0, 14, 112, 210, 224)] == ["a1", "o1", "h8", "a15", "o15"]
    every = list(range(225))
    assert actions_of(rules.moves_to_text(every)) == every
    assert [rules.to_openspiel_action(a) for a in every] == every
    for bad in (-1, 225):
        with pytest.raises(ValueError, match="outside 0..224"):
            rules.move_to_text(bad)
        with pytest.raises(ValueError, match="outside 0..224"):
            rules.to_openspiel_action(bad)


def test_openspiel_writes_each_action_as_our_row_and_column():
    pyspiel = pytest.importorskip("pyspiel")
    state = pyspiel.load_game("gomoku").new_initial_state()
    for a in range(225):
        text = rules.move_to_text(a)
        row, column = int(text[1:]) - 1, "abcdefghijklmno".index(text[0])
        assert state.action_to_string(0, rules.to_openspiel_action(a)) == f"{row},{column}"


@pytest.mark.parametrize(("text", "message"), [
    ("h8z5", r"character 3: 'z' is not a column letter a-o"),
    ("H8", r"character 1: 'H' is not a column letter a-o"),  # lower case only
    ("h8p1", r"character 3: 'p' is not a column letter a-o"),
    ("h", r"character 1: 'h' is cut short"),
    ("h8i", r"character 3: 'i' is cut short"),
    ("hi9", r"character 2: 'i' is not a row number 1-15"),
    ("h8a16", r"character 4: '16' is not a row number 1-15"),
    ("a0", r"character 2: '0' is not a row number 1-15"),
    ("a05", r"character 2: '05' is not a row number 1-15"),  # one spelling a move
    ("a" + "1" * 5000, r"character 2: '1111.*' is not a row number 1-15"),
    ("a\u0661", r"character 2: '\u0661' is not a row number 1-15"),  # an Arabic-Indic one
    ("h8i9h8", r"character 5: h8 is not legal there \(the square is taken\)"),
    ("h8h8z", r"character 3: h8 is not legal there"),  # the first error in the string
])
def test_parse_moves_names_the_character(text, message):
    with pytest.raises(ValueError, match=message):
        rules.parse_moves(text)


# -- against OpenSpiel -------------------------------------------------------------


def test_300_random_games_agree_with_openspiel():
    pytest.importorskip("pyspiel")
    report = check_folder(bundled_folder("gomoku"), games=300, seed=20261206, single_games=10)
    assert report.ok, report.text()
    assert report.plies > 300 * 50  # random play takes about 100 moves to make a line
    assert "OpenSpiel gomoku: legal actions" in report.openspiel


@pytest.mark.slow
def test_3000_random_games_agree_with_openspiel():
    pytest.importorskip("pyspiel")
    report = check_folder(bundled_folder("gomoku"), games=3000, seed=20261207, single_games=50)
    assert report.ok, report.text()
    assert "OpenSpiel gomoku: legal actions" in report.openspiel
