"""`tandem play --game` and the reference engine client in the games the
search service serves besides Connect Four, against real servers on loopback
(CPU); and the bundled position sets: valid, and exactly what their
documented command makes."""
from __future__ import annotations

import json

import pytest

from search_service.games.plugin import bundled_folder, load_game
from search_service.games.positions import main as positions_main
from search_service.games.positions import random_positions, read_positions
from stack import cli
from stack.play import PlayOptions, game_positions_file, play, print_report
from tandem import engine_client


@pytest.mark.parametrize("name", ["othello", "gomoku"])
def test_the_bundled_position_sets_are_what_their_command_makes(name, tmp_path):
    game = load_game(bundled_folder(name))
    assert game.meta.positions == game.meta.folder / "positions.jsonl"
    made = random_positions(game, 300, 42)  # the command's defaults (search_service/games/positions.py)
    assert game.meta.positions.read_text() == "".join(json.dumps(r) + "\n" for r in made)
    moves = read_positions(game.meta.positions)
    assert len(set(moves)) == 300
    for record in made[:50]:
        state = game.rules.parse_moves(record["moves"])
        assert not game.rules.is_terminal(state)[0] and 2 <= record["plies"] <= game.meta.max_moves // 2


def test_the_positions_command_writes_into_a_folder_and_refuses_a_bad_range(tmp_path, capsys):
    folder = tmp_path / "othello"
    folder.mkdir()
    yaml_text = (bundled_folder("othello") / "game.yaml").read_text()
    (folder / "game.yaml").write_text("".join(line for line in yaml_text.splitlines(True)
                                              if not line.startswith(("positions:", "endgames:"))))  # sets to be made
    (folder / "rules.py").write_text((bundled_folder("othello") / "rules.py").read_text())
    assert positions_main([str(folder), "--count", "5", "--seed", "1", "--out", "few.jsonl"]) == 0
    assert len(read_positions(folder / "few.jsonl")) == 5
    assert positions_main([str(folder), "--min-plies", "9", "--max-plies", "3"]) == 1
    assert "plies must satisfy 0 <= min (9) <= max (3) <= 118" in capsys.readouterr().err


def test_a_position_file_that_is_not_one_names_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"moves": "f5"}\n{"move": "d6"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a position record"):
        read_positions(bad)


@pytest.mark.parametrize("name", ["othello", "gomoku"])
def test_play_a_game_of_the_search_service(cpu_stack, name, capsys):
    cfg = cpu_stack
    opts = PlayOptions(cfg.search.address, cfg.reward.address, late_answers=True, frames=4, fps=10.0, simulations=12,
                       evaluator="rollout", game=name, position_sets=(game_positions_file(cfg.search.games, name),))
    report = play(opts, cfg, log=None)
    assert report["game"] == name and report["frames"] == report["frames_answered"] == 4 and not report["errors"]
    assert 1 <= report["simulations_per_frame"]["min"] <= 12
    # No solver's labels in these sets: nothing is scored against one, and the printed report says so.
    assert report["solver"] is False and report["proven"]["solver_agrees"] is None
    assert report["optimal_move_rate"] is report["best_score_move_rate"] is report["value_sign_agreement"] is None
    assert report["backends"]["search"] == ["cpu_reference"] and report["backends"]["evaluator"] == ["EVALUATOR_ROLLOUT"]
    assert report["backends"]["reward_execution_provider"].startswith("none")
    print_report(report)
    out = capsys.readouterr().out
    assert f"game                   {name}" in out and "no solver's labels in this position set" in out
    assert not any(line.startswith(("optimal_move_rate", "best_score_move_rate", "value_sign_agreement"))
                   for line in out.splitlines())  # no comparison with a solver that is not there
    assert "as the solver" not in out and "positions not lost" not in out


def test_play_othello_endgames_is_scored_against_the_exact_labels(cpu_stack, capsys):
    """A folder's endgames carry an exact solver's labels: each move is scored
    as Connect Four's are (keeps the result or not), with no value model."""
    cfg = cpu_stack
    args = cli.parser().parse_args(["play", "--game", "othello", "--positions", "endgames.jsonl", "--frames", "6",
                                    "--fps", "10", "--simulations", "64", "--evaluator", "rollout", "--late-answers"])
    report = play(cli._play_options(args, cfg), cfg, log=None)
    assert report["solver"] is True and report["frames_answered"] == 6 and not report["errors"]
    assert report["positions_not_lost"] >= 1 and 0.0 <= report["optimal_move_rate"] <= 1.0
    assert 0.0 <= report["best_score_move_rate"] <= 1.0 and report["value_sign_agreement"] is None
    print_report(report)
    out = capsys.readouterr().out
    assert "optimal_move_rate" in out and "no solver's labels" not in out


def test_play_options_find_the_games_set_and_refuse_what_is_not_there(cpu_stack):
    cfg = cpu_stack
    args = cli.parser().parse_args(["play", "--game", "gomoku", "--frames", "2"])
    opts = cli._play_options(args, cfg)
    assert opts.game == "gomoku" and opts.position_sets == (str(bundled_folder("gomoku") / "positions.jsonl"),)
    with pytest.raises(RuntimeError, match=r"--game chess: not a game of search.games in the config "
                                           r"\(games: connect4, othello, gomoku\)"):
        cli._play_options(cli.parser().parse_args(["play", "--game", "chess"]), cfg)
    with pytest.raises(RuntimeError, match=r"argument --positions: no file 'Test_L3_R1' in game othello's folder "
                                           r"nor at that path \(its sets: endgames.jsonl, positions.jsonl\)"):
        cli._play_options(cli.parser().parse_args(["play", "--game", "othello", "--positions", "Test_L3_R1"]), cfg)
    endgames = cli._play_options(cli.parser().parse_args(["play", "--game", "othello", "--positions",
                                                          "endgames.jsonl"]), cfg)
    assert endgames.position_sets == (str(bundled_folder("othello") / "endgames.jsonl"),)
    default = cli._play_options(cli.parser().parse_args(["play"]), cfg)
    assert default.game == "connect4" and default.position_sets == PlayOptions.position_sets


def test_a_game_folder_without_a_position_set_is_named(tmp_path):
    folder = tmp_path / "ttt"
    folder.mkdir()
    (folder / "game.yaml").write_text("name: ttt\nnum_actions: 9\nstate_words: 1\nobservation: [2, 3, 3]\n"
                                      "players: 2\nmax_moves: 9\n")
    with pytest.raises(RuntimeError, match=r"game 'ttt' \(.*\): its game.yaml names no positions file to play"):
        game_positions_file((str(folder),), "ttt")


@pytest.mark.parametrize("name", ["othello", "gomoku"])
def test_the_engine_client_plays_any_game(cpu_stack, name, capsys):
    assert engine_client.main(["--search", cpu_stack.search.address, "--game", name, "--frames", "3",
                               "--fps", "2"]) == 0
    out = capsys.readouterr().out
    assert "3 frames, " in out and "position:move -:" in out
    line = out.rsplit("position:move ", 1)[1].split()
    rules = load_game(bundled_folder(name)).rules
    for entry in line:  # each answer is a legal move in the game's notation after the moves before it
        moves, move = entry.split(":")
        rules.parse_moves(("" if moves == "-" else moves) + move)  # raises where it is not legal
