"""calls: how many calls a second a tandem service answers, and the CPU each
costs it, by its number of worker processes.

For each service of ``--service`` and each worker count it starts
`tandem serve SERVICE` (a real process on loopback, ``SERVICE.workers`` set)
and drives it from ``--clients`` client processes, each a closed loop of calls
over a connection of its own, for ``--seconds`` after a 2 s warm-up:

* ``search``: ``Search``, one rollout search of ``--simulations`` simulations
  on the position "4453", on the backend of ``--backend`` (cpu: the CPU
  reference, or cuda); with ``--batch K`` (K > 1) a ``SearchBatch`` of K such
  searches (seeds 1..K: an engine's agents), so the rows tell what a call
  costs from what each search in it costs;
* ``reward``: ``Evaluate``, one critical one-board request to the bundled
  ``connect4_value`` model on the execution provider of ``--provider``.

The service's CPU is the user + system time of its processes (the first and
its workers, /proc) over the wall time. With ``--profile DIR``, py-spy records
the service meanwhile (``DIR/SERVICE_wN_WAIT_bK.gil.raw``: what holds the
interpreter lock; ``.all.raw``: every thread, waiting ones included;
``python3 -m bench.profile_summary`` reads them), without pausing it
(``--nonblocking``: py-spy's default pauses the process at each sample);
py-spy's own CPU still counts in that run's figures.

``--host-wait auto,block`` compares how the service's threads wait for the
GPU (``SERVICE.host_wait``, tandem.gpu.set_host_wait) in one run.

Row fields: ``service``, ``host_wait``, ``workers``, ``clients``, ``backend``
(search backend or reward execution provider), ``batch`` (searches a call),
``calls_per_s``, ``searches_per_s``, ``cpu_cores`` (service CPU seconds per
wall second), ``cpu_us_per_call``, ``cpu_us_per_search``, ``seconds``,
``errors`` (calls that failed), ``calls_ratio`` (calls_per_s over the
same service's first one-worker row, the same run), and for ``search`` its
wave loop's figures (all workers', bench/row_load.py ``wave_figures``:
``join_ms_mean``, ``leave_ms_mean``, ``wave_ms_mean``, ``waves_per_s``,
``trees_per_wave``, ...). One file per service:
``search_calls.json``, ``reward_calls.json``.

Command (full): ``python3 -m bench.calls --service search,reward --workers 1,2,4 --clients 8``
Smoke test:     ``python3 -m bench.calls --quick --out /tmp/bench-smoke``
"""
from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml
from tandem.v1 import reward_pb2_grpc, search_pb2, search_pb2_grpc

from bench import common
from bench.loopback_stack import free_port, loopback_stack_data
from bench.row_load import wave_figures, wave_sums
from bench.service_cpu import board_request, cpu_seconds
from stack.supervisor import last_line, wait_serving
from tandem.config import ConfigError, TandemConfig, load_config
from tandem.workers import children

COLUMNS = ("service", "host_wait", "workers", "clients", "backend", "batch", "calls_per_s", "calls_ratio", "searches_per_s",
           "cpu_cores", "cpu_us_per_call", "cpu_us_per_search", "errors")
ROOT = Path(__file__).resolve().parents[1]
WARM_S = 2.0


def _call(service: str, channel: grpc.Channel, simulations: int, batch: int = 1):
    """One call of ``service``'s measured method, bound to ``channel``."""
    if service == "search":
        requests = [search_pb2.SearchRequest(game="connect4", moves="4453", simulations=simulations, seed=s)
                    for s in range(1, batch + 1)]
        stub = search_pb2_grpc.SearchServiceStub(channel)
        if batch > 1:
            many = search_pb2.SearchBatchRequest(searches=requests)
            return lambda: stub.SearchBatch(many, timeout=30)
        return lambda: stub.Search(requests[0], timeout=30)
    request = board_request()
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    return lambda: stub.Evaluate(request, timeout=30)


def _client(service: str, address: str, simulations: int, batch: int, start: float, until: float, out) -> None:
    """One client process: calls back to back over its own connection; (calls, errors) to ``out``."""
    calls = errors = 0
    with grpc.insecure_channel(address) as ch:
        call = _call(service, ch, simulations, batch)
        while time.time() < until:
            try:
                call()
                ok = True
            except grpc.RpcError:
                ok = False
            if time.time() >= start:  # the warm-up's calls are not counted
                calls, errors = calls + ok, errors + (not ok)
    out.put((calls, errors))


