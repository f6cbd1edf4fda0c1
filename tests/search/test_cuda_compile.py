"""Every CUDA module compiles (CPU: NVRTC only, no GPU, no CUDA context).

Connect Four's module and each bundled game folder's (its rules.cu with
tandem's kernels, search_service/cuda/game_module.py) go through NVRTC to
PTX for compute_90, as CuPy would compile them on the H200. Skipped where
no libnvrtc is found (search_service/cuda/nvrtc_check.py: TANDEM_NVRTC, or
pip's nvidia-cuda-nvrtc-cu12).
"""
from __future__ import annotations

import pytest

from search_service.cuda import game_module, module, nvrtc_check
from search_service.games.metadata import GameError
from search_service.games.plugin import bundled_folder, load_game

pytestmark = pytest.mark.skipif(nvrtc_check.find_nvrtc() is None, reason="no libnvrtc (pip install nvidia-cuda-nvrtc-cu12)")


def _kernels(ptx: str) -> set[str]:
    return {line.split()[-1].split("(")[0] for line in ptx.splitlines() if line.startswith(".visible .entry")}


def test_connect_four_module_compiles():
    ptx = nvrtc_check.compile_ptx(module.source(), options=module.OPTIONS)
    assert {"mcts_rollout_global", "mcts_vm_select", "finish_trees", "game_playouts"} <= _kernels(ptx)


@pytest.mark.parametrize("name", ["othello", "gomoku"])
def test_bundled_game_modules_compile(name):
    meta = load_game(bundled_folder(name)).meta
    ptx = nvrtc_check.compile_ptx(game_module.source(meta), name=name, options=module.OPTIONS)
    assert set(game_module.KERNELS) <= _kernels(ptx)
    assert "mcts_vm_select" not in _kernels(ptx)  # rollouts only


def test_rules_disagreeing_with_game_yaml_do_not_compile():
    meta = load_game(bundled_folder("othello")).meta
    rules = (meta.folder / "rules.cu").read_text().replace("#define RULES_NUM_ACTIONS 65", "#define RULES_NUM_ACTIONS 64")
    with pytest.raises(nvrtc_check.CompileError, match="num_actions differs"):
        nvrtc_check.compile_ptx(game_module.source(meta, rules), options=module.OPTIONS)


def test_action_count_over_the_limit_is_a_game_error(tmp_path):
    from dataclasses import replace

    meta = replace(load_game(bundled_folder("gomoku")).meta, num_actions=5000)
    with pytest.raises(GameError, match="over the CUDA kernels' limit"):
        game_module.source(meta)


def test_parity_test_rules_compile(tmp_path):
    import yaml

    from search_service.games.metadata import read_metadata

    here = __import__("pathlib").Path(__file__).resolve().parents[1] / "games"
    (tmp_path / "game.yaml").write_text(yaml.safe_dump({"name": "parity", "num_actions": 8, "state_words": 1,
                                                        "observation": [1, 1, 2], "players": 2, "max_moves": 4}))
    source = game_module.source(read_metadata(tmp_path), (here / "parity_rules.cu").read_text())
    assert "#define GAME_EIGHT_LANES 0" in source  # a folder's nodes are wide, even with 8 actions
    ptx = nvrtc_check.compile_ptx(source, options=module.OPTIONS)
    assert set(game_module.KERNELS) <= _kernels(ptx)


def test_tic_tac_toe_test_rules_compile(tmp_path):
    import yaml

    from search_service.games.metadata import read_metadata

    here = __import__("pathlib").Path(__file__).resolve().parents[1] / "games"
    (tmp_path / "game.yaml").write_text(yaml.safe_dump({"name": "tic_tac_toe", "num_actions": 9, "state_words": 1,
                                                        "observation": [2, 3, 3], "players": 2, "max_moves": 9}))
    rules = (here / "tic_tac_toe_rules.cu").read_text()
    ptx = nvrtc_check.compile_ptx(game_module.source(read_metadata(tmp_path), rules), options=module.OPTIONS)
    assert "game_playouts" in _kernels(ptx)
