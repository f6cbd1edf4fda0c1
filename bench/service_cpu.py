"""service_cpu: CPU each service process burns, idle and under light load.

Starts the three real servers (``tandem up``'s processes, loopback, search on
the CPU backend) once per ONNX Runtime thread-spinning setting
(``reward.ort_thread_spinning`` false, the default, and true: the issue-13
kind-8 before/after), then measures each process's CPU time (user + system,
all threads, from /proc/PID/stat) per wall-clock second:

* ``idle``: no calls, ``--seconds`` after a settle of 2 s;
* ``light_evaluate``: ``--rate`` one-board ``Evaluate`` calls per second
  (``connect4_value``, REQUEST_CLASS_CRITICAL, paced from one client thread)
  for ``--seconds``.

Units: ``cpu_cores`` = process CPU seconds / wall seconds (1.0 = one core busy
the whole time); ``calls_per_s`` = Evaluate calls answered per second.

Row fields: ort_thread_spinning, phase, service, cpu_cores, calls_per_s,
seconds, execution_provider.

Command (full): ``python3 -m bench.service_cpu``
Smoke test:     ``python3 -m bench.service_cpu --quick --out /tmp/bench-smoke`` (2 s phases)
"""
from __future__ import annotations

import os
import time

import numpy as np
from tandem.v1 import reward_pb2, reward_pb2_grpc

from bench import common
from bench.loopback_stack import loopback_stack
from tandem import tensors
from tandem.server import channel

BENCHMARK = "service_cpu"
COLUMNS = ("ort_thread_spinning", "phase", "service", "cpu_cores", "calls_per_s", "seconds")
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # after "(comm)", which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of stat


def board_request() -> reward_pb2.EvaluateRequest:
    board = np.zeros((1, 2, 6, 7), np.uint8)
    board[0, 0, 0, 3] = 1
    return reward_pb2.EvaluateRequest(model="connect4_value", inputs=[tensors.to_proto("board", board)],
                                      request_class=reward_pb2.REQUEST_CLASS_CRITICAL)


def _measure(pids: dict[str, int], seconds: float, load=None) -> tuple[dict[str, float], int]:
    """CPU cores per process over ``seconds``; ``load(until)`` (returns calls made) runs meanwhile."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    calls = load(t0 + seconds) if load else 0
    time.sleep(max(t0 + seconds - time.monotonic(), 0))
    wall = time.monotonic() - t0
    return {name: (cpu_seconds(pid) - before[name]) / wall for name, pid in pids.items()}, calls


def _paced_calls(stub, rate: float):
    request = board_request()

    def run(until: float) -> int:
        calls, next_at = 0, time.monotonic()
        while next_at < until:
            time.sleep(max(next_at - time.monotonic(), 0))
            stub.Evaluate(request, timeout=10)
            calls += 1
            next_at += 1.0 / rate
        return calls

    return run


def measure(spinning: bool, seconds: float, rate: float, provider: str) -> list[dict]:
    sections = {"search": {"backend": "cpu"},
                "reward": {"ort_thread_spinning": spinning, "execution_provider": provider}}
    rows = []
    with loopback_stack(sections) as (cfg, stack):
        pids = {name: proc.pid for name, proc in stack.procs.items()}
        with channel(cfg.reward.address, cfg) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            _paced_calls(stub, rate)(time.monotonic() + 1.0)  # connection and first calls, untimed
            time.sleep(2.0)  # settle: nothing of the warm-up left running
            for phase, load in (("idle", None), ("light_evaluate", _paced_calls(stub, rate))):
                cores, calls = _measure(pids, seconds, load)
                for service, value in cores.items():
                    row = dict(ort_thread_spinning=spinning, phase=phase, service=service,
                               cpu_cores=round(value, 3), calls_per_s=round(calls / seconds, 1),
                               seconds=seconds, execution_provider=provider)
                    common.progress(row)
                    rows.append(row)
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase (default 10)")
    parser.add_argument("--rate", type=float, default=60.0, help="Evaluate calls per second (default 60)")
    parser.add_argument("--provider", default="auto", help="reward.execution_provider (default auto; --quick: cpu)")
    args = parser.parse_args()
    seconds = 2.0 if args.quick else args.seconds
    provider = "cpu" if args.quick else args.provider
    rows = []
    for spinning in (False, True):
        rows += common.attempt(f"spinning={spinning}", measure, spinning, seconds, args.rate, provider) or []
    common.finish(BENCHMARK, rows, args.out, COLUMNS)


if __name__ == "__main__":
    main()