def _serving(address: str, cfg: TandemConfig, proc: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    """Waits until the server ``proc`` is SERVING on ``address``.

    Raises:
        SystemExit: it exited first (its log's last line says why), or ``timeout_s`` passed.
    """
    try:
        wait_serving(address, cfg, timeout_s, proc, why=lambda: last_line(log))
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None


def _profile(pid: int, seconds: float, path: Path) -> list[subprocess.Popen]:
    """py-spy on the service and its workers during the measured seconds (module docstring)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return [subprocess.Popen([spy, "record", "-f", "raw", "-r", "250", "-d", str(max(int(seconds) - 1, 1)),
                              "-o", f"{path}.{name}.raw", "--pid", str(pid), "--subprocesses", "--nonblocking", *flags],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, flags in (("gil", ["--gil"]), ("all", ["--idle"]))]


def _config(service: str, workers: int, backend: str, provider: str, host_wait: str) -> dict:
    if service == "search":  # its /metrics on: the wave loop's figures (all workers')
        return loopback_stack_data({"search": {"backend": backend, "evaluator": "rollout", "workers": workers,
                                               "host_wait": host_wait, "metrics_port": free_port()}})
    return loopback_stack_data({"reward": {"execution_provider": provider, "workers": workers,
                                           "host_wait": host_wait}})


def measure(service: str, workers: int, clients: int, backend: str, provider: str, simulations: int,
            seconds: float, profile: Path | None = None, host_wait: str = "auto", batch: int = 1) -> dict:
    data = _config(service, workers, backend, provider, host_wait)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tandem.yaml"
        path.write_text(yaml.safe_dump(data))
        try:
            cfg = load_config(path)
        except ConfigError as exc:  # e.g. --backend gpu: search.backend takes cpu or cuda
            raise SystemExit(f"bench.calls: {exc}") from None
        address = data[service]["address"]
        log = Path(tmp) / "server.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "stack", "serve", service, "--config", str(path)],
                                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        try:
            _serving(address, cfg, proc, log)
            time.sleep(3.0 if workers > 1 else 0.5)  # every worker bound (they start after the first)
            ctx = multiprocessing.get_context("spawn")
            out = ctx.Queue()
            start = time.time() + WARM_S
            until = start + seconds
            procs = [ctx.Process(target=_client, args=(service, address, simulations, batch, start, until, out))
                     for _ in range(clients)]
            for p in procs:
                p.start()
            time.sleep(max(start - time.time(), 0))
            pids = [proc.pid, *children(proc.pid)]
            port = data[service].get("metrics_port", 0)
            waves0 = wave_sums(port) if port else {}
            before = sum(cpu_seconds(p) for p in pids)
            spies = _profile(proc.pid, seconds, profile / f"{service}_w{workers}_{host_wait}_b{batch}") if profile else []
            time.sleep(max(until - time.time(), 0))
            used = sum(cpu_seconds(p) for p in pids) - before
            waves = wave_figures(waves0, wave_sums(port), seconds) if port else {}
            results = [out.get(timeout=60) for _ in procs]
            for p in procs:
                p.join(30)
            for spy in spies:
                spy.wait(60)
        finally:
            proc.terminate()
            proc.wait(60)
    calls = sum(c for c, _ in results)
    return {"service": service, "workers": workers, "clients": clients, "host_wait": host_wait,
            "backend": backend if service == "search" else provider, "batch": batch,
            "calls_per_s": round(calls / seconds, 1), "searches_per_s": round(calls * batch / seconds, 1),
            "cpu_cores": round(used / seconds, 3), "cpu_us_per_call": round(used / max(calls, 1) * 1e6, 1),
            "cpu_us_per_search": round(used / max(calls * batch, 1) * 1e6, 1),
            "seconds": seconds, "errors": sum(e for _, e in results), "simulations": simulations, **waves}


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--service", type=lambda s: s.split(","), default=["search"],
                        help="comma list of: search, reward (default search)")
    parser.add_argument("--provider", default="auto", help="reward.execution_provider (default auto; --quick: cpu)")
    parser.add_argument("--workers", type=common.int_list, default=[1, 2, 4])
    parser.add_argument("--clients", type=int, default=8, help="client processes (default 8)")
    parser.add_argument("--simulations", type=int, default=1, help="simulations a search (default 1: the call's cost)")
    parser.add_argument("--batch", type=common.int_list, default=[1],
                        help="searches a call (search only; K > 1: a SearchBatch of K; default 1)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--host-wait", type=lambda s: s.split(","), default=["auto"],
                        help="comma list of SERVICE.host_wait values to compare (auto, spin, yield, block; "
                             "default auto)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="folder for py-spy profiles of the service while it is measured (module docstring)")
    args = parser.parse_args()
    unknown = set(args.service) - {"search", "reward"}
    if unknown:
        parser.error(f"--service: unknown {', '.join(sorted(unknown))} (choose from search, reward)")
    backend = "cpu" if args.quick or not args.backend or args.backend == "all" else args.backend
    provider = "cpu" if args.quick else args.provider
    if args.quick:
        args.workers, args.clients, args.seconds = [1, 2], 2, 2.0
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    for service in args.service:
        batches = args.batch if service == "search" else [1]
        rows = [measure(service, w, args.clients, backend, provider, args.simulations, args.seconds, args.profile,
                        wait, k) for wait in args.host_wait for w in args.workers for k in batches]
        base = next((r["calls_per_s"] for r in rows if r["workers"] == 1), None)  # the first host_wait's, first batch
        for r in rows:
            r["calls_ratio"] = round(r["calls_per_s"] / base, 3) if base else None
            common.progress(r)
        common.write_results(f"{service}_calls", rows, args.out)
        common.print_rows(rows, COLUMNS)


if __name__ == "__main__":
    main()
