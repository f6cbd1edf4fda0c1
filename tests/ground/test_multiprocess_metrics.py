"""Metrics of several processes (tandem/multiprocess_metrics.py), as a
service with workers has them: a real first process in prometheus-client's
multiprocess mode and a real spawned child, one /metrics endpoint serving
both merged, a function-valued gauge set from its function, a dead child's
live gauges dropped; and the directory's life in `tandem serve`."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tandem import multiprocess_metrics

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, multiprocessing, os, sys, urllib.request
    from prometheus_client import Counter, Gauge
    from prometheus_client.parser import text_string_to_metric_families
    from tandem import multiprocess_metrics
    from tandem.server import start_metrics

    CALLS = Counter("t_calls", "calls")
    HELD = Gauge("t_held", "held", multiprocess_mode="livesum")
    QUEUED = Gauge("t_queued", "queued", ["lane"], multiprocess_mode="livesum")

    def child(done):
        CALLS.inc(3)
        HELD.set(5)
        multiprocess_metrics.set_function(QUEUED.labels("a"), lambda: 2)
        done.set()

    def scrape(port):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    if __name__ == "__main__":
        port = int(sys.argv[1])
        assert multiprocess_metrics.active()
        CALLS.inc(4)
        HELD.set(1)
        queued = [7]
        multiprocess_metrics.set_function(QUEUED.labels("a"), lambda: queued[0])
        start_metrics(port)
        ctx = multiprocessing.get_context("spawn")
        done = ctx.Event()
        p = ctx.Process(target=child, args=(done,))
        p.start()
        done.wait(60)
        queued[0] = 8  # read at the scrape
        both = scrape(port)
        p.terminate()
        p.join(30)
        multiprocess_metrics.mark_dead(p.pid)
        after = scrape(port)
        print(json.dumps({"both": [[k[0], dict(k[1]), v] for k, v in both.items()],
                          "after": [[k[0], dict(k[1]), v] for k, v in after.items()]}))
""")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_endpoint_serves_two_processes_merged_and_a_dead_ones_live_gauges_leave(tmp_path):
    import json

    script = tmp_path / "two.py"
    script.write_text(SCRIPT)
    env = {**os.environ, multiprocess_metrics.ENV: str(tmp_path / "metrics"), "PYTHONPATH": str(REPO)}
    os.mkdir(env[multiprocess_metrics.ENV])
    out = subprocess.run([sys.executable, str(script), str(_free_port())], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    both = {(name, tuple(sorted(labels.items()))): v for name, labels, v in got["both"]}
    after = {(name, tuple(sorted(labels.items()))): v for name, labels, v in got["after"]}
    assert both[("t_calls_total", ())] == 7  # 4 + 3: counters sum over processes
    assert both[("t_held", ())] == 6  # livesum
    assert both[("t_queued", (("lane", "a"),))] == 10  # 8 (this process, at the scrape) + 2 (the child's function)
    assert after[("t_calls_total", ())] == 7  # a dead process's counts stay
    assert after[("t_held", ())] == 1 and after[("t_queued", (("lane", "a"),))] == 8  # its live gauges leave


def test_serve_sets_a_private_directory_only_for_workers_and_removes_it(tmp_path, monkeypatch):
    monkeypatch.delenv(multiprocess_metrics.ENV, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert multiprocess_metrics.begin(1) is None and multiprocess_metrics.ENV not in os.environ
    from prometheus_client import REGISTRY

    assert not multiprocess_metrics.active() and multiprocess_metrics.registry() is REGISTRY  # one process: as ever
    # prometheus_client is imported in this process: its mode is chosen, so begin refuses.
    with pytest.raises(RuntimeError, match="before prometheus_client is imported"):
        multiprocess_metrics.begin(2)
    # In a fresh interpreter: a directory of a first process that is gone is swept, ours made.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{multiprocess_metrics.PREFIX}{int(gone.stdout)}-x"
    stale.mkdir()
    live = tmp_path / f"{multiprocess_metrics.PREFIX}{os.getpid()}-y"  # this test's process: alive, kept
    live.mkdir()
    code = ("import os, sys, tempfile; tempfile.tempdir = sys.argv[1]; from tandem import multiprocess_metrics as m; "
            "p = m.begin(2); assert os.environ[m.ENV] == p and os.path.isdir(p); "
            "assert 'prometheus_client' not in sys.modules; "
            "import tandem.server; assert m.active(); m.end(p); assert not os.path.exists(p)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not stale.exists() and live.exists()
