"""Endgame sets labelled by OpenSpiel's exact solver
(search_service/games/endgames.py), and the labelled records that
``tandem play`` scores moves against (search_service/games/positions.py)."""
from __future__ import annotations

import json

import pytest

from search_service.games.endgames import Unsolved, endgame_positions, label, main
from search_service.games.metadata import GameError
from search_service.games.plugin import bundled_folder, load_game
from search_service.games.positions import read_positions, read_records

from game_folders import write_game

pytest.importorskip("pyspiel")


@pytest.fixture(scope="module")
def ttt(tmp_path_factory):
    return load_game(write_game(tmp_path_factory.mktemp("games") / "ttt"))


def test_a_tic_tac_toe_position_gets_its_exact_labels(ttt):
    # X: cells 1, 2; O: cells 4, 5; X to move. Cell 3 wins at once; cell 6 blocks O's row and
    # draws with best play; anything else lets O complete 4-5-6.
    assert label(ttt, [0, 3, 1, 4], max_depth=9) == {"score": 1, "move_scores": {"2": 1, "5": 0, "6": -1, "7": -1,
                                                                                   "8": -1}}


def test_a_position_whose_lines_outlast_the_solver_depth_is_unsolved(ttt):
    with pytest.raises(Unsolved):
        label(ttt, [], max_depth=3)  # the empty board: lines of up to 9 plies


def test_endgame_positions_are_labelled_reproducible_and_each_choice_matters(ttt):
    made = endgame_positions(ttt, 4, seed=3, min_left=2, max_left=4, max_depth=9)
    assert made == endgame_positions(ttt, 4, seed=3, min_left=2, max_left=4, max_depth=9)
    assert len({r["moves"] for r in made}) == 4
    for r in made:
        assert len(set(r["move_scores"].values())) > 1 and r["score"] == max(r["move_scores"].values())
        legal = ttt.rules.legal_mask(ttt.rules.parse_moves(r["moves"]))[0]
        assert sorted(int(a) for a in r["move_scores"]) == [a for a in range(9) if legal[a]]


def test_a_game_without_openspiel_has_no_endgames(tmp_path):
    game = load_game(write_game(tmp_path / "ttt", drop=("openspiel",)))
    with pytest.raises(GameError, match="game.yaml names no openspiel"):
        endgame_positions(game, 1, seed=1)
    assert main([str(tmp_path / "ttt")]) == 1


def test_bundled_othello_endgames_keep_their_labels():
    """The shipped set is what its labels say: three records labelled again
    by the solver, every record a legal unfinished position where the choice
    matters."""
    game = load_game(bundled_folder("othello"))
    assert game.meta.endgames is not None and game.meta.endgames.name == "endgames.jsonl"
    records = read_records(game.meta.endgames)
    assert len(records) == 100
    for r in records:
        state = game.rules.parse_moves(r["moves"])
        assert not game.rules.is_terminal(state)[0] and len(set(r["move_scores"].values())) > 1
    for r in records[:3]:
        actions = [int(a) for a in _actions(game, r["moves"])]
        again = label(game, actions, max_depth=30)
        assert again["score"] == r["score"] and {int(a): v for a, v in again["move_scores"].items()} == r["move_scores"]


def _actions(game, moves: str) -> list[int]:
    """The actions of an Othello move string (two characters a move: a square or "--")."""
    names = {game.rules.move_to_text(a): a for a in range(game.meta.num_actions)}
    return [names[moves[i:i + 2]] for i in range(0, len(moves), 2)]


@pytest.mark.parametrize("line, message", [
    ({"moves": "", "score": 2, "move_scores": {"0": 1}}, "a result must be -1, 0 or 1"),
    ({"moves": "", "score": 1, "move_scores": {"0": 5}}, "a result must be -1, 0 or 1"),
    ({"moves": "", "score": 1}, "labels need score and move_scores"),
    ({"moves": "", "move_scores": {"x": 1}, "score": 1}, "labels need score and move_scores"),
    ({"moves": "", "score": 1, "move_scores": [1]}, "labels need score and move_scores"),
])
def test_malformed_labels_are_refused_with_the_line_named(tmp_path, line, message):
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"moves": "1"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=f"set.jsonl:2: {message}"):
        read_records(path)


def test_unlabelled_and_labelled_records_read_alike(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"moves": "15"}\n{"moves": "1425", "score": 1, "move_scores": {"2": 1, "5": 0}}\n')
    assert read_records(path) == [{"moves": "15"}, {"moves": "1425", "score": 1, "move_scores": {2: 1, 5: 0}}]
    assert read_positions(path) == ["15", "1425"]


@pytest.mark.parametrize("value, message", [
    ("../positions.jsonl", "field endgames (../positions.jsonl) points outside the game folder"),
    ("missing.jsonl", "field endgames names missing.jsonl, which is not a file in the game folder"),
    (7, "field endgames must be a file name, got 7"),
])
def test_a_bad_endgames_field_is_refused(tmp_path, value, message):
    (tmp_path / "positions.jsonl").write_text("")
    with pytest.raises(GameError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_game(write_game(tmp_path / "ttt", endgames=value))
