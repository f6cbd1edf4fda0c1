"""Supervision and the command line, with real processes on loopback:

* ``tandem up`` starts a SIGKILLed server again while the others keep serving,
  ``tandem status`` shows the restart; a server that keeps dying is
  crash-looping: restarted on at a growing delay while the others keep
  serving, with its last log line in the output and ``tandem status``, or,
  with ``--on-crash-loop stop``, all stop with a clear message;
* Ctrl-C (SIGINT to the command's process group, as a terminal sends it) stops
  ``tandem up``, ``play`` and ``demo`` promptly with a truthful exit code;
* ``tandem status`` and ``tandem play`` say which service is down;
* every bad argument gets one line and exit code 2.

Every wait polls with a generous timeout: nothing here depends on the machine's speed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from conftest import free_port
from tandem.v1 import search_pb2, search_pb2_grpc

from loadtest.chaos import stack_processes
from tandem.config import load_config, loopback_data
from tandem.server import channel, health_status

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 120.0  # three servers starting on 2 busy cores
TANDEM = [sys.executable, "-m", "stack"]


@pytest.fixture
def config_file(tmp_path) -> Path:
    data = loopback_data(free_port, bulk_server=False)
    data["search"]["backend"] = "cpu"
    data["scheduler"]["report_interval_ms"] = 100
    path = tmp_path / "tandem.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Command:
    """A ``tandem`` command in a process group of its own (as a terminal runs
    it), its output collected by a thread."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([*TANDEM, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = START_TIMEOUT_S) -> None:
        _poll(lambda: text in self.output or self.proc.poll() is not None, timeout_s)
        assert text in self.output, f"no {text!r} in:\n{self.output}"

    def ctrl_c(self, timeout_s: float = 60.0) -> tuple[int, float]:
        """SIGINT to the whole process group; (exit code, seconds it took to exit)."""
        sent = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return code, time.monotonic() - sent

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _poll(predicate, timeout_s: float, step_s: float = 0.1) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _search(cfg, evaluator=search_pb2.EVALUATOR_VALUE_MODEL) -> search_pb2.SearchResponse | None:
    """One small search of the opening; None when it was refused."""
    with channel(cfg.search.address, cfg) as ch:
        try:
            return search_pb2_grpc.SearchServiceStub(ch).Search(
                search_pb2.SearchRequest(game="connect4", moves="44", simulations=8, evaluator=evaluator), timeout=10)
        except grpc.RpcError:
            return None


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=120, check=False)


def test_a_killed_server_is_restarted_and_the_others_keep_serving(config_file, tmp_path):
    cfg = load_config(config_file)
    up = Command("up", "--config", str(config_file), "--log-dir", str(tmp_path / "logs"))
    try:
        up.wait_for("tandem is up")
        before = stack_processes(up.proc.pid)
        assert set(before) == {"scheduler", "reward", "search"}
        assert _poll(lambda: (r := _search(cfg)) is not None and r.evaluator == search_pb2.EVALUATOR_VALUE_MODEL, 60)

        os.kill(before["reward"], signal.SIGKILL)
        up.wait_for("reward exited (status -9): restarting it in 0.5 s")
        # The search service keeps answering (from rollouts while the value model is away).
        assert _search(cfg) is not None
        assert _poll(lambda: stack_processes(up.proc.pid).get("reward", before["reward"]) != before["reward"], 60)
        assert _poll(lambda: health_status(cfg.reward.address, cfg) == "SERVING", START_TIMEOUT_S)
        up.wait_for("reward is SERVING again, ")  # the supervisor watched its start-up to the end
        # ... and its channel to the new reward service is connected again: the value model is back.
        assert _poll(lambda: (r := _search(cfg)) is not None and r.evaluator == search_pb2.EVALUATOR_VALUE_MODEL, 60)
        after = stack_processes(up.proc.pid)
        assert after["scheduler"] == before["scheduler"] and after["search"] == before["search"]

        status = _tandem("status", "--config", str(config_file))
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"supervisor: tandem up (pid {up.proc.pid})" in status.stdout
        assert f"{'reward':<11} pid {after['reward']:<8} running, 1 restarts (last exit -9)" in status.stdout
        assert f"{'search':<11} pid" in status.stdout and "running, 0 restarts" in status.stdout

        code, _ = up.ctrl_c()
        assert code == 0, up.output
        assert "stopped: scheduler exit 0, reward exit 0, search exit 0" in up.output
        assert _poll(lambda: not any(_alive(p) for p in after.values()), 15), "orphaned servers"
    finally:
        up.kill()


