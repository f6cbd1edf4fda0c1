"""Reward service latency: ONNX Runtime in-process (FP32, FP16 with an FP32
head, with and without CUDA graphs), PyTorch eager as the baseline, Evaluate
through gRPC against a bare gRPC echo of the same bytes, and the
host-to-device copy of one frame from pinned and pageable memory.

    python -m bench.reward_latency            # on the GPU machine
    python -m bench.reward_latency --quick    # seconds, any machine (CPU rows)

Writes ``bench/results/reward_latency.json`` (``--out DIR``; format in
bench/common.py). Row fields: ``model``, ``precision``, ``cuda_graph``,
``batch``, ``path`` (``in_process``, ``grpc``, ``grpc_echo``),
``latency_ms_p50``, ``latency_ms_p99``, and: ``runtime`` (``onnxruntime`` or
``torch_eager``), ``layout``, ``execution_provider``, ``first_ms`` (the first
call after the session or server started, before any warm-up of ours),
``priority``, ``server_queue_ms_p50`` and ``server_compute_ms_p50`` (gRPC
rows: what the server reports of its batcher wait and model run, so the rest
of the difference to the echo is the servicer's Python), ``host_memory``
(copy rows), ``heldout_accuracy``
and ``heldout_positions`` (frame model rows).

What each path times (wall clock, host arrays in and out, so every row
includes the copies a caller pays):

* in_process: ``ModelSession.run`` on uint8 frames in host memory: staging
  into pinned memory, upload, run (graph replay where on), download;
* grpc: ``RewardService.Evaluate`` of the batch from a client in this process
  to a reward server in a child process, over loopback TCP (dynamic batcher
  included);
* grpc_echo: a bare unary RPC on a server in the same child process that
  takes the same request bytes and answers with as many bytes as the real
  response; measured interleaved with the grpc rows, so both see the same
  machine state;
* copy rows: one frame (uint8, and float32 as a float frame would be) from
  pinned or pageable host memory to the device through CuPy, synchronised.

Models: ``resnet18`` (the latency benchmark model, random weights, generated
by training/make_resnet18.py into runs/models/ when missing) and
``frame_reward`` (the shipped frame model; its rows carry the held-out
accuracy of FP32 and FP16, computed through the same sessions).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import (
    REPO_ROOT,
    int_list,
    make_parser,
    note,
    print_rows,
    progress,
    time_calls,
    write_results,
)
from stack.stats import percentiles

FRAME_MODEL = REPO_ROOT / "reward_service" / "models" / "frame_reward.onnx"
COLUMNS = ["model", "precision", "layout", "cuda_graph", "batch", "path", "runtime", "latency_ms_p50",
           "latency_ms_p99", "first_ms", "heldout_accuracy"]


def _frames(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, 224, 224, 3), dtype=np.uint8)


def _reward_cfg(gpu: bool, **fields):
    from tandem.config import RewardConfig

    return RewardConfig(execution_provider="auto" if gpu else "cpu", stream_priorities=(0,), **fields)


def _model_cfg(name: str, path: Path, buckets, *, cuda_graph: bool, precision: str = "fp32", nhwc: bool = False):
    from tandem.config import ModelConfig

    return ModelConfig(name=name, path=str(path), batch_buckets=tuple(buckets), max_batch_size=max(buckets),
                       cuda_graph=cuda_graph, precision=precision, prefer_nhwc=nhwc)


def _row(model, precision, layout, graph, batch, path, runtime, ms, first_ms=None, **extra) -> dict:
    p50, p99 = percentiles(ms, 50, 99)
    row = {"model": model, "precision": precision, "layout": layout, "cuda_graph": graph, "batch": batch,
           "path": path, "runtime": runtime, "latency_ms_p50": p50, "latency_ms_p99": p99, "first_ms": first_ms}
    row.update(extra)
    progress(row)
    return row


def _repeats(batch: int, quick: bool) -> int:
    if quick:
        return 5
    return 200 if batch <= 16 else 80


# -- in-process ONNX Runtime ---------------------------------------------------------


def in_process_rows(model: str, path: Path, precision: str, batches, *, graph: bool, nhwc: bool, gpu: bool,
                    quick: bool, accuracy_fn=None, convert: bool = False) -> list[dict]:
    """Rows of one session. ``precision`` labels the rows; ``convert``: the
    session converts the file to FP16 at load (config ``precision: fp16``)."""
    from reward_service.session import ModelSession

    t = time.perf_counter()
    cfg_precision = "fp16" if convert else "fp32"
    session = ModelSession(_model_cfg(model, path, batches, cuda_graph=graph, precision=cfg_precision, nhwc=nhwc),
                           _reward_cfg(gpu))
    note(f"{model} {precision} graph={graph} nhwc={nhwc}: session ready in {time.perf_counter() - t:.1f} s "
         f"(warm-up {session.warm_up_ms:.0f} ms); " + "; ".join(f"{k} {v}" for k, v in session.runtime.items()))
    graph_on = session.runtime.get("cuda_graph", "").startswith("on")
    layout = "nhwc" if nhwc else "nchw"
    rows = []
    extra = {}
    if accuracy_fn is not None:
        extra = accuracy_fn(lambda x: session.run({"frame": x})[0]["value"])
    for i, b in enumerate(batches):
        x = _frames(b, b)
        first = None
        if i == 0:  # the first call after start, before any warm-up of ours
            t = time.perf_counter()
            session.run({"frame": x})
            first = (time.perf_counter() - t) * 1e3
        ms = time_calls(lambda _: session.run({"frame": x}), _repeats(b, quick), warmup=3, sync=lambda: None)
        rows.append(_row(model, precision, layout, graph_on, b, "in_process", "onnxruntime", ms, first,
                         execution_provider=session.execution_provider, **extra))
    return rows


def frame_accuracy(limit: int | None):
    """A function: run(frames) -> value [n, 1] -> {heldout_accuracy, heldout_positions}."""
    from training.train_frame_reward import heldout_sets, outcome_class, render_heldout

    sets = heldout_sets()
    chunks = []
    for moves, target in sets.values():
        moves, target = moves[:limit], target[:limit]
        for i in range(0, len(moves), 64):
            chunks.append((render_heldout(moves, 1995, i, min(i + 64, len(moves))), target[i : i + 64]))

    def measure(run) -> dict:
        right = total = 0
        for frames, target in chunks:
            c = outcome_class(run(frames))
            right += int((c == np.sign(target).astype(int)).sum())
            total += len(target)
        return {"heldout_accuracy": right / total, "heldout_positions": total}

    return measure


# -- PyTorch eager ----------------------------------------------------------------------


def torch_rows(batches, quick: bool) -> list[dict]:
    import torch

    from training.make_resnet18 import build_resnet18

    model = build_resnet18().cuda()
    rows = []
    with torch.no_grad():
        for i, b in enumerate(batches):
            host = torch.from_numpy(_frames(b, b)).pin_memory()

            def call(_):
                return model(host.cuda(non_blocking=True)).cpu()  # .cpu() synchronises

            first = None
            if i == 0:
                t = time.perf_counter()
                call(0)
                first = (time.perf_counter() - t) * 1e3
            ms = time_calls(call, _repeats(b, quick), warmup=5, sync=lambda: None)
            rows.append(_row("resnet18", "fp32", "nchw", False, b, "in_process", "torch_eager", ms, first))
    return rows


# -- host-to-device copies ------------------------------------------------------------------


def copy_rows(quick: bool) -> list[dict]:
    import cupy
    import cupyx

    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    for dtype, label in ((np.uint8, "uint8"), (np.float32, "fp32")):
        pageable = _frames(1).astype(dtype)
        pinned = cupyx.empty_pinned(pageable.shape, dtype)
        pinned[...] = pageable
        dev = cupy.empty(pageable.shape, dtype)
        for memory, host in (("pageable", pageable), ("pinned", pinned)):
            def call(_, host=host):
                dev.set(host, stream=stream)
                stream.synchronize()

            ms = time_calls(call, 5 if quick else 500, warmup=10, sync=lambda: None)
            rows.append(_row("copy_h2d_one_frame", label, None, False, 1, "in_process", "cupy", ms,
                             host_memory=memory, bytes=int(pageable.nbytes)))
    return rows


# -- gRPC: Evaluate vs a bare echo ----------------------------------------------------------------

ECHO_METHOD = "/bench.Echo/Echo"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(conn, cfg_data: dict) -> None:
    """Child process: the reward server and an echo server. Sends their
    addresses, takes the echo's response size, serves until told to stop."""
    from concurrent import futures

    import grpc

    from reward_service import server as reward_server
    from tandem.config import parse_config

    t = time.perf_counter()
    service = reward_server.start(parse_config(cfg_data), follow_scheduler=False)
    started_s = time.perf_counter() - t
    reply = {"bytes": b""}  # set from the parent's measurement of a real response
    echo = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg_data["reward"]["server"]["max_workers"]),
                       options=[("grpc.max_receive_message_length", 64 << 20)])
    handler = grpc.unary_unary_rpc_method_handler(lambda req, ctx: reply["bytes"])
    echo.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler})])
    port = echo.add_insecure_port("127.0.0.1:0")
    echo.start()
    conn.send({"reward": cfg_data["reward"]["address"], "echo": f"127.0.0.1:{port}", "start_s": started_s,
               "runtime": {n: s.runtime for n, s in service.servicer.sessions.items()}})
    reply["bytes"] = b"\0" * conn.recv()
    conn.recv()  # until the parent is done
    echo.stop(0)
    service.stop()


