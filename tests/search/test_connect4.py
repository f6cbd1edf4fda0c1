"""Connect Four rules: parsing, boards, wins, draws, observations; checked
against bitbully (0-indexed columns) on Pascal Pons' labelled positions."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from search_service.games import GAMES, Game
from search_service.games import connect4 as c4

DATA = Path(__file__).resolve().parents[2] / "data" / "connect4" / "pons"
# A full board with no four in a row (found by random play, checked with bitbully below).
DRAW = "126613431456475467333341527215612225546777"


def board(rows_top_first: list[str]) -> bytes:
    """cells for from_cells from a picture: top row first, '.' empty, 'X' first, 'O' second."""
    code = {".": 0, "X": 1, "O": 2}
    grid = [[code[ch] for ch in row] for row in reversed(rows_top_first)]
    return bytes(v for row in grid for v in row)


def game_from(choices: list[int]) -> str:
    """A legal move string: each choice picks among the legal columns; stops when the game ends."""
    p, text = c4.empty(), ""
    for x in choices:
        legal = np.flatnonzero(c4.legal_mask(p)[0])
        if legal.size == 0:
            break
        a = int(legal[x % legal.size])
        p = c4.play(p, [a])
        text += c4.move_to_text(a)
    return text


games = st.lists(st.integers(0, 6), max_size=42).map(game_from)


# -- registry -----------------------------------------------------------------


def test_registry_offers_the_game_protocol():
    game = GAMES["connect4"]
    assert isinstance(game, Game)
    assert (game.NAME, game.NUM_ACTIONS, game.ROWS, game.COLUMNS) == ("connect4", 7, 6, 7)
    assert game.move_to_text(0) == "1" and game.moves_to_text([3, 3, 4]) == "445"


# -- parse_moves --------------------------------------------------------------


def test_empty_string_is_the_empty_board():
    p = c4.parse_moves("")
    assert len(p) == 1 and p.current[0] == 0 and p.mask[0] == 0 and p.moves[0] == 0
    assert c4.legal_mask(p).all()


def test_parse_places_stones_bottom_up_and_alternates():
    p = c4.parse_moves("443")
    cells = c4.to_cells(p)[0].reshape(6, 7)
    assert cells[0, 3] == 1 and cells[1, 3] == 2 and cells[0, 2] == 1
    assert p.moves[0] == 3 and cells.sum() == 4
    assert c4.same_position(p, c4.play(c4.play(c4.play(c4.empty(), [3]), [3]), [2]))


@pytest.mark.parametrize(
    "text, index, words",
    [
        ("44a5", 3, "not a column digit"),
        ("4 4", 2, "not a column digit"),
        ("440", 3, "outside 1..7"),
        ("48", 2, "outside 1..7"),
        ("4444444", 7, "full"),
        ("12121213", 8, "already won"),
        ("1" * 43, 43, "at most 42"),
    ],
)
def test_parse_errors_name_the_problem_and_character(text, index, words):
    with pytest.raises(ValueError) as err:
        c4.parse_moves(text)
    assert f"character {index}" in str(err.value) and words in str(err.value)


def test_a_full_game_is_42_moves_and_parses():
    assert len(DRAW) == 42
    p = c4.parse_moves(DRAW)
    assert p.moves[0] == 42 and p.mask[0] == c4.BOARD_MASK


# -- wins, draws --------------------------------------------------------------


def _lines() -> list[list[tuple[int, int]]]:
    out = []
    for r in range(6):
        for c in range(7):
            for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
                cells = [(r + i * dr, c + i * dc) for i in range(4)]
                if all(0 <= rr < 6 and 0 <= cc < 7 for rr, cc in cells):
                    out.append(cells)
    return out


def test_has_four_finds_every_line_and_nothing_shorter():
    lines = _lines()
    assert len(lines) == 69  # 24 horizontal, 21 vertical, 12 + 12 diagonal
    bits = lambda cells: np.uint64(sum(1 << (c * 7 + r) for r, c in cells))  # noqa: E731
    full = np.array([bits(line) for line in lines])
    three = np.array([bits(line[:3]) for line in lines] + [bits(line[1:]) for line in lines])
    assert c4.has_four(full).all()
    assert not c4.has_four(three).any()
    # Two threes in different lines that would "join" across the column sentinel must not count.
    wrap = np.array([bits([(4, 0), (5, 0), (0, 1), (1, 1)]), bits([(5, 0), (0, 1), (1, 1), (2, 1)])])
    assert not c4.has_four(wrap).any()


@pytest.mark.parametrize(
    "moves",
    [
        "1212121",  # vertical
        "1122334",  # horizontal
        "775435756766",  # diagonal / (rising to the right)
        "32114221361",  # diagonal \ (falling to the right)
    ],
)
def test_last_mover_won_in_each_direction(moves):
    before = c4.parse_moves(moves[:-1])
    after = c4.parse_moves(moves)
    assert not c4.last_mover_won(before)[0]
    assert c4.winning_moves(before)[0, int(moves[-1]) - 1]
    assert c4.last_mover_won(after)[0] and c4.is_terminal(after)[0] and not c4.is_draw(after)[0]
    assert not c4.legal_mask(after).any()
    with pytest.raises(ValueError, match="full or the game is over"):
        c4.play(after, [0])


def test_draw():
    before = c4.parse_moves(DRAW[:-1])
    p = c4.parse_moves(DRAW)
    assert not c4.is_terminal(before)[0]
    assert c4.is_draw(p)[0] and c4.is_terminal(p)[0] and not c4.last_mover_won(p)[0]
    assert not c4.legal_mask(p).any()


def test_play_rejects_bad_actions():
    p = c4.parse_moves("444444")
    with pytest.raises(ValueError, match="full"):
        c4.play(p, [3])
    with pytest.raises(ValueError, match="0..6"):
        c4.play(p, [7])


# -- observation ----------------------------------------------------------------


def test_observation_planes_are_side_to_move_then_opponent():
    obs = c4.observation(c4.parse_moves("4"))
    assert obs.shape == (1, 2, 6, 7) and obs.dtype == np.uint8
    assert obs[0, 0].sum() == 0  # second player to move: no stones yet
    assert obs[0, 1, 0, 3] == 1 and obs[0, 1].sum() == 1
    obs = c4.observation(c4.parse_moves("445"))
    assert obs[0, 0, 1, 3] == 1 and obs[0, 0].sum() == 1  # second player's stone, row 1 col 3
    assert obs[0, 1, 0, 3] == 1 and obs[0, 1, 0, 4] == 1 and obs[0, 1].sum() == 2


# -- from_cells -----------------------------------------------------------------


def test_from_cells_round_trip_and_side_to_move():
    p = c4.parse_moves("4453")
    q = c4.from_cells(6, 7, c4.to_cells(p)[0].tobytes())
    assert c4.same_position(p, q) and q.moves[0] == 4
    q = c4.from_cells(6, 7, board(["......."] * 5 + ["...X..."]))
    assert c4.same_position(q, c4.parse_moves("4"))


@pytest.mark.parametrize(
    "rows, columns, cells, words",
    [
        (7, 6, bytes(42), "6 rows x 7 columns"),
        (6, 7, bytes(41), "42 values"),
        (6, 7, bytes([3]) + bytes(41), "holds 3"),
        (6, 7, board(["......."] * 4 + ["...X..."] + ["......."]), "floating stone at row 1, column 3"),
        (6, 7, board(["......."] * 5 + ["XX....."]), "impossible stone counts"),
        (6, 7, board(["......."] * 5 + ["O......"]), "impossible stone counts"),
        (6, 7, board(["......."] * 2 + ["XO....."] * 4), "both players have four"),
        (
            6,
            7,
            board([".......", ".......", ".O.....", "XO.....", "XO.....", "XOXX..."]),
            "second player has four in a row but the first player moved last",
        ),
        (6, 7, board(["......."] * 4 + ["OOO....", "XXXXO.."]), "first player has four in a row but the second"),
        (6, 7, board(["......."] * 3 + ["O......", "OO.OO.O", "XXXXXXX"]), "complete before its last stone"),
    ],
)
def test_from_cells_rejects_impossible_boards(rows, columns, cells, words):
    with pytest.raises(ValueError, match=words):
        c4.from_cells(rows, columns, cells)


def test_from_cells_accepts_a_finished_game_and_near_misses():
    p = c4.from_cells(6, 7, c4.to_cells(c4.parse_moves("1212121"))[0].tobytes())
    assert c4.last_mover_won(p)[0]
    # X (4 stones vs 3) has four; a stone of it on top of column 2 or 3 can have been the last: possible.
    p = c4.from_cells(6, 7, board(["......."] * 4 + ["OO.....", "XXXXO.."]))
    assert c4.last_mover_won(p)[0] and p.moves[0] == 7


def test_from_cells_type_error():
    with pytest.raises(TypeError):
        c4.from_cells(6, 7, [0] * 42)  # type: ignore[arg-type]


# -- properties -----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(games)
def test_parse_equals_playing_the_moves(text):
    p = c4.parse_moves(text)
    q = c4.empty()
    for ch in text:
        q = c4.play(q, [int(ch) - 1])
    assert c4.same_position(p, q) and p.moves[0] == q.moves[0] == len(text)
    assert int(c4.popcount(p.mask)[0]) == len(text)


@settings(max_examples=150, deadline=None)
@given(games)
def test_from_cells_of_a_position_is_that_position(text):
    p = c4.parse_moves(text)
    cells = c4.to_cells(p)[0]
    q = c4.from_cells(6, 7, cells.tobytes())
    assert c4.same_position(p, q) and q.moves[0] == p.moves[0]
    obs = c4.observation(p)[0]
    first_to_move = len(text) % 2 == 0
    mine, theirs = (1, 2) if first_to_move else (2, 1)
    grid = cells.reshape(6, 7)
    assert (obs[0] == (grid == mine)).all() and (obs[1] == (grid == theirs)).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(games, min_size=1, max_size=8))
def test_batched_functions_match_one_by_one(texts):
    batch = c4.stack([c4.parse_moves(t) for t in texts])
    for i, t in enumerate(texts):
        one = c4.parse_moves(t)
        assert c4.same_position(c4.take(batch, i), one)
        for fn in (c4.legal_mask, c4.last_mover_won, c4.is_draw, c4.is_terminal, c4.observation, c4.winning_moves):
            assert np.array_equal(fn(batch)[i], fn(one)[0])


# -- bitbully cross-check on Pons' positions --------------------------------------


def _pons(name: str) -> list[dict]:
    with open(DATA / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("name", ["Test_L3_R1", "Test_L2_R1", "Test_L1_R1"])
def test_rules_agree_with_bitbully(name):
    from bitbully import Board

    rows = _pons(name)[::4]  # 250 positions per file
    for row in rows:
        p = c4.parse_moves(row["moves"])
        b = Board("".join(str(int(ch) - 1) for ch in row["moves"]))  # bitbully: 0-indexed columns
        legal = np.flatnonzero(c4.legal_mask(p)[0]).tolist()
        assert legal == sorted(b.legal_moves()), row["moves"]
        assert legal == [int(k) - 1 for k, v in row["move_scores"].items() if v is not None]
        assert not c4.is_terminal(p)[0] and not b.is_game_over()
        wins = c4.winning_moves(p)[0]
        for a in legal:
            assert bool(wins[a]) == b.can_win_next(a), (row["moves"], a)
            assert bool(c4.last_mover_won(c4.play(p, [a]))[0]) == (b.play_on_copy(a).winner() is not None)
        grid = np.array(b.to_array(), dtype=np.uint8).T  # bitbully: [col][row] -> [row][col]
        assert np.array_equal(c4.to_cells(p)[0].reshape(6, 7), grid)


def test_draw_string_is_a_draw_for_bitbully():
    from bitbully import Board

    b = Board("".join(str(int(ch) - 1) for ch in DRAW))
    assert b.is_full() and b.winner() is None


def test_from_observation_inverts_observation():
    p = c4.stack([c4.parse_moves(m) for m in ("", "4", "4453", "1212121")])
    back = c4.from_observation(c4.observation(p))
    assert c4.same_position(p, back) and (back.moves == p.moves).all()
