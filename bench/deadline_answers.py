"""deadline_answers: does a search bounded only by the caller's gRPC deadline
answer OK, with its best move, before that deadline?

Starts the three real servers (``tandem up``'s processes on loopback; the
search service on ``--search-backend``, default cpu) and, per gRPC deadline
(16.7, 30 and 100 ms: 60 FPS, 30 FPS and a tenth of a second) and evaluator,
sends ``--calls`` ``Search`` requests one after another, each with the largest
simulation budget (``search.max_simulations``) and no ``deadline_ms``: only the
gRPC deadline bounds it. Positions cycle through a few openings. One untimed
call per row first (connection, caches).

Units: ms as the client measures (``time.perf_counter`` around the call);
``margin_ms`` = gRPC deadline - round trip of an OK answer (positive: in time).

Row fields: evaluator, grpc_deadline_ms, calls, ok, deadline_exceeded, other_errors,
margin_ms_p50, margin_ms_p99 (the 1 % smallest margin), simulations_p50,
search_backend, host_load_1min (the host's 1-minute load average over the row:
on a shared host other work takes the CPU the deadline needs), host_cpus.

Command (full): ``python3 -m bench.deadline_answers``
Smoke test:     ``python3 -m bench.deadline_answers --quick --out /tmp/bench-smoke`` (5 calls a row)
"""
from __future__ import annotations

import os
import time

import grpc
import numpy as np
from tandem.v1 import search_pb2, search_pb2_grpc

from bench import common
from bench.loopback_stack import loopback_stack
from stack.stats import percentiles
from tandem.server import channel

BENCHMARK = "deadline_answers"
COLUMNS = ("evaluator", "grpc_deadline_ms", "calls", "ok", "deadline_exceeded", "other_errors", "margin_ms_p50",
           "margin_ms_p99", "simulations_p50")
DEADLINES_MS = (16.7, 30.0, 100.0)
OPENINGS = ("", "4", "44", "4453", "3443", "445")
EVALUATORS = {"rollout": search_pb2.EVALUATOR_ROLLOUT, "value_model": search_pb2.EVALUATOR_VALUE_MODEL}


def measure_row(stub, evaluator: str, deadline_ms: float, calls: int, budget: int, backend: str) -> dict:
    def call(i: int):
        request = search_pb2.SearchRequest(game="connect4", moves=OPENINGS[i % len(OPENINGS)], simulations=budget,
                                           evaluator=EVALUATORS[evaluator], seed=i + 1)
        t0 = time.perf_counter()
        try:
            reply = stub.Search(request, timeout=deadline_ms / 1e3)
            return "OK", (time.perf_counter() - t0) * 1e3, reply.simulations
        except grpc.RpcError as exc:
            return exc.code().name, (time.perf_counter() - t0) * 1e3, 0

    call(0)  # untimed
    load_before = os.getloadavg()[0]
    outcomes = [call(i) for i in range(calls)]
    ok = [(ms, sims) for code, ms, sims in outcomes if code == "OK"]
    margins = [deadline_ms - ms for ms, _ in ok]
    p50, p1 = percentiles(margins, 50, 1) if margins else (None, None)
    return dict(evaluator=evaluator, grpc_deadline_ms=deadline_ms, calls=calls, ok=len(ok),
                deadline_exceeded=sum(code == "DEADLINE_EXCEEDED" for code, _, _ in outcomes),
                other_errors=sum(code not in ("OK", "DEADLINE_EXCEEDED") for code, _, _ in outcomes),
                margin_ms_p50=None if p50 is None else round(p50, 2),
                margin_ms_p99=None if p1 is None else round(p1, 2),
                simulations_p50=int(np.median([s for _, s in ok])) if ok else None, search_backend=backend,
                host_load_1min=round((load_before + os.getloadavg()[0]) / 2, 2), host_cpus=os.cpu_count())


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--calls", type=int, default=50, help="calls per row (default 50)")
    parser.add_argument("--search-backend", default="cpu", help="search.backend (default cpu)")
    parser.add_argument("--evaluators", default="rollout,value_model", help="comma list (default rollout,value_model)")
    args = parser.parse_args()
    calls = 5 if args.quick else args.calls
    evaluators = [e for e in args.evaluators.split(",") if e]
    rows = []
    with loopback_stack({"search": {"backend": args.search_backend}}) as (cfg, _):
        with channel(cfg.search.address, cfg) as ch:
            stub = search_pb2_grpc.SearchServiceStub(ch)
            for evaluator in evaluators:
                for deadline_ms in DEADLINES_MS:
                    row = common.attempt(f"{evaluator} {deadline_ms} ms", measure_row, stub, evaluator, deadline_ms,
                                         calls, cfg.search.max_simulations, args.search_backend)
                    if row:
                        common.progress(row)
                        rows.append(row)
    common.finish(BENCHMARK, rows, args.out, COLUMNS)


if __name__ == "__main__":
    main()
