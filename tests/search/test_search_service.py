"""SearchService over real gRPC on loopback (CPU reference backend), with the
reward service's real value model for the PUCT evaluator."""
from __future__ import annotations

import grpc
import pytest
from conftest import loopback_config
from tandem.v1 import search_pb2, search_pb2_grpc

from reward_service import server as reward_server
from search_service import server as search_server
from search_service.games import connect4
from tandem.positions import load_set
from tandem.server import channel


@pytest.fixture(scope="module")
def stack():
    cfg = loopback_config(search={"backend": "cpu", "max_simulations": 100_000, "max_deadline_ms": 5000})
    reward = reward_server.start(cfg, follow_scheduler=False)
    search = search_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.search.address)
    yield search_pb2_grpc.SearchServiceStub(ch), search, reward, cfg
    ch.close()
    search.stop()
    reward.stop()


def req(**kw):
    kw.setdefault("game", "connect4")
    return search_pb2.SearchRequest(**kw)


def test_list_games(stack):
    stub = stack[0]
    games = stub.ListGames(search_pb2.ListGamesRequest()).games
    assert [(g.name, g.num_actions, g.rows, g.columns) for g in games] == [
        ("connect4", 7, 6, 7), ("gomoku", 225, 15, 15), ("othello", 65, 8, 8)]
    c4 = games[0]
    assert list(c4.evaluators) == [search_pb2.EVALUATOR_ROLLOUT, search_pb2.EVALUATOR_VALUE_MODEL]
    assert c4.value_model == "connect4_value" and c4.boards and c4.backend == "cpu_reference" and not c4.backend_note


def test_search_answers_with_everything(stack):
    stub = stack[0]
    r = stub.Search(req(moves="4453", simulations=300, seed=7), timeout=30)
    assert r.simulations == 300 and sum(r.visit_counts) == 300
    assert len(r.visit_counts) == len(r.q_values) == 7
    assert r.visit_counts[r.action] == max(r.visit_counts) and r.move == str(r.action + 1)
    assert r.principal_variation[0] == r.action and r.principal_variation_moves.startswith(r.move)
    assert -1.0 <= r.root_value <= 1.0 and r.backend == "cpu_reference"
    assert r.evaluator == search_pb2.EVALUATOR_ROLLOUT
    lat = r.latency
    assert lat.total_ms >= lat.select_ms + lat.expand_ms + lat.evaluate_ms + lat.backup_ms > 0
    assert r.max_depth >= 1 and r.tree_nodes > 1


def test_a_request_naming_no_evaluator_gets_search_evaluators_auto_choice(stack):
    """search.evaluator: auto (the default): rollouts on the CPU reference
    (the request above named none and got them), the value model on CUDA."""
    _, search, _, cfg = stack
    assert cfg.search.evaluator == "auto" and search.servicer.default_evaluator == "rollout"
    assert search_server.default_evaluator("auto", "cuda") == "value_model"
    assert search_server.default_evaluator("auto", "cpu_reference") == "rollout"
    assert search_server.default_evaluator("value_model", "cpu_reference") == "value_model"
    assert search_server.default_evaluator("rollout", "cuda") == "rollout"


def test_seeded_search_is_repeatable(stack):
    stub = stack[0]
    a = stub.Search(req(moves="44", simulations=200, seed=3), timeout=30)
    b = stub.Search(req(moves="44", simulations=200, seed=3), timeout=30)
    assert list(a.visit_counts) == list(b.visit_counts)


def test_immediate_win_is_found_from_moves_and_from_board(stack):
    stub = stack[0]
    # First player has three in column 1 and wins by playing it again.
    r = stub.Search(req(moves="121212", simulations=200), timeout=30)
    assert r.action == 0 and r.root_value == 1.0 and r.proven == search_pb2.PROVEN_RESULT_WIN
    assert r.simulations < 200  # played at once, the win proven
    cells = connect4.to_cells(connect4.parse_moves("121212"))[0].tobytes()
    board = search_pb2.Board(rows=6, columns=7, cells=cells)
    r = stub.Search(req(board=board, simulations=200), timeout=30)
    assert r.action == 0
    r = stub.Search(req(moves="121212", board=board, simulations=50), timeout=30)
    assert r.action == 0


def test_deadline_budget(stack):
    stub = stack[0]
    r = stub.Search(req(moves="4", deadline_ms=20), timeout=30)
    assert r.simulations > 0 and r.deadline_reached


