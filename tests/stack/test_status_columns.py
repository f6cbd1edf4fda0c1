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