def test_a_crash_looping_server_is_restarted_on_while_the_others_keep_serving(config_file, tmp_path):
    """The reward service's model is broken while it runs and it is killed: every restart exits at
    start. tandem up (without --log-dir: the last line comes through its own output) says it is
    crash-looping and why, restarts it at a growing delay, and the others keep serving until Ctrl-C."""
    model = tmp_path / "connect4_value.onnx"
    model.write_bytes(Path("reward_service/models/connect4_value.onnx").read_bytes())
    data = yaml.safe_load(config_file.read_text())
    data["reward"]["models"] = [{"name": "connect4_value", "path": str(model)}]
    config_file.write_text(yaml.safe_dump(data))
    cfg = load_config(config_file)
    up = Command("up", "--config", str(config_file), "--max-restarts", "2", "--restart-window-s", "600")
    try:
        up.wait_for("tandem is up")
        before = stack_processes(up.proc.pid)
        model.write_text("this is not an ONNX model\n")
        os.kill(before["reward"], signal.SIGKILL)
        up.wait_for("reward is crash-looping: exited (status 1) after 2 restarts in a row")
        up.wait_for("reward is crash-looping: exited (status 1) after 3 restarts in a row")
        loop = [line for line in up.lines if "reward is crash-looping" in line]
        assert str(model) in loop[0] and "its last log line: " in loop[0], loop[0]
        # The delay grows: 0.5, 1 (before the loop), then 2, 4 (the cap is 60 s).
        delays = [float(line.split("restarting it in ")[1].split(" s")[0]) for line in up.lines
                  if "reward" in line and "restarting it in" in line]
        assert delays[:4] == [0.5, 1.0, 2.0, 4.0], delays
        # The others keep serving: same processes, searches answered (from rollouts: no value model).
        assert _search(cfg) is not None
        after = stack_processes(up.proc.pid)
        assert after["scheduler"] == before["scheduler"] and after["search"] == before["search"]
        assert up.proc.poll() is None

        status = _tandem("status", "--config", str(config_file))
        assert "CRASH-LOOPING (" in status.stdout and "restarts in a row)" in status.stdout, status.stdout
        assert "last log line: " in status.stdout and str(model) in status.stdout, status.stdout

        code, _ = up.ctrl_c()
        assert code in (0, 1), up.output  # 1: the crash-looping server's last exit was not clean
        assert "stopped: scheduler exit 0, reward exit " in up.output and "search exit 0" in up.output
        assert _poll(lambda: not any(_alive(p) for p in after.values()), 15), "orphaned servers"
    finally:
        up.kill()


def test_on_crash_loop_stop_gives_up_and_stops_all(config_file, tmp_path):
    up = Command("up", "--config", str(config_file), "--log-dir", str(tmp_path / "logs"),
                 "--max-restarts", "1", "--restart-window-s", "600", "--on-crash-loop", "stop")
    try:
        up.wait_for("tandem is up")
        first = stack_processes(up.proc.pid)
        os.kill(first["scheduler"], signal.SIGKILL)
        assert _poll(lambda: stack_processes(up.proc.pid).get("scheduler", first["scheduler"]) != first["scheduler"], 60)
        os.kill(stack_processes(up.proc.pid)["scheduler"], signal.SIGKILL)
        assert up.proc.wait(timeout=60) == 1
        up.wait_for("scheduler exited (status -9) after 1 restarts in a row, each run shorter than 600 s: "
                    "crash-looping, giving up (--on-crash-loop stop), stopping the others")
        assert _poll(lambda: not any(_alive(p) for p in first.values()), 15), "orphaned servers"
    finally:
        up.kill()


def test_ctrl_c_stops_play_and_demo_promptly_and_says_so(config_file, tmp_path):
    demo = Command("demo", "--config", str(config_file), "--log-dir", str(tmp_path / "logs"),
                   "--frames", "3000", "--fps", "30")  # 100 s
    try:
        demo.wait_for("frame 300/3000")  # playing
        servers = stack_processes(demo.proc.pid)
        code, took = demo.ctrl_c()
        assert code == 130, demo.output
        assert "stopped: scheduler exit 0, reward exit 0, search exit 0" in demo.output
        assert "tandem demo: interrupted" in demo.output and "Traceback" not in demo.output
        assert took < 30, f"{took:.1f} s"  # the drain is bounded at 10 s; a hang is minutes
        assert _poll(lambda: not any(_alive(p) for p in servers.values()), 15), "orphaned servers"
    finally:
        demo.kill()

    up = Command("up", "--config", str(config_file), "--log-dir", str(tmp_path / "logs"))
    try:
        up.wait_for("tandem is up")
        for _ in range(3):
            play = Command("play", "--config", str(config_file), "--frames", "3000", "--fps", "30")
            try:
                play.wait_for("frame 300/3000", timeout_s=120)
                code, took = play.ctrl_c()
                assert code == 130, play.output
                # The frames played so far are reported, then the interruption is named, last.
                last = play.output.strip().splitlines()[-1]
                assert last.startswith("tandem play: interrupted after ") and last.endswith(" of 3000 frames"), last
                assert "(each line is explained in" in play.output and "Traceback" not in play.output
                assert took < 30, f"{took:.1f} s"
            finally:
                play.kill()
    finally:
        up.ctrl_c()
        up.kill()


