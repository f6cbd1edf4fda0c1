"""bench/startup.py on the CPU: `tandem up` from cold to every server
SERVING, then the reward service killed (SIGKILL) and back, with each row's
start-up phases read from the server's own log lines; and the result files'
commit and tree state as the GPU machine's caller gives them."""
from __future__ import annotations

import pytest
from conftest import cpu_config_file

from bench import common, startup

pytestmark = pytest.mark.slow


def test_startup_rows_name_every_server_and_the_phases_of_a_restart(tmp_path):
    config = cpu_config_file(tmp_path / "startup.yaml")
    rows = startup.run(str(config), ["reward"], timeout_s=60.0)
    cold = {r["server"]: r for r in rows if r["event"] == "cold"}
    assert set(cold) == {"scheduler", "reward", "reward_bulk", "search"}
    assert all(r["serving_after_s"] is not None and r["serving_after_s"] > 0 for r in cold.values())
    assert "model connect4_value: sessions" in cold["reward"]["phases"]
    assert "a first search per game (kernels, pools)" in cold["search"]["phases"]
    (restart,) = [r for r in rows if r["event"] == "kill -9"]
    assert restart["server"] == "reward" and restart["serving_after_s"] is not None
    # the restarted process's own phases, read past what the first one wrote
    assert "one request per model and lane" in restart["phases"]


def test_phases_reads_done_lines_from_an_offset(tmp_path):
    log = tmp_path / "reward.log"
    log.write_text("x INFO start-up: a: done in 1.50 s (2.00 s since the start)\n")
    first, _, size = startup.phases(log)
    with log.open("a") as f:
        f.write("y INFO start-up: b: FAILED in 0.20 s (0.30 s since the start)\n"
                "z INFO start-up: c: done in 0.25 s (0.40 s since the start)\n")
    later, _, _ = startup.phases(log, size)
    assert first == {"a": 1.5} and later == {"c": 0.25}


@pytest.mark.parametrize("dirty, expected", [("0", False), ("1", True)])
def test_the_callers_commit_and_tree_state_win_over_the_machines_git(monkeypatch, dirty, expected):
    monkeypatch.setenv("TANDEM_COMMIT", "0" * 40)
    monkeypatch.setenv("TANDEM_DIRTY", dirty)
    v = common.versions()
    assert v["tandem_commit"] == "0" * 40 and v["tandem_dirty"] is expected


def test_profile_shares_count_a_function_once_per_sample_however_deep(tmp_path):
    from bench.profile_summary import shares

    raw = tmp_path / "p.raw"
    raw.write_text("main (a.py:1);f (a.py:2);f (a.py:2) 3\nmain (a.py:1);g (a.py:3) 1\n")
    total, rows = shares(raw)
    assert total == 4 and dict(rows) == {"main (a.py:1)": 1.0, "f (a.py:2)": 0.75, "g (a.py:3)": 0.25}