def grpc_rows(models: dict, gpu: bool, quick: bool) -> list[dict]:
    """models: name -> (path, precision label, cuda_graph)."""
    import grpc
    from tandem.v1 import reward_pb2, reward_pb2_grpc

    from tandem import tensors

    cfg = {
        "scheduler": {"address": f"127.0.0.1:{free_port()}", "metrics_port": 0},
        "search": {"address": f"127.0.0.1:{free_port()}", "metrics_port": 0},
        "reward": {
            "address": f"127.0.0.1:{free_port()}", "metrics_port": 0,
            "execution_provider": "auto" if gpu else "cpu", "stream_priorities": [0],
            "server": {"max_workers": 16},
            "models": [{"name": n, "path": str(p), "cuda_graph": g, "batch_buckets": [1, 2, 4, 8],
                        "max_batch_size": 8} for n, (p, _, g) in models.items()],
        },
    }
    x = _frames(1)
    requests = {
        (n, prio): reward_pb2.EvaluateRequest(model=n, inputs=[tensors.to_proto("frame", x)], request_class=prio)
        for n in models for prio in (reward_pb2.REQUEST_CLASS_CRITICAL, reward_pb2.REQUEST_CLASS_BULK)
    }
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, cfg), daemon=True)
    response_bytes = 0
    rows = []
    try:
        proc.start()
        info = parent.recv()
        note(f"gRPC reward server started in {info['start_s']:.1f} s")
        ch = grpc.insecure_channel(info["reward"], options=[("grpc.max_send_message_length", 64 << 20)])
        grpc.channel_ready_future(ch).result(timeout=30)
        stub = reward_pb2_grpc.RewardServiceStub(ch)
        stub.ListModels(reward_pb2.ListModelsRequest(), timeout=10)  # the connection, not the model
        first = {}
        for (n, prio), req in requests.items():
            if n not in first:
                t = time.perf_counter()
                resp = stub.Evaluate(req, timeout=30)
                first[n] = (time.perf_counter() - t) * 1e3
                response_bytes = len(resp.SerializeToString())
        echo_ch = grpc.insecure_channel(info["echo"], options=[("grpc.max_send_message_length", 64 << 20)])
        grpc.channel_ready_future(echo_ch).result(timeout=30)
        # The echo answers with as many bytes as a real response (all responses here are alike in size).
        parent.send(response_bytes)
        echo = echo_ch.unary_unary(ECHO_METHOD, request_serializer=None, response_deserializer=None)
        payloads = {k: r.SerializeToString() for k, r in requests.items()}
        # The echo's first call of the same bytes, after a small one (as ListModels above):
        # what a fresh connection costs a first large message whatever the server does.
        first_key = next(iter(payloads))
        echo(b"", timeout=10)
        t = time.perf_counter()
        echo(payloads[first_key], timeout=10)
        echo_first = (time.perf_counter() - t) * 1e3
        n_calls = 10 if quick else 400
        for (n, prio), req in requests.items():
            t_eval, t_echo, server = [], [], []
            for i in range(n_calls + 20):
                t = time.perf_counter()
                resp = stub.Evaluate(req, timeout=10)
                a = (time.perf_counter() - t) * 1e3
                t = time.perf_counter()
                echo(payloads[(n, prio)], timeout=10)
                b = (time.perf_counter() - t) * 1e3
                if i >= 20:
                    t_eval.append(a)
                    t_echo.append(b)
                    server.append((resp.queue_ms, resp.compute_ms))
            path, precision, graph = models[n]
            pname = reward_pb2.RequestClass.Name(prio).removeprefix("REQUEST_CLASS_").lower()
            graph_on = info["runtime"][n].get("cuda_graph", "").startswith("on")
            rows.append(_row(n, precision, "nchw", graph_on, 1, "grpc", "onnxruntime", np.array(t_eval),
                             first[n] if prio == reward_pb2.REQUEST_CLASS_CRITICAL else None, priority=pname,
                             request_bytes=len(payloads[(n, prio)]), response_bytes=response_bytes,
                             # What the server itself reports: the batcher's wait and the model run.
                             server_queue_ms_p50=percentiles((q for q, _ in server), 50)[0],
                             server_compute_ms_p50=percentiles((c for _, c in server), 50)[0]))
            rows.append(_row(n, precision, None, None, 1, "grpc_echo", "grpc", np.array(t_echo),
                             echo_first if (n, prio) == first_key else None, priority=pname,
                             request_bytes=len(payloads[(n, prio)]), response_bytes=response_bytes))
        ch.close()
        echo_ch.close()
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


