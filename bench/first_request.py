"""first_request: what the first request at each batch bucket costs, against
that bucket's p50, through the reward service as it is served.

Starts the reward service in this process with the config's models
(``deploy/config/tandem.yaml`` unless ``--config``), waits until it is up
(every bucket of every session warmed, on its batcher's worker thread), then,
for each model, lane and bucket -- the critical lane (its own runner at the
greatest held stream priority) and the bulk lane at each stream priority the
scheduler may assign -- one ``Evaluate`` of that request class and ``bucket``
rows (the first at that shape), then ``--repeats`` more. A bucket whose first request cost more than 2x its p50 means some
per-shape or per-thread work (cuDNN's algorithm search, a graph capture, an
allocation) is still on the request path.

Units: ms, gRPC round trip on loopback as a client sees it; ``server_ms_*``
are the service's own queue + model time of the same calls.

Row fields: model, lane, stream_priority, bucket, first_ms, p50_ms, first_over_p50,
server_first_ms, server_p50_ms, start_s (the service's start-up, warm-up
included; the same in every row), repeats.

Command (full): ``python3 -m bench.first_request``
Smoke test:     ``python3 -m bench.first_request --quick`` (the CPU execution provider: no buckets, so a
row per size of :data:`CPU_SIZES`, each the first at its shape)
"""
from __future__ import annotations

import socket
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from tandem.v1 import reward_pb2

from bench import common
from stack.stats import percentiles
from tandem.config import load_config

BENCHMARK = "first_request"
# Without buckets (the CPU path runs every batch at its own size): the sizes a frame's critical
# Evaluate takes (1-16 images), then two beyond the warm-up (reward_service/session.py CPU_WARM_ROWS).
CPU_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
_CLASSES = {"critical": reward_pb2.REQUEST_CLASS_CRITICAL, "bulk": reward_pb2.REQUEST_CLASS_BULK}
COLUMNS = ("model", "lane", "stream_priority", "bucket", "first_ms", "p50_ms", "first_over_p50", "server_first_ms",
           "server_p50_ms", "start_s")


def _request(session, rows: int, request_class: int):
    from tandem.v1 import reward_pb2

    from tandem import tensors

    rng = np.random.default_rng(rows)
    inputs = []
    for spec in session.inputs:
        shape = [rows, *spec.shape[1:]]
        dtype = tensors.numpy_dtype(spec.dtype)
        x = rng.integers(0, 2, shape).astype(dtype) if dtype.kind in "ui" else rng.random(shape).astype(dtype)
        inputs.append(tensors.to_proto(spec.name, x))
    return reward_pb2.EvaluateRequest(model=session.name, inputs=inputs, request_class=request_class)


def _lanes(service):
    """(session, lane, stream priority) for every runner a request can run on:
    the critical lane's (the greatest held stream priority), then the bulk
    lane's at each stream priority the scheduler may assign."""
    for session in service.servicer.sessions.values():
        held = session.stream_priorities or (0,)
        yield session, "critical", min(held)
        for stream_priority in held:
            yield session, "bulk", stream_priority


def measure(cfg, repeats: int) -> list[dict]:
    """Rows for every model x held stream priority x bucket of the service ``cfg`` describes."""
    from tandem.v1 import reward_pb2_grpc

    from reward_service import server as reward_server
    from tandem.server import channel

    t = time.perf_counter()
    service = reward_server.start(cfg, follow_scheduler=False)
    start_s = time.perf_counter() - t
    rows = []
    try:
        with channel(cfg.reward.address, cfg) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            # The connection first: a client connects once, not per bucket.
            stub.ListModels(reward_pb2.ListModelsRequest(), timeout=30)
            for session, lane, stream_priority in _lanes(service):
                if lane == "bulk":
                    service.servicer.set_stream_priority(stream_priority)
                for bucket in session.buckets or CPU_SIZES:
                    request = _request(session, bucket, _CLASSES[lane])
                    calls = []
                    for _ in range(repeats + 1):
                        t0 = time.perf_counter()
                        reply = stub.Evaluate(request, timeout=30)
                        calls.append(((time.perf_counter() - t0) * 1e3, reply.queue_ms + reply.compute_ms))
                    (first, server_first), rest = calls[0], calls[1:]
                    (p50,) = percentiles([c[0] for c in rest], 50)
                    (server_p50,) = percentiles([c[1] for c in rest], 50)
                    row = dict(model=session.name, lane=lane, stream_priority=stream_priority, bucket=bucket,
                               first_ms=round(first, 3), p50_ms=round(p50, 3),
                               first_over_p50=round(first / p50, 2), server_first_ms=round(server_first, 3),
                               server_p50_ms=round(server_p50, 3), start_s=round(start_s, 2), repeats=repeats)
                    common.progress(row)
                    rows.append(row)
    finally:
        service.stop()
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--config", type=Path, default=None, help="YAML config (default deploy/config/tandem.yaml)")
    parser.add_argument("--repeats", type=int, default=30, help="calls after the first, per row (default 30)")
    args = parser.parse_args()
    cfg = load_config(args.config)
    # A free loopback port and no metrics endpoint: the benchmark must not collide with a running stack.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = replace(cfg, reward=replace(cfg.reward, address=address, metrics_port=0))
    if args.quick:
        cfg = replace(cfg, reward=replace(cfg.reward, execution_provider="cpu"))
    rows = measure(cfg, 3 if args.quick else args.repeats)
    common.finish(BENCHMARK, rows, args.out, COLUMNS)


if __name__ == "__main__":
    main()
