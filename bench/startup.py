"""startup: how long `tandem up` takes from cold to every server SERVING, and
each server from a SIGKILL back to SERVING, as a user runs it; where the
seconds go, from the servers' own start-up lines (tandem/startup.py).

Rows: one per event: ``event`` (``cold`` or ``kill -9``), ``server``,
``serving_after_s`` (from ``tandem up``'s launch, or from the kill), and
``phases`` (each start-up phase that server logged: name -> seconds), plus
``runners`` (the reward service's per-runner lines: creation seconds and the
slowest buckets' warm-ups, as logged).

Command (GPU): ``python3 -m bench.startup`` (the shipped config; under a
minute or two on the H200). Smoke test: ``python3 -m bench.startup --quick``
(CPU; the reward service and the search service killed once each).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from loadtest.chaos import stack_processes, wait_serving
from tandem.config import endpoints, load_config
from tandem.startup import PREFIX

BENCHMARK = "startup"
COLUMNS = ("event", "server", "serving_after_s", "slowest_phase")
_DONE = re.compile(re.escape(PREFIX) + r"(.+): done in ([\d.]+) s")
_RUNNER = re.compile(r"model (\S+), runner at stream priority (-?\d+): (.+)$")


def phases(log: Path, since: int = 0) -> tuple[dict[str, float], list[str], int]:
    """The start-up phases a server's log holds from byte ``since``: ({phase: s},
    the reward runners' lines, the log's size now)."""
    try:
        text = log.read_bytes()[since:].decode(errors="replace")
    except OSError:
        return {}, [], since
    done = {m.group(1): float(m.group(2)) for m in _DONE.finditer(text)}
    runners = [m.group(0) for line in text.splitlines() if (m := _RUNNER.search(line))]
    return done, runners, since + len(text.encode())


def _row(event: str, server: str, seconds: float | None, log: Path, since: int) -> tuple[dict, int]:
    done, runners, size = phases(log, since)
    slowest = max(done.items(), key=lambda kv: kv[1]) if done else None
    return {"event": event, "server": server, "serving_after_s": seconds, "phases": done, "runners": runners,
            "slowest_phase": f"{slowest[0]} ({slowest[1]:.1f} s)" if slowest else ""}, size


def run(config: str | None, kills: list[str], timeout_s: float) -> list[dict]:
    cfg = load_config(config)
    names = list(endpoints(cfg))
    with tempfile.TemporaryDirectory(prefix="startup_") as tmp:
        logs = Path(tmp)
        cmd = [sys.executable, "-m", "stack", "up", "--log-dir", str(logs)] + (["--config", config] if config else [])
        launched = time.monotonic()
        up = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        rows, sizes = [], {}
        try:
            pending = set(names)
            while pending and time.monotonic() - launched < timeout_s:  # every server, as each turns SERVING
                for name in sorted(pending):
                    if wait_serving(cfg, name, timeout_s=0.05) is not None:
                        pending.discard(name)
                        row, sizes[name] = _row("cold", name, round(time.monotonic() - launched, 2),
                                                logs / f"{name}.log", 0)
                        rows.append(row)
                        common.progress(row)
                time.sleep(0.05)
            rows += [{"event": "cold", "server": n, "serving_after_s": None, "phases": {}, "runners": [],
                      "slowest_phase": "not SERVING"} for n in sorted(pending)]
            for name in kills:
                pid = stack_processes(up.pid).get(name)
                if pid is None:
                    continue
                killed = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                while stack_processes(up.pid).get(name) in (pid, None) and time.monotonic() - killed < timeout_s:
                    time.sleep(0.01)  # the supervisor starts a new one; its old port answers nothing meanwhile
                back = wait_serving(cfg, name, timeout_s=timeout_s)
                row, sizes[name] = _row("kill -9", name, None if back is None else round(time.monotonic() - killed, 2),
                                        logs / f"{name}.log", sizes.get(name, 0))
                rows.append(row)
                common.progress(row)
        finally:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--config", default=None, help="tandem config (default: the shipped one)")
    parser.add_argument("--kill", default="reward,search,reward_bulk",
                        help="servers to SIGKILL in turn once all serve (comma-separated)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="the longest wait for SERVING (s)")
    args = parser.parse_args()
    kills = [k for k in args.kill.split(",") if k]
    if args.quick:
        kills = ["reward", "search"]
    rows = run(args.config, kills, args.timeout_s)
    common.finish(BENCHMARK, rows, Path(args.out) if args.out else None, COLUMNS)


if __name__ == "__main__":
    main()
