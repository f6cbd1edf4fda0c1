"""The conformance kit: tic-tac-toe written in a temporary folder passes it
against OpenSpiel; rules that are wrong, or that treat a batch differently
from one state, fail it; its command's output and exit status."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
from game_folders import broken, write_game, write_parity

from search_service.games import conformance
from search_service.games.conformance import check_folder
from search_service.games.plugin import bundled_folder

needs_pyspiel = pytest.mark.skipif(importlib.util.find_spec("pyspiel") is None,
                                   reason="pyspiel is not importable (pip install open-spiel)")


@needs_pyspiel
def test_tic_tac_toe_from_a_temporary_folder_passes_against_openspiel(tmp_path):
    report = check_folder(write_game(tmp_path / "ttt"), games=3000, seed=1, single_games=200)
    assert report.ok, report.text()
    assert report.openspiel.startswith("OpenSpiel tic_tac_toe: legal actions, terminal flags")
    assert 3000 * 5 <= report.plies <= 3000 * 9
    assert report.text().endswith("mismatches: 0\nOK")


@needs_pyspiel
def test_a_wrong_rule_is_caught_with_its_move_string(tmp_path):
    # No anti-diagonal: a line 3-5-7 does not end the game.
    rules = broken("[0b100010001, 0b001010100]", "[0b100010001]")
    report = check_folder(write_game(tmp_path / "ttt", rules=rules), games=500, seed=1)
    assert not report.ok and report.count == len(report.mismatches) > 0
    first = report.mismatches[0]
    assert first.what.startswith("openspiel: terminal True, ours False")
    assert first.ply == len(first.moves) and set("357") <= set(first.moves)
    text = report.text()
    assert f"mismatches: {report.count}" in text and text.endswith("NOT CONFORMANT")
    assert text.count("\n  game ") == min(report.count, conformance.SHOWN)


@needs_pyspiel
def test_a_wrong_othello_rule_is_caught(tmp_path):
    folder = tmp_path / "othello"
    shutil.copytree(bundled_folder("othello"), folder, ignore=shutil.ignore_patterns("__pycache__"))
    rules = folder / "rules.py"
    # Runs of up to 5 discs instead of 6: long lines go unflipped and unseen.
    rules.write_text(rules.read_text().replace("_RUN_STEPS = SIZE - 3", "_RUN_STEPS = SIZE - 4"))
    report = check_folder(folder, games=300, seed=2, single_games=0)
    assert report.count > 0 and report.mismatches[0].what.startswith("openspiel: ")


def test_rules_that_step_a_batch_unlike_one_state_are_caught_without_openspiel(tmp_path):
    # The player to move taken from the first state of the batch for all of them.
    rules = broken("to_play(states).astype(_U64)", "to_play(states[:1]).astype(_U64)")
    report = check_folder(write_game(tmp_path / "ttt", rules=rules, drop=("openspiel",)), games=50, seed=3)
    assert report.openspiel == "OpenSpiel comparison skipped: game.yaml names no openspiel game"
    assert not report.ok
    assert any("step on one state differs from step on the batch" in m.what for m in report.mismatches)


def test_a_reward_for_the_wrong_player_is_caught_without_openspiel(tmp_path):
    rules = broken("return nxt, terminal, -returns(nxt)", "return nxt, terminal, returns(nxt)")
    report = check_folder(write_game(tmp_path / "ttt", rules=rules, drop=("openspiel",)), games=200, seed=4)
    assert not report.ok
    assert all(m.what.startswith("self: the mover's reward -1.0 but returns -1.0") for m in report.mismatches)


def test_step_taking_an_illegal_action_is_caught(tmp_path):
    rules = broken("    if not legal[np.arange(actions.size), actions].all():\n",
                   "    if False:\n")
    report = check_folder(write_game(tmp_path / "ttt", rules=rules, drop=("openspiel",)), games=20, seed=5)
    assert not report.ok
    assert "without a ValueError" in report.mismatches[0].what


def test_a_rule_that_raises_mid_run_stops_the_run_with_a_report(tmp_path):
    rules = broken("    x, o = _marks(states)\n    return (_count(x) > _count(o)).astype(np.int8)",
                   "    x, o = _marks(states)\n    if (x != 0).all():\n        raise RuntimeError('bug')\n"
                   "    return (_count(x) > _count(o)).astype(np.int8)")
    report = check_folder(write_game(tmp_path / "ttt", rules=rules, drop=("openspiel",)), games=20)
    assert not report.ok and report.mismatches[-1].game == -1
    assert report.mismatches[-1].what == "the run stopped: RuntimeError: bug"


def test_without_pyspiel_the_openspiel_part_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyspiel", None)  # import pyspiel now raises ImportError
    report = check_folder(write_game(tmp_path / "ttt"), games=100)
    assert report.ok
    assert report.openspiel == ("OpenSpiel comparison skipped: pyspiel is not importable (pip install open-spiel) "
                                "to compare with 'tic_tac_toe'")


@needs_pyspiel
def test_an_unknown_openspiel_game_fails(tmp_path):
    report = check_folder(write_game(tmp_path / "ttt", openspiel="tic_tac_toes"), games=10)
    assert not report.ok and "pyspiel cannot load 'tic_tac_toes'" in report.mismatches[0].what


def test_the_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="games must be >= 1"):
        check_folder(write_game(tmp_path / "ttt"), games=0)


# -- the command -------------------------------------------------------------------


def test_the_command_passes_a_good_folder_and_fails_a_bad_one(tmp_path, capsys):
    good = write_game(tmp_path / "good", drop=("openspiel",))
    assert conformance.main([str(good), "--games", "50", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"tic_tac_toe ({good.resolve()}): 50 random games (seed 7), ") and out.endswith("OK\n")

    bad = write_game(tmp_path / "bad", drop=("openspiel",),
                     rules=broken("return nxt, terminal, -returns(nxt)", "return nxt, terminal, returns(nxt)"))
    assert conformance.main([str(bad), "--games", "50"]) == 1
    assert capsys.readouterr().out.endswith("NOT CONFORMANT\n")


def test_the_command_exits_2_on_a_folder_that_does_not_load(tmp_path, capsys):
    assert conformance.main([str(tmp_path / "nowhere"), "--games", "5"]) == 2
    assert capsys.readouterr().err == f"game {tmp_path / 'nowhere'}: no such game folder\n"


def test_python_m_runs_the_kit_on_a_bundled_game_by_name():
    out = subprocess.run([sys.executable, "-m", "search_service.games.conformance", "othello", "--games", "20",
                          "--single-games", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("othello (") and out.stdout.endswith("OK\n")


def test_tandem_check_game_runs_the_kit_with_its_exit_status(capsys):
    from stack import cli

    assert cli.main(["check-game", "othello", "--games", "40", "--single-games", "5"]) == 0
    assert "mismatches: 0" in capsys.readouterr().out
    assert cli.main(["check-game", "/nonexistent/game"]) == 2
    assert "no such game folder" in capsys.readouterr().err


def test_the_parity_test_game_is_conformant_without_a_gpu(tmp_path):
    # The GPU tests search it on the device (tests/search/test_cuda_games_gpu.py); its NumPy rules first.
    report = check_folder(write_parity(tmp_path / "parity"), games=300, seed=4, single_games=30, gpu=False)
    assert report.ok, report.text()
    assert report.plies == 300 * 4 and not report.gpu
