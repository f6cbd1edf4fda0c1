"""Every loaded game served at once over real gRPC on loopback (CPU
reference): Connect Four, the bundled Othello and Gomoku, and a game folder
written outside the repository (tic-tac-toe) listed in ``search.games``;
ListGames, searches, batches and sessions per game; each bad input's status
naming the game; and start-up refusing a folder that does not load, with one
line naming the folder and the cause."""
from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from conftest import free_port, loopback_config
from tandem.v1 import search_pb2, search_pb2_grpc

from search_service import server as search_server
from search_service.games.plugin import bundled_folder, load_game
from tandem.config import ConfigError, loopback_data, parse_config
from tandem.server import channel

TIC_TAC_TOE_RULES = (Path(__file__).resolve().parents[1] / "games" / "tic_tac_toe_rules.py").read_text()
TIC_TAC_TOE = {"name": "tic_tac_toe", "num_actions": 9, "state_words": 1, "observation": [2, 3, 3], "players": 2,
               "max_moves": 9}


def write_game(folder: Path, rules: str = TIC_TAC_TOE_RULES, **fields) -> Path:
    folder.mkdir(parents=True)
    (folder / "game.yaml").write_text(yaml.safe_dump({**TIC_TAC_TOE, **fields}))
    (folder / "rules.py").write_text(rules)
    return folder


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    ttt = write_game(tmp_path_factory.mktemp("elsewhere") / "ttt")
    cfg = loopback_config(search={"backend": "cpu", "max_deadline_ms": 5000, "max_batch_searches": 4,
                                  "games": ["search_service/games/othello", "search_service/games/gomoku", str(ttt)]})
    search = search_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.search.address)
    yield search_pb2_grpc.SearchServiceStub(ch)
    ch.close()
    search.stop()


def req(game: str, moves: str = "", **kw) -> search_pb2.SearchRequest:
    kw.setdefault("simulations", 60)
    return search_pb2.SearchRequest(game=game, moves=moves, **kw)


def finished_othello_moves() -> str:
    """A move string of one random Othello game played to its end."""
    rules = load_game(bundled_folder("othello")).rules
    rng, state, actions = np.random.default_rng(3), rules.initial(1), []
    while not rules.is_terminal(state)[0]:
        actions.append(int(rng.choice(np.flatnonzero(rules.legal_mask(state)[0]))))
        state = rules.step(state, np.array(actions[-1:]))[0]
    return rules.moves_to_text(actions)


# -- served ----------------------------------------------------------------------------


def test_list_games_says_what_each_game_offers(stack):
    games = {g.name: g for g in stack.ListGames(search_pb2.ListGamesRequest()).games}
    assert sorted(games) == ["connect4", "gomoku", "othello", "tic_tac_toe"]
    for name, (actions, rows) in {"othello": (65, 8), "gomoku": (225, 15), "tic_tac_toe": (9, 3)}.items():
        g = games[name]
        assert (g.num_actions, g.rows, g.columns) == (actions, rows, rows)
        assert list(g.evaluators) == [search_pb2.EVALUATOR_ROLLOUT] and g.value_model == ""  # rollouts only
        assert g.backend == "cpu_reference" and not g.backend_note and not g.boards
    assert games["connect4"].value_model == "connect4_value" and games["connect4"].boards


@pytest.mark.parametrize("game, moves, actions", [("othello", "f5d6", 65), ("gomoku", "h8h9", 225),
                                                  ("tic_tac_toe", "5", 9), ("connect4", "44", 7)])
def test_each_game_is_searched_in_its_notation(stack, game, moves, actions):
    r = stack.Search(req(game, moves, seed=5), timeout=60)
    assert r.simulations == 60 == sum(r.visit_counts) and len(r.visit_counts) == len(r.q_values) == actions
    assert r.visit_counts[r.action] == max(r.visit_counts) and r.backend == "cpu_reference"
    assert r.evaluator == search_pb2.EVALUATOR_ROLLOUT and r.principal_variation_moves.startswith(r.move)
    again = stack.Search(req(game, moves + r.move, seed=5), timeout=60)  # the answer is a legal move there
    assert again.simulations == 60 or again.proven


def test_a_batch_of_one_game_and_games_at_once(stack):
    rs = stack.SearchBatch(search_pb2.SearchBatchRequest(searches=[req("othello", m, seed=1) for m in
                                                                   ("", "f5", "f5d6")]), timeout=60).results
    alone = stack.Search(req("othello", "f5", seed=1), timeout=60)
    assert [r.simulations for r in rs] == [60, 60, 60] and list(rs[1].visit_counts) == list(alone.visit_counts)
    import concurrent.futures as cf  # every game's searches in flight together: one lane each

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stack.Search, req(g, m, deadline_ms=200, simulations=0), timeout=60)
                   for g, m in (("othello", ""), ("gomoku", "h8"), ("connect4", "4"), ("tic_tac_toe", ""))]
        assert all(f.result().simulations > 0 for f in futures)


def test_sessions_are_kept_per_game(stack):
    rules = load_game(bundled_folder("othello")).rules
    first = stack.Search(req("othello", "f5", simulations=400, session_id="s1", seed=2), timeout=60)
    state = rules.parse_moves("f5" + first.move)
    reply = rules.move_to_text(int(np.flatnonzero(rules.legal_mask(state)[0])[0]))
    follow = stack.Search(req("othello", "f5" + first.move + reply, simulations=50, session_id="s1", seed=2),
                          timeout=60)
    assert follow.tree_reused  # re-rooted at the position two moves on (by the position: "--" is one move)
    # Gomoku under the same id is another session; 300 simulations expand every reply to f5.
    other = stack.Search(req("gomoku", "f5", simulations=300, session_id="s1", seed=3), timeout=60)
    assert not other.tree_reused
    again = stack.Search(req("gomoku", "f5h8", simulations=20, session_id="s1", seed=3), timeout=60)
    assert again.tree_reused  # the node of h8 (every reply has one) is the root now


