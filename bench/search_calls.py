"""search_calls: how many ``Search`` calls a second the search service
answers, and the CPU each costs it, by ``search.workers``.

For each worker count it starts `tandem serve search` (a real process on
loopback, `search.workers` set, the backend of ``--backend``: cpu, the CPU
reference, or cuda) and drives it from ``--clients`` client processes, each a
closed loop of ``Search`` calls (one rollout search of ``--simulations``
simulations on the position "4453") over a connection of its own, for
``--seconds`` after a 2 s warm-up. The service's CPU is the user + system
time of its processes (the first and its workers, /proc) over the wall time.

Row fields: ``workers``, ``clients``, ``backend``, ``calls_per_s``,
``cpu_cores`` (service CPU seconds per wall second), ``cpu_us_per_call``,
``seconds``, ``errors`` (calls that failed), and ``calls_ratio`` (calls_per_s
over the one-worker row's, the same run).

Command (full): ``python3 -m bench.search_calls --workers 1,2,4 --clients 8``
Smoke test:     ``python3 -m bench.search_calls --quick --out /tmp/bench-smoke``
"""
from __future__ import annotations

import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml
from tandem.v1 import search_pb2, search_pb2_grpc

from bench import common
from bench.loopback_stack import loopback_stack_data
from bench.service_cpu import cpu_seconds
from tandem.workers import children

BENCHMARK = "search_calls"
COLUMNS = ("workers", "clients", "backend", "calls_per_s", "calls_ratio", "cpu_cores", "cpu_us_per_call", "errors")
ROOT = Path(__file__).resolve().parents[1]
WARM_S = 2.0


def _client(address: str, simulations: int, start: float, until: float, out) -> None:
    """One client process: Search calls back to back over its own connection; (calls, errors) to ``out``."""
    request = search_pb2.SearchRequest(game="connect4", moves="4453", simulations=simulations, seed=1)
    calls = errors = 0
    with grpc.insecure_channel(address) as ch:
        stub = search_pb2_grpc.SearchServiceStub(ch)
        while time.time() < until:
            try:
                stub.Search(request, timeout=30)
                ok = True
            except grpc.RpcError:
                ok = False
            if time.time() >= start:  # the warm-up's calls are not counted
                calls, errors = calls + ok, errors + (not ok)
    out.put((calls, errors))


def _serving(address: str, timeout_s: float = 120.0) -> None:
    with grpc.insecure_channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout=timeout_s)


def measure(workers: int, clients: int, backend: str, simulations: int, seconds: float) -> dict:
    data = loopback_stack_data({"search": {"backend": backend, "evaluator": "rollout", "workers": workers}})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tandem.yaml"
        path.write_text(yaml.safe_dump(data))
        address = data["search"]["address"]
        proc = subprocess.Popen([sys.executable, "-m", "stack", "serve", "search", "--config", str(path)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _serving(address)
            time.sleep(3.0 if workers > 1 else 0.5)  # every worker bound (they start after the first)
            ctx = multiprocessing.get_context("spawn")
            out = ctx.Queue()
            start = time.time() + WARM_S
            until = start + seconds
            procs = [ctx.Process(target=_client, args=(address, simulations, start, until, out)) for _ in range(clients)]
            for p in procs:
                p.start()
            time.sleep(max(start - time.time(), 0))
            pids = [proc.pid, *children(proc.pid)]
            before = sum(cpu_seconds(p) for p in pids)
            time.sleep(max(until - time.time(), 0))
            used = sum(cpu_seconds(p) for p in pids) - before
            results = [out.get(timeout=60) for _ in procs]
            for p in procs:
                p.join(30)
        finally:
            proc.terminate()
            proc.wait(60)
    calls = sum(c for c, _ in results)
    return {"workers": workers, "clients": clients, "backend": backend, "calls_per_s": round(calls / seconds, 1),
            "cpu_cores": round(used / seconds, 3), "cpu_us_per_call": round(used / max(calls, 1) * 1e6, 1),
            "seconds": seconds, "errors": sum(e for _, e in results), "simulations": simulations}


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--workers", type=common.int_list, default=[1, 2, 4])
    parser.add_argument("--clients", type=int, default=8, help="client processes (default 8)")
    parser.add_argument("--simulations", type=int, default=1, help="simulations a search (default 1: the call's cost)")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    backend = "cpu" if args.quick or not args.backend or args.backend == "all" else args.backend
    if args.quick:
        args.workers, args.clients, args.seconds = [1, 2], 2, 2.0
    rows = [measure(w, args.clients, backend, args.simulations, args.seconds) for w in args.workers]
    base = next((r["calls_per_s"] for r in rows if r["workers"] == 1), None)
    for r in rows:
        r["calls_ratio"] = round(r["calls_per_s"] / base, 3) if base else None
        common.progress(r)
    common.write_results(BENCHMARK, rows, args.out)
    common.print_rows(rows, COLUMNS)


if __name__ == "__main__":
    main()
