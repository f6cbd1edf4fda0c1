"""`tandem up` as a user runs it: four real server processes on loopback (the
scheduler, the reward service, its bulk server, the search service),
`tandem status`, a short `tandem play`, and a clean stop with no orphans."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import free_port, lines_until
from tandem.v1 import reward_pb2, reward_pb2_grpc

from tandem import tensors
from tandem.config import endpoints, load_config, loopback_data
from tandem.gpu import cuda_device_count
from tandem.server import channel, health_status

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def config_file(tmp_path) -> Path:
    data = loopback_data(free_port, metrics=True)  # with the bulk server, as the shipped config
    data["search"]["backend"] = "cpu"
    data["scheduler"]["report_interval_ms"] = 100
    path = tmp_path / "tandem.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _tandem(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stack", *args], capture_output=True, text=True, timeout=120, **kw)


def test_up_status_play_and_stop(config_file, tmp_path):
    cfg = load_config(config_file)
    up = subprocess.Popen(
        [sys.executable, "-m", "stack", "up", "--config", str(config_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = lines_until(up, "tandem is up", timeout_s=120)
        addresses = [address for address, _ in endpoints(cfg).values()]
        for _ in range(len(addresses) + 20):  # a line per server; the children's log lines may come between them
            if all(address in "".join(lines) for address in addresses):
                break
            lines.append(up.stdout.readline())
        text = "".join(lines)
        assert list(endpoints(cfg)) == ["scheduler", "reward", "reward_bulk", "search"]  # the bulk server too
        for address, _ in endpoints(cfg).values():
            assert address in text
            assert health_status(address) == "SERVING"
        children = _children(up.pid)
        assert len(children) == 4

        # The services register with the scheduler within a few report intervals: the bulk server as a
        # reward service of its own (the bulk lever reaches it).
        for _ in range(50):
            status = _tandem("status", "--config", str(config_file))
            if status.stdout.count("lease") == 3:
                break
            time.sleep(0.1)
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.count("lease") == 3 and cfg.reward.bulk_server.address in status.stdout
        assert "search" in status.stdout and "reward_bulk" in status.stdout
        # stream priorities across processes: not applicable on a CPU host, not enforced on a GPU one without MPS
        assert ("not applicable without a GPU" if cuda_device_count() == 0 else "NOT ENFORCED") in status.stdout
        # A trainer's batch at the bulk server gets the reward service's answer.
        board = tensors.to_proto("board", np.zeros((4, 2, 6, 7), np.uint8))
        answers = []
        for address in (cfg.reward.address, cfg.reward.bulk_server.address):
            with channel(address, cfg) as ch:
                reply = reward_pb2_grpc.RewardServiceStub(ch).Evaluate(
                    reward_pb2.EvaluateRequest(model="connect4_value", inputs=[board]), timeout=30)
                answers.append(tensors.from_proto(reply.outputs[0]))
        np.testing.assert_allclose(answers[0], answers[1], atol=1e-6)
        assert "bulk lever: frames" in status.stdout and "bulk share 100 %" in status.stdout  # default: no lever
        if cuda_device_count():  # the way out without MPS, named (a CPU host has no remedy to give)
            assert "co_located: true" in status.stdout

        report_path = tmp_path / "report.json"
        play = _tandem("play", "--config", str(config_file), "--frames", "20", "--fps", "30", "--late-answers",
                       "--report", str(report_path))
        assert play.returncode == 0, play.stdout + play.stderr
        report = json.loads(report_path.read_text())
        assert report["frames"] == report["frames_answered"] == 20
        assert report["backends"]["search"] == ["cpu_reference"]
        assert report["simulations_per_frame"]["min"] >= 1
        assert report["proven"]["solver_agrees"] == report["proven"]["frames"]  # every proof is the solver's result
        for key in ("optimal_move_rate", "best_score_move_rate", "value_sign_agreement", "missed_frames"):
            assert key in report
        assert report["frame_latency_ms"]["p50"] > 0

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        time.sleep(0.2)
        assert not [pid for pid in children if _alive(pid)], "orphaned server processes"
    finally:
        if up.poll() is None:
            up.kill()


def test_up_refuses_a_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("search:\n  backend: quantum\n")
    result = _tandem("up", "--config", str(bad))
    assert result.returncode == 2
    assert "search.backend: must be one of" in result.stderr


@pytest.mark.parametrize("log_dir", [True, False])
def test_up_says_why_a_server_could_not_start(config_file, tmp_path, log_dir):
    """A model file ONNX Runtime cannot load: tandem up's own message carries
    the reward server's last log line (not only its exit status), from its log
    with --log-dir, from its output (which tandem up passes on) without."""
    not_onnx = tmp_path / "not_a_model.onnx"
    not_onnx.write_text("this is not an ONNX model\n")
    data = yaml.safe_load(config_file.read_text())
    data["reward"]["models"] = [{"name": "connect4_value", "path": str(not_onnx)}]
    config_file.write_text(yaml.safe_dump(data))
    result = _tandem("up", "--config", str(config_file), *(("--log-dir", str(tmp_path / "logs")) if log_dir else ()))
    assert result.returncode == 1
    message = result.stderr.strip().splitlines()[-1]  # tandem up's own, after the servers' output
    assert message.startswith("tandem: server for ") and "exited with status 1: " in message, result.stderr
    assert "not_a_model.onnx" in message and "INVALID_PROTOBUF" in message, message
    assert ("reward.log" in message) is log_dir, message


def test_up_refuses_ports_already_in_use(config_file):
    import socket

    cfg = load_config(config_file)
    host, _, port = cfg.reward.address.rpartition(":")
    with socket.socket() as s:
        s.bind((host, int(port)))
        s.listen()
        result = _tandem("up", "--config", str(config_file))
    assert result.returncode == 1
    assert f"already in use (is another tandem up running?): reward.address: {cfg.reward.address}" in result.stderr
    assert ("give a config with other addresses and metrics ports (each server's `address` and `metrics_port` "
            "keys): --config PATH (make demo CONFIG=PATH)") in result.stderr


def test_health_command(config_file):
    assert _tandem("health", "localhost").returncode == 2
    closed = _tandem("health", f"127.0.0.1:{free_port()}")
    assert closed.returncode == 1 and closed.stdout.strip() == "UNREACHABLE"


def test_play_without_a_stack_says_so_in_one_line(config_file):
    result = _tandem("play", "--config", str(config_file), "--frames", "1")
    assert result.returncode == 1
    assert result.stderr.strip().startswith("tandem: cannot play: search service at") and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_servers_die_with_a_killed_supervisor(config_file):
    up = subprocess.Popen(
        [sys.executable, "-m", "stack", "up", "--config", str(config_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        while not up.stdout.readline().startswith("tandem is up"):
            assert up.poll() is None, "tandem up exited early"
        children = _children(up.pid)
        assert len(children) == len(endpoints(load_config(config_file))) == 4  # the bulk server's too
        up.kill()  # SIGKILL: no chance to stop the servers itself
        up.wait(timeout=10)
        # Each drains (5 s grace) and exits; an orphan would live on. Generous: the host may be busy.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(p) for p in children):
            time.sleep(0.1)
        assert not [p for p in children if _alive(p)], "servers outlived a killed tandem up"
    finally:
        if up.poll() is None:
            up.kill()
