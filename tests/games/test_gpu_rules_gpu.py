"""The device rules on the GPU (marker ``gpu``): 10,000 random games per
bundled game played with its rules.cu equal its NumPy rules bit for bit
(search_service/games/gpu_conformance.py), and a tic-tac-toe folder and the
parity game's (8 actions), with rules.cu, written in temporary folders, pass
the GPU half too."""
from __future__ import annotations

from pathlib import Path

import pytest

cupy = pytest.importorskip("cupy")

from game_folders import write_game, write_parity  # noqa: E402

from search_service.games.conformance import Report  # noqa: E402
from search_service.games.gpu_conformance import gpu_check  # noqa: E402
from search_service.games.plugin import bundled_folder, load_game  # noqa: E402

pytestmark = pytest.mark.gpu
TTT_CU = (Path(__file__).resolve().parent / "tic_tac_toe_rules.cu").read_text()


def _gpu_report(plugin, games: int, seed: int = 0) -> Report:
    report = Report(plugin.name, plugin.meta.folder, games, seed, 0)
    gpu_check(plugin, games, seed, report)
    return report


@pytest.mark.parametrize("name", ["othello", "gomoku"])
def test_bundled_game_gpu_playouts_equal_numpy(name):
    report = _gpu_report(load_game(bundled_folder(name)), 10_000)
    assert report.gpu.startswith("GPU playouts: 10000"), report.gpu
    assert report.ok, report.text()


def test_tic_tac_toe_folder_with_rules_cu(tmp_path):
    folder = write_game(tmp_path / "ttt")
    (folder / "rules.cu").write_text(TTT_CU)
    report = _gpu_report(load_game(folder), 2_000, seed=3)
    assert report.ok and report.gpu.startswith("GPU playouts"), report.text()


def test_parity_folder_with_rules_cu(tmp_path):
    report = _gpu_report(load_game(write_parity(tmp_path / "parity")), 2_000, seed=5)
    assert report.ok and report.gpu.startswith("GPU playouts: 2000 random games, 8000 plies"), report.text()


def test_wrong_device_rules_are_caught(tmp_path):
    folder = write_game(tmp_path / "ttt_wrong")
    (folder / "rules.cu").write_text(TTT_CU.replace("reward = -game_returns(s);", "reward = 0.0f;"))
    report = _gpu_report(load_game(folder), 500)
    assert not report.ok and "reward" in str(report.mismatches[0])


def test_rules_cu_that_does_not_compile_names_the_game(tmp_path):
    from search_service.backends import cuda_serves
    from search_service.mcts.games import PluginSearch

    folder = write_game(tmp_path / "ttt_broken", name="ttt_broken")
    (folder / "rules.cu").write_text(TTT_CU.replace("RULE void game_initial", "RULE void game_initial_typo"))
    why = cuda_serves(PluginSearch(load_game(folder)))
    assert why is not None and "ttt_broken" in why and "does not compile" in why