# -- main -----------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--batches", type=int_list, default=None, help="comma list (default 1,8,16,64; quick: 1,8)")
    parser.add_argument("--accuracy-limit", type=int, default=None,
                        help="held-out positions per set for the accuracy columns (default all; quick: 20)")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: resnet18, torch, frame, grpc, copy")
    args = parser.parse_args(argv)
    quick = args.quick
    batches = args.batches or ([1, 8] if quick else [1, 8, 16, 64])
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    from tandem.gpu import cuda_device_count

    gpu = cuda_device_count() > 0
    try:
        import cupy  # noqa: F401
    except ImportError:
        note("CuPy missing: GPU rows skipped")
        gpu = False
    if not gpu:
        note("no CUDA GPU: ONNX Runtime rows run on the CPU; torch, copy rows skipped")

    rows: list[dict] = []

    def save() -> Path:
        """Writes what is measured so far (a run cut short still leaves its rows)."""
        path = write_results("reward_latency", rows, args.out)
        doc = json.loads(path.read_text())
        import onnxruntime

        doc["versions"]["onnxruntime"] = onnxruntime.__version__
        try:
            import torch

            doc["versions"]["torch"] = torch.__version__
        except ImportError:
            doc["versions"]["torch"] = None
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return path

    resnet = REPO_ROOT / "runs" / "models" / "resnet18_latency_benchmark.onnx"
    if "resnet18" not in skip:
        if not resnet.exists():
            from training.make_resnet18 import export

            export(resnet)
            note(f"generated {resnet}")
        resnet16 = resnet.with_name(resnet.stem + ".fp16.onnx")
        if not resnet16.exists():
            import onnx

            from reward_service.precision import convert_fp16

            onnx.save(convert_fp16(onnx.load(str(resnet))), str(resnet16))
        variants = [("fp32", resnet, False, False), ("fp32", resnet, True, False), ("fp32", resnet, True, True),
                    ("fp16", resnet16, False, False), ("fp16", resnet16, True, False), ("fp16", resnet16, True, True)]
        if not gpu:
            variants = [variants[0], variants[3]]
        for precision, path, graph, nhwc in variants:
            rows += in_process_rows("resnet18", path, precision, batches, graph=graph and gpu, nhwc=nhwc, gpu=gpu,
                                    quick=quick)
        save()
    if "frame" not in skip:
        limit = args.accuracy_limit if args.accuracy_limit is not None else (20 if quick else None)
        acc = frame_accuracy(limit)
        for precision in ("fp32", "fp16"):
            rows += in_process_rows("frame_reward", FRAME_MODEL, precision, [1, 64], graph=gpu, nhwc=False, gpu=gpu,
                                    quick=quick, accuracy_fn=acc, convert=precision == "fp16")
        save()
    if "grpc" not in skip:
        models = {"frame_reward": (FRAME_MODEL, "fp32", gpu)}
        if "resnet18" not in skip:
            models["resnet18_fp16"] = (resnet.with_name(resnet.stem + ".fp16.onnx"), "fp16", gpu)
        rows += grpc_rows(models, gpu, quick)
        save()
    if gpu and "copy" not in skip:
        rows += copy_rows(quick)
    if gpu and "torch" not in skip:
        rows += torch_rows(batches, quick)
    save()
    print()
    print_rows(rows, COLUMNS + ["priority", "host_memory"])
    summary(rows)
    return 0


