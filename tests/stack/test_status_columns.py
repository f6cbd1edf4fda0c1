"""`tandem status` and `tandem up`'s endpoint lines: one column per field,
the bulk server's name (``reward_bulk``, the longest) included."""
from __future__ import annotations

import os

from conftest import loopback_config

from stack import cli, status
from stack.restarts import ChildRecord, record_path, write_record


def _columns(lines: list[str], field: str) -> set[int]:
    return {line.index(field) for line in lines}


def test_health_restart_and_endpoint_lines_keep_their_columns(capsys):
    cfg = loopback_config()  # every server on a free port, none running: health NOT_SERVING / UNAVAILABLE
    path = record_path(cfg)
    write_record(path, {name: ChildRecord(os.getpid()) for name in ("scheduler", "reward", "reward_bulk", "search")})
    try:
        assert status.print_status(cfg) == 1  # no scheduler answers
    finally:
        path.unlink(missing_ok=True)
    out = capsys.readouterr().out.splitlines()
    health = out[out.index("health:") + 1:][:4]
    assert [line.split()[0] for line in health] == ["scheduler", "reward", "reward_bulk", "search"]
    assert len(_columns(health, "127.0.0.1:")) == 1
    restarts = [line for line in out if " pid " in line]
    assert len(restarts) == 4 and len(_columns(restarts, " pid ")) == 1
    cli._print_endpoints(cfg)
    endpoints = capsys.readouterr().out.splitlines()
    assert len(endpoints) == 4 and len(_columns(endpoints, "127.0.0.1:")) == 1


def test_with_nothing_running_status_asks_whether_tandem_up_runs_in_one_line(capsys):
    cfg = loopback_config()  # nothing listens on its ports
    assert status.print_status(cfg) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"scheduler: not answering at {cfg.scheduler.address} (is tandem up running, with this config?)"
    assert not any("failed to connect" in line or "Connection refused" in line for line in out)


def test_on_a_cpu_host_status_gives_no_gpu_remedies(capsys):
    from scheduler.main import start
    from tandem.device import cpu_only

    cfg = loopback_config()
    handle = start(cfg, device=cpu_only())
    try:
        status.print_status(cfg)
    finally:
        handle.stop(0)
    out = capsys.readouterr().out
    assert "stream priorities and MPS: not applicable without a GPU" in out
    assert "start MPS" not in out and "co_located" not in out and "NOT ENFORCED" not in out
