"""The reference engine client (tandem/engine_client.py) against real
servers on loopback: handshake, a move per frame, evaluations, and what it
does on each kind of failure (bad request, wrong token, server away and
back)."""
from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from conftest import loopback_config

from search_service import server as search_server
from tandem import engine_client
from tandem.engine_client import Action, ContractError, EngineClient, handshake, open_channel

MODEL = "connect4_value"
BUDGET_MS = 2000.0  # generous: the test checks behaviour, not speed


@pytest.fixture(scope="module")
def servers(cpu_stack):
    return cpu_stack


def test_handshake_checks_version_service_and_capabilities(servers):
    with open_channel(servers.search.address) as ch:
        reply = handshake(ch, "tandem.v1.SearchService", ("search.sessions",))
        assert reply.api_version == "tandem.v1" and reply.api_revision >= engine_client.API_REVISION
        assert "tandem.v1.ContractService" in reply.services
        with pytest.raises(ContractError, match="lacks"):
            handshake(ch, "tandem.v1.SearchService", ("search.time_travel",))
    with open_channel(servers.reward.address) as ch:
        reply = handshake(ch, "tandem.v1.RewardService", ("reward.request_classes",))
        assert reply.max_message_bytes > 0 and reply.keepalive_min_ping_interval_ms <= engine_client.KEEPALIVE_TIME_MS


def test_a_move_per_frame_and_an_evaluation(servers):
    with open_channel(servers.search.address) as s, open_channel(servers.reward.address) as r:
        client = EngineClient(s, r)
        answer = client.best_move("44", BUDGET_MS)
        assert answer.code == grpc.StatusCode.OK and answer.called and answer.move in list("1234567")
        boards = np.zeros((3, 2, 6, 7), np.uint8)
        out = client.evaluate(MODEL, {"board": boards}, timeout_s=30)
        assert out["value"].shape == (3, 1) and out["policy_logits"].shape == (3, 7)


def test_a_bad_request_is_a_contract_error_naming_the_field(servers):
    with open_channel(servers.search.address) as s, open_channel(servers.reward.address) as r:
        client = EngineClient(s, r)
        with pytest.raises(ContractError, match="INVALID_ARGUMENT"):
            client.best_move("99", BUDGET_MS)  # no column 9
        with pytest.raises(ContractError, match="NOT_FOUND.*nope"):
            client.evaluate("nope", {"board": np.zeros((1, 2, 6, 7), np.uint8)}, timeout_s=30)
        assert not client.backoff.waiting()  # a bug in the request is not a reason to back off
        assert client.best_move("4", BUDGET_MS).move  # and the server keeps serving


def test_a_wrong_token_is_a_configuration_error():
    cfg = dataclasses.replace(loopback_config(search={"backend": "cpu"}), auth_token="s3cret")
    search = search_server.start(cfg, follow_scheduler=False)
    try:
        with open_channel(cfg.search.address) as ch:
            with pytest.raises(ContractError, match="UNAUTHENTICATED"):
                handshake(ch, "tandem.v1.SearchService")
    finally:
        search.stop()
    with pytest.raises(ContractError, match="TLS"):
        open_channel(cfg.search.address, token="s3cret")


def test_server_away_falls_back_backs_off_and_reconnects():
    cfg = loopback_config(search={"backend": "cpu"})
    with open_channel(cfg.search.address) as ch:  # nothing listens there yet
        client = EngineClient(ch)
        answer = client.best_move("", 500.0)
        assert answer.move is None and answer.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        if answer.code == grpc.StatusCode.UNAVAILABLE:
            assert client.backoff.until > 0
        search = search_server.start(cfg, follow_scheduler=False)
        try:
            deadline = time.monotonic() + 60
            move = None
            while move is None and time.monotonic() < deadline:
                answer = client.best_move("", BUDGET_MS)
                move = answer.move
                if move is None:
                    time.sleep(0.05)
            assert move in list("1234567"), "the client never got through after the server came up"
            assert not client.backoff.waiting()
        finally:
            search.stop()


def test_backoff_skips_calls_while_waiting_and_grows():
    b = engine_client.Backoff(initial_s=10.0, max_s=40.0, rng=random.Random(1))
    waits = [b.failed() for _ in range(4)]
    assert all(0 <= w <= 40.0 for w in waits) and b.waiting()
    b.succeeded()
    assert not b.waiting()


def test_every_status_code_has_an_action():
    assert set(engine_client.ACTIONS) == set(grpc.StatusCode)
    assert engine_client.ACTIONS[grpc.StatusCode.DEADLINE_EXCEEDED] is Action.FALLBACK
    assert engine_client.ACTIONS[grpc.StatusCode.RESOURCE_EXHAUSTED] is Action.BACK_OFF


def test_runs_as_a_program(servers):
    r = subprocess.run([sys.executable, "-m", "tandem.engine_client", "--search", servers.search.address,
                        "--frames", "8", "--fps", "5"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tandem.v1 revision" in r.stdout and "8 frames" in r.stdout


@pytest.mark.parametrize("target, says", [
    # a reward service where the search was meant: what is there, and where the search service usually is
    ("reward", "found the reward service there, not the search service (the search service's default address: "
               "127.0.0.1:50052)"),
    ("dead", "is the search service running at that address?"),  # nothing listens
])
def test_as_a_program_a_wrong_address_is_one_line_and_exit_1(servers, target, says):
    address = servers.reward.address if target == "reward" else "127.0.0.1:1"
    r = subprocess.run([sys.executable, "-m", "tandem.engine_client", "--search", address, "--frames", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("argv, says", [
    (["--search", "localhost"], "argument --search: the address needs HOST:PORT (the search service's default: "
                                "127.0.0.1:50052), got 'localhost'"),
    (["--search", "127.0.0.1:50052", "--frames", "0"], "argument --frames: expected a number above 0, got '0'"),
])
def test_as_a_program_a_bad_argument_is_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as done:
        engine_client.main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and says in err, err