def test_value_model_evaluator_uses_the_reward_service(stack):
    stub = stack[0]
    r = stub.Search(req(moves="121212", simulations=64, evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=30)
    assert r.evaluator == search_pb2.EVALUATOR_VALUE_MODEL
    assert r.action == 0 and r.latency.evaluate_ms > 0


def test_session_reuses_the_tree_between_moves(stack):
    stub = stack[0]
    first = stub.Search(req(moves="44", simulations=400, session_id="game-1", seed=1), timeout=30)
    assert not first.tree_reused
    reply = str(first.action + 1)
    follow = stub.Search(req(moves="44" + reply + "3", simulations=100, session_id="game-1"), timeout=30)
    assert follow.tree_reused
    # The kept subtree's visits are on top of this request's 100 simulations.
    assert sum(follow.visit_counts) > 100
    other = stub.Search(req(moves="11", simulations=50, session_id="game-1"), timeout=30)
    assert not other.tree_reused  # a different game under the same id starts fresh


def test_strength_on_real_positions(stack):
    """A sanity check of the served search, not a benchmark: on endgame positions
    with a forced win the served search keeps the win most of the time."""
    stub = stack[0]
    wins = [p for p in load_set("Test_L3_R1") if p.score > 0][:30]
    kept = sum(p.keeps_result(stub.Search(req(moves=p.moves, simulations=800, seed=5), timeout=60).action) for p in wins)
    assert kept >= 27


BAD = [
    ("unknown game", dict(game="chess", simulations=10), grpc.StatusCode.NOT_FOUND, "game: unknown game 'chess'"),
    ("empty game", dict(game="", simulations=10), grpc.StatusCode.NOT_FOUND, "game: unknown game ''"),
    ("non-digit move", dict(moves="44x", simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "moves:"),
    ("column 0", dict(moves="40", simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "moves:"),
    ("column 8", dict(moves="48", simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "moves:"),
    ("full column", dict(moves="4444444", simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "moves:"),
    ("move after a win", dict(moves="12121213", simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "moves:"),
    ("finished game", dict(moves="1212121", simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "position: the game is already over"),
    ("unicode", dict(moves="4٤", simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "moves:"),
    ("board wrong size", dict(board=search_pb2.Board(rows=6, columns=7, cells=b"\0" * 41), simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "board:"),
    ("board bad dims", dict(board=search_pb2.Board(rows=7, columns=6, cells=b"\0" * 42), simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "board:"),
    ("board bad value", dict(board=search_pb2.Board(rows=6, columns=7, cells=b"\3" + b"\0" * 41), simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "board:"),
    ("floating stone", dict(board=search_pb2.Board(rows=6, columns=7, cells=b"\0" * 7 + b"\1" + b"\0" * 34), simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "board:"),
    ("impossible counts", dict(board=search_pb2.Board(rows=6, columns=7, cells=b"\2" + b"\0" * 41), simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "board:"),
    ("board and moves differ", dict(moves="4", board=search_pb2.Board(rows=6, columns=7, cells=b"\1" + b"\0" * 41), simulations=10), grpc.StatusCode.INVALID_ARGUMENT, "board: does not match"),
    ("no budget", dict(moves="4"), grpc.StatusCode.INVALID_ARGUMENT, "set at least one budget"),
    ("negative deadline", dict(moves="4", deadline_ms=-5), grpc.StatusCode.INVALID_ARGUMENT, "deadline_ms: must be a finite number"),
    ("nan deadline", dict(moves="4", deadline_ms=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "deadline_ms"),
    ("inf deadline", dict(moves="4", deadline_ms=float("inf")), grpc.StatusCode.INVALID_ARGUMENT, "deadline_ms"),
    ("absurd deadline", dict(moves="4", deadline_ms=1e9), grpc.StatusCode.INVALID_ARGUMENT, "deadline_ms: 1000000000.0 exceeds"),
    ("absurd simulations", dict(moves="4", simulations=4_000_000_000), grpc.StatusCode.INVALID_ARGUMENT, "simulations: 4000000000 exceeds"),
    ("unknown evaluator", dict(moves="4", simulations=10, evaluator=9), grpc.StatusCode.INVALID_ARGUMENT, "evaluator: unknown value 9"),
]


@pytest.mark.parametrize("why, fields, code, message", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_a_clear_status_and_the_server_keeps_serving(stack, why, fields, code, message):
    stub = stack[0]
    fields.setdefault("game", "connect4")
    with pytest.raises(grpc.RpcError) as info:
        stub.Search(search_pb2.SearchRequest(**fields), timeout=30)
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()
    assert stub.Search(req(moves="4", simulations=20), timeout=30).simulations == 20


def test_value_model_down_degrades_to_rollouts():
    cfg = loopback_config(search={"backend": "cpu"})  # nothing serves cfg.reward.address
    search = search_server.start(cfg, follow_scheduler=False)
    try:
        with channel(cfg.search.address) as ch:
            r = search_pb2_grpc.SearchServiceStub(ch).Search(
                req(moves="121212", simulations=50, evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=30
            )
        # The model valued nothing; the search went on in the same PUCT tree with rollouts and says so.
        assert r.evaluator == search_pb2.EVALUATOR_ROLLOUT and r.action == 0
        assert r.model_simulations == 0 and 0 < r.simulations < 50 and r.handoff == "grpc"
        assert r.proven == search_pb2.PROVEN_RESULT_WIN  # the rollouts' tree proved the win
        assert "UNAVAILABLE" in r.evaluation_failure
    finally:
        search.stop()


def test_a_hung_reward_service_cannot_hold_a_search_past_its_deadline():
    """The reward service accepts connections but never answers: the value-model
    search gives up on it at its own deadline and answers from its tree."""
    import socket

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen()
    cfg = loopback_config(search={"backend": "cpu", "reward_address": f"127.0.0.1:{hung.getsockname()[1]}"})
    search = search_server.start(cfg, follow_scheduler=False)
    try:
        with channel(cfg.search.address) as ch:
            r = search_pb2_grpc.SearchServiceStub(ch).Search(
                req(moves="44", deadline_ms=50, evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=30
            )
        # The root's evaluation could not finish by the deadline: the search answers
        # then, from the tree it has (no simulation yet: the lowest legal move).
        assert r.deadline_reached and r.model_simulations == 0 and r.simulations == 0
        assert "DEADLINE_EXCEEDED" in r.evaluation_failure and r.action == 0
        # Bounded by the 50 ms deadline, not by the evaluator's 2 s timeout (whose wait alone would
        # take 2000 ms or more: the bound leaves a slow machine 1.85 s of margin).
        assert r.latency.total_ms < 1900
    finally:
        search.stop()
        hung.close()