def test_status_and_play_name_the_service_that_is_down(config_file):
    cfg = load_config(config_file)
    status = _tandem("status", "--config", str(config_file))
    assert status.returncode == 1
    assert f"{'search':<11} {cfg.search.address:<22} UNREACHABLE" in status.stdout

    play = _tandem("play", "--config", str(config_file), "--frames", "1")
    assert play.returncode == 1 and "Traceback" not in play.stderr
    assert play.stderr.strip() == (f"tandem: cannot play: search service at {cfg.search.address}: UNREACHABLE; "
                                   f"reward service at {cfg.reward.address}: UNREACHABLE (is tandem up running?)")

    # Only the search service down: refused before the first frame, not a report of Nones.
    reward = subprocess.Popen([*TANDEM, "serve", "reward", "--config", str(config_file)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _poll(lambda: health_status(cfg.reward.address, cfg) == "SERVING", START_TIMEOUT_S)
        status = _tandem("status", "--config", str(config_file))
        assert status.returncode == 1 and f"{'reward':<11} {cfg.reward.address:<22} SERVING" in status.stdout
        play = _tandem("play", "--config", str(config_file), "--frames", "5")
        assert play.returncode == 1 and play.stdout == ""
        assert play.stderr.strip() == (f"tandem: cannot play: search service at {cfg.search.address}: UNREACHABLE "
                                       "(is tandem up running?)")
    finally:
        reward.terminate()
        reward.wait(timeout=60)


@pytest.mark.parametrize("args, message", [
    (("play", "--positions", "unknown"), "tandem play: argument --positions: no position set or file 'unknown'"),
    (("play", "--fps", "0"), "tandem play: argument --fps: must be > 0, got '0'"),
    (("play", "--fps", "nan"), "tandem play: argument --fps: must be > 0, got 'nan'"),
    (("play", "--frames", "-1"), "tandem play: argument --frames: must be > 0, got '-1'"),
    (("demo", "--simulations", "many"), "tandem demo: argument --simulations: expected an integer, got 'many'"),
    (("up", "--max-restarts", "-1"), "tandem up: argument --max-restarts: must be >= 0, got '-1'"),
    (("up", "--max-restart-delay-s", "0.1"), "tandem up: argument --max-restart-delay-s: must be >= 0.5, got '0.1'"),
    (("up", "--on-crash-loop", "ignore"), "tandem up: argument --on-crash-loop: invalid choice: 'ignore'"),
    (("health", "127.0.0.1:1", "--timeout-s", "0"), "tandem health: argument --timeout-s: must be > 0"),
    (("play", "--evaluator", "oracle"), "tandem play: argument --evaluator: invalid choice: 'oracle'"),
    (("play", "--bogus"), "tandem: unrecognized arguments: --bogus"),
    (("play", "--rounds", "10"), "tandem: unrecognized arguments: --rounds 10 (see tandem play --help)"),
    (("up", "--port", "6000"), "tandem: unrecognized arguments: --port 6000; ports are set in the config (--config)"),
    (("play", "--search", "localhost"), "tandem play: argument --search: the address needs HOST:PORT (the search "
                                        "service's default: 127.0.0.1:50052), got 'localhost'"),
    (("play", "--game", "chess"), "tandem play: --game chess: not a game of search.games in the config"),
    (("--bogus", "status"), "tandem: unrecognized argument '--bogus' before the command"),
    (("--bogus",), "tandem: unrecognized argument '--bogus' before the command"),
    ((), "tandem: the following arguments are required: command"),
])
def test_a_bad_argument_gets_one_line_and_exit_code_2(args, message):
    result = _tandem(*args)
    assert result.returncode == 2
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(message), result.stderr