def summary(rows: list[dict]) -> None:
    """The issue's targets, each with the measured figure (where measured)."""

    def find(**kw):
        for r in rows:
            if all(r.get(k) == v for k, v in kw.items()):
                return r
        return None

    lines = []
    best = {}
    for b in (1, 16, 64):
        cands = [r for r in rows if r["path"] == "in_process" and r["runtime"] == "onnxruntime"
                 and r["model"] == "resnet18" and r["batch"] == b]
        if cands:
            best[b] = min(cands, key=lambda r: r["latency_ms_p50"])
    if 1 in best:
        r = best[1]
        lines.append(f"in-process batch 1 p50 {r['latency_ms_p50']:.3f} ms (target <= 0.30; {r['precision']}, graph {r['cuda_graph']}, {r['layout']})")
    if 16 in best:
        r = best[16]
        lines.append(f"in-process batch 16 p50 {r['latency_ms_p50']:.3f} ms (target <= 0.60; {r['precision']}, graph {r['cuda_graph']}, {r['layout']})")
    f32 = min((r for r in rows if r["model"] == "resnet18" and r["precision"] == "fp32" and r["batch"] == 64
               and r["runtime"] == "onnxruntime"), key=lambda r: r["latency_ms_p50"], default=None)
    f16 = min((r for r in rows if r["model"] == "resnet18" and r["precision"] == "fp16" and r["batch"] == 64),
              key=lambda r: r["latency_ms_p50"], default=None)
    if f32 and f16:
        red = 1 - f16["latency_ms_p50"] / f32["latency_ms_p50"]
        lines.append(f"fp16 vs fp32 at batch 64: {100 * red:.0f} % less latency (target >= 40 %)")
    a32 = find(model="frame_reward", precision="fp32", batch=1)
    a16 = find(model="frame_reward", precision="fp16", batch=1)
    if a32 and a16 and a32.get("heldout_accuracy") is not None:
        lines.append(f"frame model held-out accuracy fp32 {100 * a32['heldout_accuracy']:.2f} % fp16 "
                     f"{100 * a16['heldout_accuracy']:.2f} % (loss target <= 0.5 points)")
    for r in rows:
        if r["path"] == "grpc":
            e = find(path="grpc_echo", model=r["model"], priority=r["priority"])
            if e:
                lines.append(f"gRPC {r['model']} {r['priority']}: Evaluate {r['latency_ms_p50']:.3f} ms vs echo "
                             f"{e['latency_ms_p50']:.3f} ms p50: +{r['latency_ms_p50'] - e['latency_ms_p50']:.3f} ms (target <= 0.2); "
                             f"server: queue {r['server_queue_ms_p50']:.3f} + model {r['server_compute_ms_p50']:.3f} ms")
    for r in rows:
        if r.get("first_ms") is not None:
            lines.append(f"first call {r['model']} {r['precision']} {r['path']} batch {r['batch']}: "
                         f"{r['first_ms']:.3f} ms = {r['first_ms'] / r['latency_ms_p50']:.2f} x p50 (target <= 2)")
    print("\nTargets:")
    for line in lines:
        print("  " + line)


if __name__ == "__main__":
    sys.exit(main())