# -- refused -------------------------------------------------------------------------------

BAD = [
    ("unknown game", req("chess"), grpc.StatusCode.NOT_FOUND,
     "game: unknown game 'chess' (games: ['connect4', 'gomoku', 'othello', 'tic_tac_toe'])"),
    ("othello illegal move", req("othello", "f5f5"), grpc.StatusCode.INVALID_ARGUMENT,
     "moves: not a legal othello move string: character 3"),
    ("othello bad notation", req("othello", "z9"), grpc.StatusCode.INVALID_ARGUMENT,
     "moves: not a legal othello move string: character 1"),
    ("gomoku off the board", req("gomoku", "h8p1"), grpc.StatusCode.INVALID_ARGUMENT,
     "moves: not a legal gomoku move string: character 3"),
    ("connect4 notation in othello", req("othello", "44"), grpc.StatusCode.INVALID_ARGUMENT,
     "moves: not a legal othello move string"),
    ("othello finished", req("othello", finished_othello_moves()), grpc.StatusCode.INVALID_ARGUMENT,
     "position: the game is already over (won or drawn): a finished othello position"),
    ("board for othello", req("othello", board=search_pb2.Board(rows=8, columns=8, cells=b"\0" * 64)),
     grpc.StatusCode.INVALID_ARGUMENT, "board: game othello takes positions as move strings only"),
    ("value model for gomoku", req("gomoku", evaluator=search_pb2.EVALUATOR_VALUE_MODEL),
     grpc.StatusCode.INVALID_ARGUMENT, "evaluator: game gomoku has no value model"),
]


@pytest.mark.parametrize("why, request_, code, message", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_name_the_game_and_the_others_keep_serving(stack, why, request_, code, message):
    with pytest.raises(grpc.RpcError) as info:
        stack.Search(request_, timeout=30)
    assert info.value.code() == code and message in info.value.details(), info.value.details()
    assert stack.Search(req("gomoku", "h8", simulations=8), timeout=30).simulations == 8


def test_a_batch_of_two_games_is_refused(stack):
    with pytest.raises(grpc.RpcError) as info:
        stack.SearchBatch(search_pb2.SearchBatchRequest(searches=[req("othello"), req("gomoku")]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "searches: one game per call, got 'gomoku', 'othello'" in info.value.details()


def test_a_bad_position_in_a_batch_is_named(stack):
    with pytest.raises(grpc.RpcError) as info:
        stack.SearchBatch(search_pb2.SearchBatchRequest(searches=[req("othello"), req("othello", "a1")]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "searches[1].moves: not a legal othello move string: character 1" in info.value.details()


# -- start-up: the config's folders -----------------------------------------------------------


def config_with_games(games: list[str]):
    return parse_config(loopback_data(free_port, sections={"search": {"backend": "cpu", "games": games}}))


def test_the_config_lists_the_bundled_games_by_default():
    assert config_with_games(["search_service/games/othello"]).search.games == ("search_service/games/othello",)
    assert parse_config({}).search.games == ("search_service/games/othello", "search_service/games/gomoku")
    assert parse_config(loopback_data(free_port, sections={"search": {"games": []}})).search.games == ()


@pytest.mark.parametrize("games, message", [
    (["nowhere/at/all"], "search.games[0]: nowhere/at/all: no such folder"),
    (["search_service/games"], "search.games[0]: search_service/games: the folder has no game.yaml"),
    (["search_service/games/othello", "search_service/games/othello/"],
     "search.games[1]: search_service/games/othello/ is also search.games[0]"),
    ([""], "search.games[0]: must be a folder path, got an empty string"),
    ("search_service/games/othello", "search.games: expected a list"),
])
def test_the_config_refuses_folders_that_are_not_game_folders(games, message):
    with pytest.raises(ConfigError, match=None) as info:
        config_with_games(games)
    assert message in str(info.value)


@pytest.mark.parametrize("fields, rules, message", [
    (dict(num_actions="nine"), TIC_TAC_TOE_RULES, "field num_actions must be an integer, got 'nine'"),
    (dict(), "raise ImportError('no numpy here')", "rules.py raised on import: ImportError: no numpy here"),
    (dict(name="connect4"), TIC_TAC_TOE_RULES, "the name 'connect4' is taken (built in)"),
    (dict(max_moves=3), TIC_TAC_TOE_RULES, "its first search failed: RuntimeError: game tic_tac_toe: a rollout "
                                           "lasted more than max_moves (3) plies"),
])
def test_a_folder_that_does_not_load_stops_start_up_with_one_line(tmp_path, fields, rules, message):
    folder = write_game(tmp_path / "bad", rules, **fields)
    cfg = config_with_games(["search_service/games/othello", str(folder)])
    with pytest.raises(RuntimeError) as info:
        search_server.start(cfg, follow_scheduler=False)
    text = str(info.value)
    assert "\n" not in text and message in text, text
    assert text.startswith("search.games[1]: game ") or "its first search failed" in text
    assert str(folder.resolve()) in text


def test_a_name_taken_by_an_earlier_folder_is_refused(tmp_path):
    a, b = write_game(tmp_path / "a"), write_game(tmp_path / "b")
    with pytest.raises(RuntimeError, match=r"search.games\[1\]: game 'tic_tac_toe' .*the name 'tic_tac_toe' is "
                                           r"taken \(search.games\[0\]\)"):
        search_server.start(config_with_games([str(a), str(b)]), follow_scheduler=False)
