"""MPS control (scheduler/mps.py): attach or start, stop only what was started,
and plain messages where MPS cannot run. The daemon here is a stand-in script
on PATH that keeps MPS's contract (``-d`` creates the control pipe, the pipe
answers ``get_server_list``, ``quit`` removes it): CPU hosts have no MPS."""
from __future__ import annotations

import dataclasses
import os
import time

import pytest

from scheduler import mps
from stack.supervisor import Stack, mps_env
from tandem import device
from tandem.config import TandemConfig

STAND_IN = """#!/bin/sh
if [ "$1" = "-d" ]; then
  : > "$CUDA_MPS_PIPE_DIRECTORY/control"; echo start >> "$CUDA_MPS_LOG_DIRECTORY/control.log"; exit 0
fi
read cmd
case "$cmd" in
  get_server_list) exit 0 ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"; echo quit >> "$CUDA_MPS_LOG_DIRECTORY/control.log"; exit 0 ;;
esac
exit 1
"""


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(STAND_IN)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_no_gpu_says_mps_is_not_applicable_and_gives_no_remedy(tmp_path):
    c = mps.ensure(str(tmp_path / "pipe"), str(tmp_path / "log"), has_gpu=False)
    assert not c.active and not c.started
    assert c.message == "no GPU: MPS not started (not applicable without a GPU)"
    assert not mps.stop(c)


def test_gpu_without_the_binary_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    c = mps.ensure(str(tmp_path / "pipe"), str(tmp_path / "log"), has_gpu=True)
    assert not c.active and "not on PATH" in c.message and "NOT enforced" in c.message


def test_starts_the_daemon_and_stops_only_what_it_started(on_path):
    pipe, logs = str(on_path / "pipe"), str(on_path / "log")
    started = mps.ensure(pipe, logs, has_gpu=True, timeout_s=5.0)
    assert started.active and started.started and "started" in started.message
    assert (on_path / "pipe" / "control").exists()
    attached = mps.ensure(pipe, logs, has_gpu=True)  # a second scheduler finds it answering
    assert attached.active and not attached.started and "attached" in attached.message
    assert not mps.stop(attached)  # not ours: left running
    assert (on_path / "pipe" / "control").exists()
    assert mps.stop(started)
    assert not (on_path / "pipe" / "control").exists()
    assert (on_path / "log" / "control.log").read_text().split() == ["start", "quit"]


def test_directories_come_from_config_then_environment(monkeypatch):
    sched = TandemConfig().scheduler
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    assert device.mps_directories(sched) == ("/tmp/nvidia-mps", "/tmp/nvidia-log")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/run/tandem/mps-pipe")
    assert device.mps_directories(sched)[0] == "/run/tandem/mps-pipe"
    sched = dataclasses.replace(sched, mps_pipe_directory="/srv/pipe", mps_log_directory="/srv/log")
    assert device.mps_directories(sched) == ("/srv/pipe", "/srv/log")


def test_tandem_up_gives_every_server_the_same_directories_and_its_pool_cap():
    base = TandemConfig()
    cfg = dataclasses.replace(
        base,
        scheduler=dataclasses.replace(base.scheduler, mps_pipe_directory="/srv/pipe", mps_log_directory="/srv/log"),
        search=dataclasses.replace(base.search, memory_pool_bytes=2 << 30))
    stack = Stack(cfg, None, env={"reward": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}})
    for name in ("scheduler", "reward", "search"):
        env = stack._env(name)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/srv/pipe" and env["CUDA_MPS_LOG_DIRECTORY"] == "/srv/log"
    assert stack._env("search")["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in stack._env("reward")  # no pool: no cap
    assert stack._env("reward")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    off = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, mps="off"))
    assert mps_env(off) == {}


def test_a_client_asks_the_daemon_it_started_to_quit_without_waiting(on_path):
    # This stand-in's quit, like MPS's with a client still attached, ends only once released.
    script = on_path / "bin" / "nvidia-cuda-mps-control"
    script.write_text(STAND_IN.replace("quit) rm -f", 'quit) while [ ! -e "$CUDA_MPS_LOG_DIRECTORY/release" ]; '
                                                     "do sleep 0.02; done; rm -f"))
    pipe, logs = str(on_path / "pipe"), str(on_path / "log")
    started = mps.ensure(pipe, logs, has_gpu=True, timeout_s=5.0)
    attached = mps.ensure(pipe, logs, has_gpu=True)
    assert not mps.stop(attached, wait=False)  # not ours: left running
    control = on_path / "pipe" / "control"
    assert mps.stop(started, wait=False)  # returns with the quit still waiting
    assert control.exists()
    (on_path / "log" / "release").touch()  # the client has gone: the daemon quits
    for _ in range(500):  # bounded, not timed
        if not control.exists():
            break
        time.sleep(0.02)
    assert not control.exists()
    assert (on_path / "log" / "control.log").read_text().split() == ["start", "quit"]
