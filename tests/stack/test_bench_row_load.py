"""bench/row_load.py: a row's CPU per server (its workers summed) and the
search service's wave-loop figures, from real processes and a real /metrics."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from prometheus_client import start_http_server

from bench.row_load import RowLoad, wave_figures
from search_service.server import SIMULATIONS
from search_service.wave_loop import (JOIN_LEFT_SECONDS, LEFT, PHASE_SECONDS, REFUSED, WAVE_EXPECTED_SECONDS,
                                      WAVE_LEAVES, WAVE_TREES)
from tandem.overload import SHED
from tandem.workers import children

# A child whose argv reads like `tandem serve NAME`, with a worker of its own: once both run it says
# "started"; both burn CPU a while, then it says "burnt" and both wait to be killed (a server's CPU is
# read while it runs).
_BURN = "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
_KID = f"import sys, time\nprint(1, flush=True)\nsys.stdin.readline()\n{_BURN}print(2, flush=True)\ntime.sleep(60)\n"
_BUSY = (f"import subprocess, sys, time\n"
         f"kid = subprocess.Popen([sys.executable, '-c', {_KID!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
         f"kid.stdout.readline()\nprint('started', flush=True)\nsys.stdin.readline()\n"
         f"kid.stdin.write(b'go\\n'); kid.stdin.flush()\n"
         f"{_BURN}kid.stdout.readline()\nprint('burnt', flush=True)\ntime.sleep(60)\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_row_counts_each_server_with_its_workers_and_the_wave_loop_over_the_row_alone():
    port = _free_port()
    httpd, _ = start_http_server(port, addr="127.0.0.1")
    PHASE_SECONDS.labels("wave").observe(5.0)  # before the row: not counted
    WAVE_LEAVES.observe(1000)
    LEFT.labels("deadline").inc(7)
    server = subprocess.Popen([sys.executable, "-c", _BUSY, "serve", "busy"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        assert server.stdout.readline() == b"started\n"
        load = RowLoad(supervisor=os.getpid(), search_metrics_port=port)
        server.stdin.write(b"go\n")
        server.stdin.flush()
        for ms in (1.0, 3.0):
            PHASE_SECONDS.labels("wave").observe(ms / 1e3)
        WAVE_TREES.observe(4)
        WAVE_TREES.observe(2)
        for leaves, expected_ms in ((64, 1.5), (32, 2.5)):
            WAVE_LEAVES.observe(leaves)
            WAVE_EXPECTED_SECONDS.observe(expected_ms / 1e3)
        PHASE_SECONDS.labels("roots").observe(4e-3)  # fresh roots valued alone
        for left_s in (-0.002, 0.004, 0.007):  # one search joined 2 ms past its deadline
            JOIN_LEFT_SECONDS.observe(left_s)
        for sims in (0, 0, 50, 100):  # two answered from the root alone
            SIMULATIONS.observe(sims)
        LEFT.labels("deadline").inc(3)
        LEFT.labels("budget").inc()
        REFUSED.labels("spent").inc(5)
        SHED.labels("/tandem.v1.SearchService/Search").inc(2)
        assert server.stdout.readline() == b"burnt\n"
        assert load.servers["busy"][0] == server.pid and len(load.servers["busy"]) == 2  # the server and its worker
        got = load.finish()
    finally:
        httpd.shutdown()
        for pid in children(server.pid):
            os.kill(pid, signal.SIGKILL)
        server.kill()
        server.wait()
    assert got["cpu_cores"]["busy"] > 0  # both processes' CPU, read before they ended
    assert 0 <= got["host_busy_share"] <= 1
    assert got["wave_ms_mean"] == 2.0  # the two waves of the row, not the 5 s one before it
    assert got["trees_per_wave"] == 3.0
    assert got["leaves_per_wave"] == 48.0 and got["wave_expected_ms_mean"] == 2.0  # the plan's, over the row
    assert got["roots_ms_mean"] == 4.0 and got["root_wave_share"] == round(1 / 3, 3)
    # The median of -2, 4 and 7 ms: the second of three, halfway into the 2-4 ms bucket by its count.
    assert got["join_left_ms_p50"] == 3.0 and got["joined_spent_share"] == round(1 / 3, 3)
    assert got["unsimulated_share"] == 0.5
    assert got["left_by"] == {"budget": 1, "deadline": 3}
    assert got["refused_by"]["spent"] == 5 and got["shed_by"] == {"/tandem.v1.SearchService/Search": 2}


def test_counts_that_went_down_give_no_figure():
    """A service restarted within the row starts its counters again: the row
    reads fewer searches joined and answered than before it, and gives no
    join or answer figure for them instead of failing."""
    before = {"joined": 10.0, "join_left_le_0.0": 4.0, "join_left_le_+Inf": 10.0, "answered": 10.0}
    after = {"joined": 3.0, "join_left_le_0.0": 0.0, "join_left_le_+Inf": 3.0, "answered": 3.0}
    got = wave_figures(before, after, 1.0)
    assert not {"join_left_ms_p50", "joined_spent_share", "unsimulated_share"} & set(got)


def test_a_row_without_metrics_has_no_wave_figures():
    got = RowLoad(supervisor=os.getpid()).finish()
    assert "wave_ms_mean" not in got and "waves_per_s" not in got
    assert got["cpu_cores"] == {}  # no `serve` child

