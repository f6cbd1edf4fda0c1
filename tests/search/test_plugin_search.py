"""The CPU reference MCTS over game plug-ins: Connect Four through the plug-in
path grows exactly the bundled Connect Four's trees; Othello (65 actions, the
pass) and Gomoku (225) search with the tree invariants, the solver, tree
reuse and the batch of trees; a game folder written outside the repository
(tic-tac-toe) is searched and solved; and what a plug-in cannot do is refused
with the game named."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from search_service.backends import GameBackends, cuda_available, cuda_serves
from search_service.games.plugin import bundled_folder, load_game
from search_service.mcts import tree as tr
from search_service.mcts.backend import SearchParams
from search_service.mcts.cpu_reference import CpuReferenceBackend
from search_service.mcts.games import CONNECT_FOUR, PluginSearch
from search_service.mcts.rollout import plugin_rollout_values, rollout_values

HERE = Path(__file__).resolve().parent
TIC_TAC_TOE_RULES = (HERE.parent / "games" / "tic_tac_toe_rules.py").read_text()
BACKEND = CpuReferenceBackend()
OTHELLO = PluginSearch(load_game(bundled_folder("othello")))
GOMOKU = PluginSearch(load_game(bundled_folder("gomoku")))
FIELDS = ("node_state", "node_terminal", "node_visits", "node_parent", "node_action", "children", "edge_visits",
          "edge_value", "edge_vloss", "prior", "num_nodes")


def folder_game(folder: Path, rules: str, **meta) -> PluginSearch:
    """The game plug-in ``rules`` (rules.py's text) with game.yaml ``meta``, written in ``folder``."""
    folder.mkdir(parents=True)
    (folder / "game.yaml").write_text(yaml.safe_dump({"players": 2, **meta}))
    (folder / "rules.py").write_text(rules)
    return PluginSearch(load_game(folder))


@pytest.fixture(scope="module")
def c4_plugin(tmp_path_factory) -> PluginSearch:
    """Connect Four's rules as a game folder outside the repository."""
    return folder_game(tmp_path_factory.mktemp("games") / "c4", (HERE / "connect4_plugin_rules.py").read_text(),
                       name="connect4_plugin", num_actions=7, state_words=2, observation=[2, 6, 7], max_moves=42)


@pytest.fixture(scope="module")
def tic_tac_toe(tmp_path_factory) -> PluginSearch:
    return folder_game(tmp_path_factory.mktemp("games") / "ttt", TIC_TAC_TOE_RULES, name="tic_tac_toe",
                       num_actions=9, state_words=1, observation=[2, 3, 3], max_moves=9)


def search(game, moves: list[str], trees=None, **kw):
    roots = game.stack([game.parse_moves(m) for m in moves])
    params = SearchParams(**{"simulations": None, "deadline_ms": None, "game": game, **kw})
    return BACKEND.search(roots, params, None, trees)


def check_invariants(game, tree: tr.Tree) -> None:
    """A single tree's structure: links, visits, no virtual loss left, and
    every node's state is its parent's after the edge's action."""
    n = int(tree.num_nodes[0])
    kids = tree.children[0, :n]
    assert kids.shape == (n, game.num_actions) and kids.max() < n and kids.min() >= tr.ILLEGAL
    assert not tree.edge_vloss[0, :n].any()
    visits = tree.edge_visits[0, :n]
    assert (visits[kids == tr.ILLEGAL] == 0).all()
    assert (np.abs(tree.edge_value[0, :n]) <= visits + 1e-3).all()
    if n > 1:
        nodes = np.arange(1, n)
        parent, action = tree.node_parent[0, nodes], tree.node_action[0, nodes].astype(np.int64)
        assert (kids[parent, action] == nodes).all()
        assert (visits[parent, action] == tree.node_visits[0, nodes]).all()
        assert (game.play(tree.node_state[0, parent], action) == tree.node_state[0, nodes]).all()
        legal = game.legal(tree.node_state[0, :n])
        assert ((kids != tr.ILLEGAL) == legal).all()  # none in finished positions; proven ones keep theirs


# -- Connect Four through the plug-in path ------------------------------------------


def test_generic_rollouts_equal_connect_fours(c4_plugin):
    rng = np.random.default_rng(1)
    states = []
    for _ in range(300):  # random unfinished positions
        s = CONNECT_FOUR.parse_moves("")
        for _ in range(int(rng.integers(0, 30))):
            st = CONNECT_FOUR.as_states(s)
            legal = np.flatnonzero(CONNECT_FOUR.legal(st)[0])
            nxt = CONNECT_FOUR.play(st, np.array([rng.choice(legal)]))
            if CONNECT_FOUR.terminal_code(nxt)[0] != tr.NOT_TERMINAL:
                break
            s = nxt
        states.append(CONNECT_FOUR.as_states(s))
    states = np.concatenate(states)
    sims, trees = np.arange(len(states)), rng.integers(0, 5, len(states))
    fast = rollout_values(states[:, 0].copy(), states[:, 1].copy(), sims, trees, 99)
    generic = plugin_rollout_values(c4_plugin.rules, 42, states, sims, trees, 99)
    assert np.array_equal(fast, generic) and {-1.0, 1.0} <= set(fast.tolist())


@pytest.mark.parametrize("k", [1, 16])
def test_connect_four_as_a_plugin_grows_the_same_trees(c4_plugin, k):
    moves = ["", "4453", "44444433", "1234567"]
    bundled = search(CONNECT_FOUR, moves, simulations=300, parallel_sims=k, seed=11)
    plugin = search(c4_plugin, moves, simulations=300, parallel_sims=k, seed=11)
    for (r1, t1), (r2, t2) in zip(zip(*bundled), zip(*plugin)):
        assert np.array_equal(r1.visit_counts, r2.visit_counts) and r1.proven == r2.proven
        assert r1.principal_variation == r2.principal_variation
        for name in FIELDS:
            a, b = getattr(t1, name), getattr(t2, name)
            assert np.array_equal(a, b), name


# -- Othello and Gomoku ---------------------------------------------------------------


@pytest.mark.parametrize("game, moves", [(OTHELLO, ["", "f5d6c3"]), (GOMOKU, ["", "h8h9"])])
@pytest.mark.parametrize("k", [1, 8])
def test_plugin_games_search_with_the_invariants(game, moves, k):
    results, trees = search(game, moves, simulations=120, parallel_sims=k, seed=4)
    for text, r, t in zip(moves, results, trees):
        assert r.simulations == 120 == int(r.visit_counts.sum()) == t.node_visits[0, 0]
        assert r.visit_counts.shape == r.q_values.shape == (game.num_actions,)
        legal = game.legal(game.parse_moves(text))[0]
        assert legal[r.action] and not r.visit_counts[~legal].any()
        assert t.node_action.dtype == (np.int8 if game.num_actions <= 127 else np.int16)
        check_invariants(game, t)
        game.parse_moves(text + "".join(game.move_to_text(a) for a in r.principal_variation))  # a legal line


@pytest.mark.parametrize("game", [OTHELLO, GOMOKU])
def test_plugin_search_is_deterministic_and_alone_equals_batched(game):
    (alone,), (t_alone,) = search(game, [""], simulations=64, parallel_sims=8, seed=21)
    results, trees = search(game, ["", ""], simulations=64, parallel_sims=8, seed=21)
    assert np.array_equal(alone.visit_counts, results[0].visit_counts)
    for name in FIELDS:
        assert np.array_equal(getattr(t_alone, name), getattr(trees[0], name)), name


def test_othello_tree_reuse_continues_the_statistics():
    (r,), (t,) = search(OTHELLO, ["f5"], simulations=300, parallel_sims=4, seed=2)
    a = r.action
    child = int(t.children[0, 0, a])
    kept = t.edge_visits[0, child].copy()
    rerooted = BACKEND.reroot(t, [a])
    moved = "f5" + OTHELLO.move_to_text(a)
    assert OTHELLO.same_position(rerooted.root_positions(), OTHELLO.parse_moves(moved))
    assert np.array_equal(rerooted.edge_visits[0, 0], kept)
    found = BACKEND.reroot_to(t, OTHELLO.parse_moves(moved))
    assert found is not None and np.array_equal(found.edge_visits[0, 0], kept)
    (r2,), (t2,) = search(OTHELLO, [moved], trees=[rerooted], simulations=50, parallel_sims=4)
    assert r2.tree_reused and int(r2.visit_counts.sum()) == int(kept.sum()) + 50
    check_invariants(OTHELLO, t2)


def test_a_tree_of_another_game_is_replaced(c4_plugin):
    _, (t,) = search(CONNECT_FOUR, ["4"], simulations=30)
    (r,), _ = search(c4_plugin, ["4"], trees=[t], simulations=30)
    assert not r.tree_reused and int(r.visit_counts.sum()) == 30


def test_othello_plays_the_pass_where_it_is_the_only_move():
    rng = np.random.default_rng(0)
    rules = OTHELLO.rules
    while True:  # random games until the side to move has only the pass
        state, actions = rules.initial(1), []
        while not rules.is_terminal(state)[0]:
            legal = np.flatnonzero(rules.legal_mask(state)[0])
            if legal.tolist() == [64] and actions:
                break
            actions.append(int(rng.choice(legal)))
            state = rules.step(state, np.array(actions[-1:]))[0]
        if not rules.is_terminal(state)[0]:
            break
    (r,), _ = search(OTHELLO, [rules.moves_to_text(actions)], simulations=20, parallel_sims=4)
    assert r.action == 64 and OTHELLO.move_to_text(r.action) == "--" and r.visit_counts[64] == r.simulations > 0


def test_finished_othello_positions_carry_their_result():
    rng = np.random.default_rng(5)
    rules = OTHELLO.rules
    seen = set()
    for _ in range(40):
        state = rules.initial(1)
        while not rules.is_terminal(state)[0]:
            state = rules.step(state, np.array([rng.choice(np.flatnonzero(rules.legal_mask(state)[0]))]))[0]
        code = int(OTHELLO.terminal_code(state)[0])
        want = {-1.0: tr.TERMINAL_LOSS, 0.0: tr.TERMINAL_DRAW, 1.0: tr.PROVEN_WIN}[float(rules.returns(state)[0])]
        assert code == want
        seen.add(code)
    assert {tr.TERMINAL_LOSS, tr.PROVEN_WIN} <= seen  # the side to move both loses and wins some


# -- a game folder outside the repository: searched and solved --------------------------


def test_tic_tac_toe_solver_finds_the_win_and_the_loss(tic_tac_toe):
    # X: 1, 2 (top row), O: 5, 9; X to move wins with 3.
    (r,), _ = search(tic_tac_toe, ["1529"], simulations=200, parallel_sims=4)
    assert tic_tac_toe.move_to_text(r.action) == "3" and r.proven == tr.PROVEN_WIN and r.root_value == 1.0
    # O to move after X's fork (X: 1, 5, 7 threatens 4 and 3; O: 2, 9 threatens nothing): every reply loses.
    (r,), _ = search(tic_tac_toe, ["12597"], simulations=2000, parallel_sims=4)
    assert r.proven == tr.PROVEN_LOSS and r.root_value == -1.0


def test_tic_tac_toe_is_a_proven_draw(tic_tac_toe):
    # X: 5, 9, 2; O: 1, 3; O to move must block 8, and neither side gets a line.
    (r,), (t,) = search(tic_tac_toe, ["51932"], simulations=5000, parallel_sims=4, seed=1)
    assert r.proven == tr.PROVEN_DRAW and r.root_value == 0.0 and r.simulations < 20000  # stopped once proven
    check_invariants(tic_tac_toe, t)


def test_plugin_search_with_a_deadline_answers(tic_tac_toe):
    (r,), _ = search(GOMOKU, ["h8"], deadline_ms=1.0, parallel_sims=4)
    assert r.simulations >= 4 and GOMOKU.legal(GOMOKU.parse_moves("h8"))[0, r.action]


# -- refused -----------------------------------------------------------------------------


def test_a_rollout_past_max_moves_names_the_game(tmp_path):
    liar = folder_game(tmp_path / "ttt", TIC_TAC_TOE_RULES, name="short_ttt", num_actions=9, state_words=1,
                       observation=[2, 3, 3], max_moves=3)
    with pytest.raises(RuntimeError, match=r"game short_ttt: a rollout lasted more than max_moves \(3\)"):
        search(liar, [""], simulations=4)


def test_plugin_games_have_no_value_model():
    with pytest.raises(ValueError, match="game othello has no value model"):
        SearchParams(simulations=1, deadline_ms=None, evaluator="value_model", game=OTHELLO)


def test_finished_plugin_roots_are_refused(tic_tac_toe):
    with pytest.raises(ValueError, match="root 0 is a finished game"):
        search(tic_tac_toe, ["14253"], simulations=4)


def test_the_cuda_backend_serves_connect_four_and_folders_with_device_rules(tmp_path):
    assert cuda_serves(CONNECT_FOUR) is None
    if cuda_available() is not None:  # here (no GPU): Othello's rules.cu cannot be compiled
        assert "othello" in cuda_serves(OTHELLO) and "needs the CUDA backend" in cuda_serves(OTHELLO)
    numpy_only = folder_game(tmp_path / "ttt", TIC_TAC_TOE_RULES, name="ttt_numpy_only", num_actions=9,
                             state_words=1, observation=[2, 3, 3], max_moves=9)
    assert "has no rules.cu" in cuda_serves(numpy_only)


class _ConnectFourOnly:
    """Stands in for the CUDA backend (no GPU here): a primary backend that
    serves Connect Four alone, as ``CudaBackend.serves`` says."""

    name = "cuda"
    serves = staticmethod(cuda_serves)


def test_games_the_primary_backend_cannot_search_go_to_the_cpu_reference():
    backends = GameBackends(_ConnectFourOnly(), rollout_slice_ms=1.0)
    assert backends.for_game(CONNECT_FOUR) is backends.primary
    cpu = backends.for_game(OTHELLO)
    assert cpu.name == "cpu_reference" and cpu.rollout_slice_ms == 1.0 and backends.for_game(GOMOKU) is cpu
    assert "gomoku" in backends.why_not_primary(GOMOKU)  # here: its rules.cu needs a GPU to compile
    cpu_only = GameBackends(BACKEND)
    assert cpu_only.for_game(OTHELLO) is BACKEND and cpu_only.why_not_primary(OTHELLO) is None
