"""The search and reward services as several worker processes on one
address (``search.workers``, ``reward.workers``; tandem/workers.py): `tandem
serve` as a real process on loopback (CPU reference, CPU execution provider),
its workers listening on the same port, calls over new connections all
answered and counted on worker 0's metrics endpoint (every worker's metrics
merged), a dead worker started again while the others serve (its live gauges
dropped; one that keeps dying stops the server) and SIGTERM stopping every
worker, its metrics directory removed."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families
from tandem.v1 import reward_pb2, reward_pb2_grpc, search_pb2, search_pb2_grpc

from tandem import multiprocess_metrics, tensors
from tandem.config import ConfigError, load_config, loopback_data
from tandem.server import health_status
from tandem.workers import FIRST_DELAY_S, MAX_DELAY_S, MAX_IN_A_ROW, WINDOW_S, Restarts, check_free, children

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0


def _listeners(port: int) -> int:
    """Sockets listening on 127.0.0.1:``port`` (state 0A; gRPC's may be IPv6 sockets, v4-mapped)."""
    want, count = f"0100007F:{port:04X}", 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            count += sum(1 for line in f.readlines()[1:] if line.split()[1].endswith(want) and line.split()[3] == "0A")
    return count


def _poll(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@contextlib.contextmanager
def _serve(tmp_path, name: str, sections: dict, count: int):
    """`tandem serve NAME` with ``count`` workers: (process, config, port), once
    every worker listens; killed on exit if still running."""
    data = loopback_data(free_port, sections=sections)
    path = tmp_path / "tandem.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    port = int(getattr(cfg, name).address.rpartition(":")[2])
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "stack", "serve", name, "--config", str(path)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    try:
        assert _poll(lambda: _listeners(port) == count or proc.poll() is not None, START_TIMEOUT_S)
        assert _listeners(port) == count, log.read_text()[-3000:]
        yield proc, cfg, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.fixture()
def workers(tmp_path):
    """`tandem serve search` with three workers and metrics: (process, config, port)."""
    search = {"backend": "cpu", "evaluator": "rollout", "workers": 3, "metrics_port": free_port()}
    with _serve(tmp_path, "search", {"search": search}, 3) as served:
        yield served


def _search_calls(metrics_port: int) -> float:
    """Search calls counted on http://127.0.0.1:``metrics_port``/metrics (every code)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tandem_rpc_latency_seconds_count" and s.labels["method"].endswith("/Search"))


def _metrics_dir(worker: int) -> Path:
    """The metrics directory (PROMETHEUS_MULTIPROC_DIR) process ``worker`` inherited."""
    env = dict(e.split(b"=", 1) for e in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0") if b"=" in e)
    return Path(env[multiprocess_metrics.ENV.encode()].decode())


def _own_search_calls(directory: Path, pid: int) -> float:
    """Search calls process ``pid`` counted (its own file in ``directory``)."""
    from prometheus_client.multiprocess import MultiProcessCollector

    return sum(s.value for m in MultiProcessCollector.merge([str(directory / f"histogram_{pid}.db")])
               for s in m.samples
               if s.name == "tandem_rpc_latency_seconds_count" and s.labels["method"].endswith("/Search"))


def test_three_workers_listen_on_one_port_and_answer_calls_on_new_connections(workers):
    proc, cfg, port = workers
    assert len(children(proc.pid)) >= 2  # workers 1 and 2 (spawn may add its resource tracker)
    request = search_pb2.SearchRequest(game="connect4", moves="4453", simulations=32, seed=1)
    answers = []
    for _ in range(24):  # each a connection of its own: the kernel spreads them over the workers
        with grpc.insecure_channel(cfg.search.address) as ch:
            answers.append(search_pb2_grpc.SearchServiceStub(ch).Search(request, timeout=30))
    assert {(a.action, a.simulations) for a in answers} == {(answers[0].action, 32)}  # same seed: same answer
    # Worker 0's endpoint counts every worker's calls, whichever served them.
    assert _search_calls(cfg.search.metrics_port) == 24
    directory = _metrics_dir(_workers_of(proc.pid)[0])
    own = [_own_search_calls(directory, pid) for pid in (proc.pid, *_workers_of(proc.pid))]
    assert sum(own) == 24 and sum(1 for n in own if n) >= 2, own  # 24 connections: never all on one worker
    with pytest.raises(RuntimeError, match=f"could not bind 127.0.0.1:{port}"):
        check_free(cfg.search.address)  # held by the workers: a stale server would be seen


def test_two_reward_workers_answer_evaluates_on_new_connections(tmp_path):
    with _serve(tmp_path, "reward", {"reward": {"execution_provider": "cpu", "workers": 2}}, 2) as (proc, cfg, _):
        board = np.zeros((1, 2, 6, 7), np.uint8)
        board[0, 0, 0, 3] = 1
        request = reward_pb2.EvaluateRequest(model="connect4_value", inputs=[tensors.to_proto("board", board)],
                                             request_class=reward_pb2.REQUEST_CLASS_CRITICAL)
        values = set()
        for _ in range(12):  # each a connection of its own
            with grpc.insecure_channel(cfg.reward.address) as ch:
                reply = reward_pb2_grpc.RewardServiceStub(ch).Evaluate(request, timeout=60)
                values.add(round(float(tensors.from_proto(reply.outputs[0]).reshape(-1)[0]), 5))
        assert len(values) == 1  # one model, one answer, whichever worker
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def _workers_of(pid: int) -> list[int]:
    """The worker processes of server ``pid`` (spawn's resource tracker left out)."""
    def is_worker(child: int) -> bool:
        try:
            return b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            return False
    return [c for c in children(pid) if is_worker(c)]


def test_a_worker_that_dies_starts_again_while_the_others_serve(workers):
    proc, cfg, port = workers
    before = _workers_of(proc.pid)
    assert len(before) == 2
    directory = _metrics_dir(before[-1])
    assert list(directory.glob(f"gauge_live*_{before[-1]}.db"))  # its live gauges (e.g. searches in flight)
    os.kill(before[-1], signal.SIGKILL)
    request = search_pb2.SearchRequest(game="connect4", moves="4453", simulations=8, seed=1)
    # A new connection: a live worker takes it (one the kernel queued on the dead worker's socket
    # as it died is reset, and the channel connects again: wait_for_ready).
    with grpc.insecure_channel(cfg.search.address) as ch:
        assert search_pb2_grpc.SearchServiceStub(ch).Search(request, timeout=30, wait_for_ready=True).simulations == 8
    assert proc.poll() is None  # the server serves on
    assert _poll(lambda: _listeners(port) == 3 and len(_workers_of(proc.pid)) == 2, START_TIMEOUT_S)
    after = _workers_of(proc.pid)
    assert before[0] in after and before[-1] not in after  # the dead one replaced, the other untouched
    assert not list(directory.glob(f"gauge_live*_{before[-1]}.db"))  # its live gauges count no more
    assert (directory / f"histogram_{before[-1]}.db").exists()  # its counts stay in the sums


def test_a_worker_that_keeps_dying_gives_up_after_its_deaths_in_a_row():
    restarts = Restarts({1: 0.0}, {})
    delays = [restarts.died(1, 1.0) for _ in range(MAX_IN_A_ROW)]
    assert delays == [min(FIRST_DELAY_S * 2 ** n, MAX_DELAY_S) for n in range(MAX_IN_A_ROW)]
    assert restarts.died(1, 2.0) is None  # the server stops; tandem up's policy takes over
    restarts.started[1] = 10.0
    assert restarts.died(1, 10.0 + WINDOW_S) == FIRST_DELAY_S  # a run of WINDOW_S starts a new series
    assert restarts.died(2, 0.0) == FIRST_DELAY_S  # each worker its own series


def test_sigterm_stops_every_worker(workers):
    proc, _, port = workers
    kids = children(proc.pid)
    directory = _metrics_dir(_workers_of(proc.pid)[0])
    assert directory.is_dir()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert not directory.exists()  # removed by the first process as it exits
    assert _poll(lambda: _listeners(port) == 0 and not any(os.path.exists(f"/proc/{k}") for k in kids), 30)


def test_sigterm_while_the_workers_start_stops_everything_cleanly(tmp_path):
    """A stop signal that comes once the first process serves, while its
    workers are still starting, is kept (tandem.server.catch_stop_signals):
    no further worker starts, and the server drains and exits 0 as soon as
    the one starting serves, instead of dying of the signal (-15) and leaving
    its workers to their parent-death signal."""
    data = loopback_data(free_port, sections={"search": {"backend": "cpu", "evaluator": "rollout", "workers": 3}})
    path = tmp_path / "tandem.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    port = int(cfg.search.address.rpartition(":")[2])
    proc = subprocess.Popen([sys.executable, "-m", "stack", "serve", "search", "--config", str(path)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "search.log", "w"))
    try:
        assert _poll(lambda: health_status(cfg.search.address, cfg) == "SERVING" or proc.poll() is not None,
                     START_TIMEOUT_S), (tmp_path / "search.log").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)  # the workers are starting one after another meanwhile
        assert proc.wait(120) == 0, (tmp_path / "search.log").read_text()[-3000:]
        assert _poll(lambda: _listeners(port) == 0, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_bound_port_is_not_free_and_workers_are_bounded(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(RuntimeError, match=f"could not bind {address}"):
            check_free(address)
    check_free(address)  # closed: free again
    path = tmp_path / "tandem.yaml"
    path.write_text(yaml.safe_dump({"search": {"workers": 65}}))
    with pytest.raises(ConfigError, match="search.workers"):
        load_config(path)
    path.write_text(yaml.safe_dump({"co_located": True, "reward": {"workers": 2}}))
    with pytest.raises(ConfigError, match="reward.workers: 2 with co_located: true"):
        load_config(path)
