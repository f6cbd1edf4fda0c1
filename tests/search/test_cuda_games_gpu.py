"""The CUDA backend over game folders (marker ``gpu``): a search of a
bundled game at fixed simulations and seed with one warp per tree (the CPU
reference's order) equals the CPU reference's, a full node pool of an odd
size too; with several warps a tree keeps the invariants (budget, visits
summing to the simulations, a legal action); a tic-tac-toe folder with a
rules.cu, in a temporary folder, loads and is searched on the GPU (its
solver proving a drawn and a won position), and so is the parity game (8
actions, one state word, every game max_moves long); a folder without
rules.cu goes to the CPU reference, saying why."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import yaml  # noqa: E402
from test_plugin_search import TIC_TAC_TOE_RULES  # noqa: E402

from search_service.backends import GameBackends, cuda_serves  # noqa: E402
from search_service.cuda import CudaBackend  # noqa: E402
from search_service.games.plugin import bundled_folder, load_game  # noqa: E402
from search_service.mcts import tree as tr  # noqa: E402
from search_service.mcts.backend import SearchParams  # noqa: E402
from search_service.mcts.cpu_reference import CpuReferenceBackend  # noqa: E402
from search_service.mcts.games import PluginSearch  # noqa: E402

pytestmark = pytest.mark.gpu
GAMES_DIR = Path(__file__).resolve().parents[1] / "games"  # the test games' rules (tests/games)
TTT_CU = (GAMES_DIR / "tic_tac_toe_rules.cu").read_text()
GAMES = {name: PluginSearch(load_game(bundled_folder(name))) for name in ("othello", "gomoku")}
CPU = CpuReferenceBackend()


def _params(game, sims: int, k: int, seed: int = 7) -> SearchParams:
    return SearchParams(simulations=sims, deadline_ms=None, parallel_sims=k, max_nodes=4 * sims + 8, seed=seed,
                        game=game)


@pytest.mark.parametrize("name", ["othello", "gomoku"])
@pytest.mark.parametrize("k", [1, 8, 32])
def test_one_warp_per_tree_equals_the_cpu_reference(name, k):
    game = GAMES[name]
    roots = np.concatenate([game.rules.initial(1), game.parse_moves(_some_moves(game))])
    gpu, _ = CudaBackend(sims_per_warp=32).search(roots, _params(game, 300, k))
    cpu, _ = CPU.search(roots, _params(game, 300, k))
    for g, c in zip(gpu, cpu):
        assert g.simulations == c.simulations == 300
        np.testing.assert_array_equal(g.visit_counts, c.visit_counts)
        np.testing.assert_allclose(g.q_values, c.q_values, rtol=0, atol=1e-6)
        assert (g.action, g.principal_variation, g.tree_nodes, g.max_depth) == (
            c.action, c.principal_variation, c.tree_nodes, c.max_depth)


def _assert_equal(gpu, cpu):
    for g, c in zip(gpu, cpu):
        assert g.simulations == c.simulations
        np.testing.assert_array_equal(g.visit_counts, c.visit_counts)
        np.testing.assert_allclose(g.q_values, c.q_values, rtol=0, atol=1e-6)
        assert (g.action, g.principal_variation, g.tree_nodes, g.max_depth, g.proven) == (
            c.action, c.principal_variation, c.tree_nodes, c.max_depth, c.proven)


def test_a_ragged_game_batch_whose_rows_fill_holes_equals_the_cpu_reference_alone():
    """Three Othello trees with caps 40, 200 and 120: the first joins alone
    (a slab of one row), the others after its first wave (the slab grows, its
    row copied); row 0 leaves first and row 2 moves into its hole (its tree
    region, tree state, cycles and Philox keys) and goes on there; each search
    equals the same search alone on the CPU reference."""
    from search_service.mcts.batch import step
    from search_service.mcts.plan import Member, WaveTimes

    game = GAMES["othello"]
    roots = np.concatenate([game.rules.initial(1), game.parse_moves(_some_moves(game)), game.rules.initial(1)])
    caps, seeds = [40, 200, 120], [7, 8, 9]
    batch = CudaBackend(sims_per_warp=32).open_batch(_params(game, 200, 8))
    batch.join(roots[:1], [None], seeds[:1], [0])
    members, times, together = [Member(caps[0], None, owner=0)], WaveTimes(), {}
    step(batch, members, times)
    batch.join(roots[1:], [None] * 2, seeds[1:], [0] * 2)
    members += [Member(caps[i], None, owner=i) for i in (1, 2)]
    while members:
        for m, r, _ in step(batch, members, times):
            together[m.owner] = r
    for i, (cap, seed) in enumerate(zip(caps, seeds)):
        (alone,), _ = CPU.search(roots[i : i + 1], _params(game, cap, 8, seed))
        _assert_equal([together[i]], [alone])
        assert together[i].simulations == cap


def test_a_full_pool_of_an_odd_size_equals_the_cpu_reference():
    # 51 slots a tree: Othello's 1,384-byte nodes need the regions of an even slot count
    # (16-byte aligned records), and the pool fills up (refused expansions, TS_EXHAUSTED).
    game = GAMES["othello"]
    roots = np.concatenate([game.rules.initial(1), game.parse_moves("f5"), game.parse_moves("f5d6c3")])
    params = SearchParams(simulations=100, deadline_ms=None, parallel_sims=8, max_nodes=51, seed=3, game=game)
    gpu, _ = CudaBackend(sims_per_warp=32).search(roots, params)
    cpu, _ = CPU.search(roots, params)
    assert all(r.tree_nodes == 51 for r in gpu)
    _assert_equal(gpu, cpu)


def test_parity_folder_is_searched_on_the_gpu_as_on_the_cpu(tmp_path):
    # 8 actions (a node row of 12 records), one state word (two roots join at once), every game
    # exactly max_moves long with a choice at its last ply (selections reach finished nodes at
    # MAX_DEPTH), and an odd max_nodes.
    folder = tmp_path / "parity"
    folder.mkdir()
    (folder / "game.yaml").write_text(yaml.safe_dump({"name": "parity", "num_actions": 8, "state_words": 1,
                                                      "observation": [1, 1, 2], "players": 2, "max_moves": 4}))
    for name in ("rules.py", "rules.cu"):
        (folder / name).write_text((GAMES_DIR / f"parity_{name}").read_text())
    game = PluginSearch(load_game(folder))
    assert cuda_serves(game) is None
    roots = np.concatenate([game.rules.initial(1), game.parse_moves("3")])
    params = SearchParams(simulations=1500, deadline_ms=None, parallel_sims=16, max_nodes=4001, seed=5, game=game)
    gpu, _ = CudaBackend(sims_per_warp=32).search(roots, params)
    cpu, _ = CPU.search(roots, params)
    assert gpu[0].max_depth == 4 and gpu[0].proven != tr.NOT_TERMINAL  # the solver proves the root
    _assert_equal(gpu, cpu)


@pytest.mark.parametrize("name", ["othello", "gomoku"])
def test_many_warps_per_tree_keep_the_invariants(name):
    game = GAMES[name]
    roots = game.rules.initial(16)
    results, _ = CudaBackend(sims_per_warp=1).search(roots, _params(game, 1000, 16))
    legal = game.legal(roots)
    for r, ok in zip(results, legal):
        assert r.simulations == 1000 and r.visit_counts.sum() == 1000
        assert ok[r.action] and (r.visit_counts[~ok] == 0).all()


def test_tic_tac_toe_folder_is_searched_on_the_gpu(tmp_path):
    folder = write_game(tmp_path / "ttt")
    (folder / "rules.cu").write_text(TTT_CU)
    game = PluginSearch(load_game(folder))
    assert cuda_serves(game) is None
    backends = GameBackends(CudaBackend(sims_per_warp=32))
    assert backends.for_game(game) is backends.primary
    # The solver proves these (from the empty board it would need most of the game's tree: the CPU
    # reference proves nothing in 200,000 simulations), and a proven root claims no more simulations.
    roots = np.concatenate([game.parse_moves("159"), game.parse_moves("12")])
    gpu, _ = backends.for_game(game).search(roots, _params(game, 2_000, 8))
    cpu, _ = CPU.search(roots, _params(game, 2_000, 8))
    assert [r.proven for r in gpu] == [tr.PROVEN_DRAW, tr.PROVEN_WIN]
    assert all(r.simulations < 2_000 for r in gpu)
    _assert_equal(gpu, cpu)


def test_folder_without_rules_cu_goes_to_the_cpu_reference(tmp_path):
    game = PluginSearch(load_game(write_game(tmp_path / "ttt_numpy_only", name="ttt_numpy_only")))
    why = cuda_serves(game)
    assert why is not None and "ttt_numpy_only" in why and "rules.cu" in why
    backends = GameBackends(CudaBackend())
    assert backends.for_game(game).name == "cpu_reference"


def write_game(folder: Path, name: str = "tic_tac_toe") -> Path:
    """A tic-tac-toe folder (NumPy rules only) named ``name`` in ``folder``."""
    folder.mkdir(parents=True)
    (folder / "game.yaml").write_text(yaml.safe_dump({"name": name, "num_actions": 9, "state_words": 1,
                                                      "observation": [2, 3, 3], "players": 2, "max_moves": 9}))
    (folder / "rules.py").write_text(TIC_TAC_TOE_RULES)
    return folder


def _some_moves(game) -> str:
    rng = np.random.default_rng(5)
    state, actions = game.rules.initial(1), []
    for _ in range(10):
        legal = np.flatnonzero(game.legal(state)[0])
        actions.append(int(rng.choice(legal)))
        state = game.play(state, np.array(actions[-1:]))
    return game.rules.moves_to_text(actions)
