"""value_model_runs: one run of the value model inside the reward service, by precision and layout.

Where a leaf wave's model time goes, without the services around it: the
shipped ``connect4_value`` in the reward service's own bound runner (the
critical lane's: IO binding, one CUDA graph per bucket,
reward_service/session.py), in this process, on the GPU. One row per
(``variant``, ``bucket``), all variants in one run:

* ``variant``: ``fp32`` (NCHW, the file as is), ``fp32_nhwc``, ``fp16``
  (FP16 body, FP32 head), ``fp16_nhwc`` (what ``precision: auto`` +
  ``prefer_nhwc`` served on a GPU before), ``fp16_nhwc_fused_bias`` (the
  same with ``fuse_conv_bias``), ``fp32_heuristic``, ``fp16_nhwc_heuristic``
  and ``fp16_nhwc_fused_bias_heuristic`` (cuDNN's HEURISTIC algorithm choice
  instead of EXHAUSTIVE: a shorter start-up; the last is what the shipped
  config serves), ``fp32_no_graph`` and
  ``fp16_nhwc_no_graph`` (no CUDA graph: every kernel launched from the host);
* ``nodes``: the nodes ONNX Runtime runs per run of the variant after its
  fusions (every node event of one run in its profile), ``top_ops`` the three
  op types with the most time there;
* ``run_us``: the runner's whole batch: the device-to-device copy of the
  wave in, the graph replay, the outputs' copy out, one synchronisation
  (p50; ``run_us_p99``);
* ``gpu_us``: the graph replay alone, between two CUDA events on the
  runner's stream (p50);
* ``host_call_us``: ``run_with_iobinding``'s own host time (p50);
* ``copy_in_us`` / ``copy_out_us``: the copies, each with its synchronisation;
* ``warm_up_s``: the variant's session creation + warm-up (3 buckets);
* ``run_padded_us``: the whole batch of a wave that fills 3/4 of its bucket
  (the rest zeroed on the device), timed alternating with full ones so that
  each pads again (p50 of the pair less ``run_us``).

Rows ``variant: served_batcher``: the shipped model (precision auto, NHWC)
through its critical lane as the service runs it -- the batcher's worker
thread calling ``ModelSession.run_batch`` -- waves of 3/4 of each bucket in
device memory submitted from this thread: ``wall_us`` (submit to result),
``compute_us`` (the run as the batcher times it: the service's
``compute_ms``), ``queue_us``. Against ``run_us`` of ``fp16_nhwc`` it shows
what the lane adds to a run, without another process or a socket.

Rows ``variant: ipc_source``: the served variant's runner fed 3/4-full waves
from another process's CUDA allocation opened from its IPC handle (as the
leaf channel's input region) and, alternating, from this process's memory:
``run_ipc_us`` / ``run_local_us`` (the whole batch) and ``copy_ipc_us`` /
``copy_local_us`` (the copy in, with its synchronisation).

Two more rows, ``variant: batcher_hop``: a critical request's round trip
through the dynamic batcher with a model that does nothing (``hop_us``):
the thread hops every request pays, alone and beside 1,000 idle threads
(the reward process runs about that many).

Command: ``python3 -m bench.value_model_runs [--variants fp16_nhwc,served_batcher]`` (GPU only; no ``--quick``
variant: without CUDA the rows would measure nothing this file is about).
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np

from bench import common
from tandem.config import load_config

BENCHMARK = "value_model_runs"
COLUMNS = ("variant", "threads", "bucket", "nodes", "run_us", "run_padded_us", "gpu_us", "host_call_us", "copy_in_us",
           "copy_out_us", "wall_us", "compute_us", "queue_us", "run_local_us", "run_ipc_us", "copy_local_us",
           "copy_ipc_us", "hop_us")
BUCKETS = (32, 256, 1024, 4096)
REPEATS = 200


def _p(samples_us: list[float], q: float) -> float:
    return float(np.percentile(samples_us[REPEATS // 10 :], q))  # the first tenth: warming caches


def _timed(fn, repeats: int = REPEATS) -> list[float]:
    """µs of ``repeats`` calls of ``fn()`` (common.time_calls; each call synchronises what it needs itself)."""
    return (common.time_calls(lambda _: fn(), repeats, warmup=0, sync=lambda: None) * 1e3).tolist()


def variants(model, cfg):
    """(name, model config, reward config) of every variant."""
    buckets = dict(batch_buckets=BUCKETS)
    exhaustive = replace(cfg, cudnn_conv_algo_search="EXHAUSTIVE")
    heuristic = replace(cfg, cudnn_conv_algo_search="HEURISTIC")
    plain = replace(model, fuse_conv_bias=False, **buckets)
    return [
        ("fp32", replace(plain, precision="fp32", prefer_nhwc=False), exhaustive),
        ("fp32_nhwc", replace(plain, precision="fp32", prefer_nhwc=True), exhaustive),
        ("fp16", replace(plain, precision="fp16", prefer_nhwc=False), exhaustive),
        ("fp16_nhwc", replace(plain, precision="fp16", prefer_nhwc=True), exhaustive),
        ("fp16_nhwc_fused_bias", replace(plain, precision="fp16", prefer_nhwc=True, fuse_conv_bias=True), exhaustive),
        ("fp32_heuristic", replace(plain, precision="fp32", prefer_nhwc=False), heuristic),
        ("fp16_nhwc_heuristic", replace(plain, precision="fp16", prefer_nhwc=True), heuristic),
        ("fp16_nhwc_fused_bias_heuristic", replace(plain, precision="fp16", prefer_nhwc=True, fuse_conv_bias=True),
         heuristic),
        ("fp32_no_graph", replace(plain, precision="fp32", prefer_nhwc=False, cuda_graph=False), exhaustive),
        ("fp16_nhwc_no_graph", replace(plain, precision="fp16", prefer_nhwc=True, cuda_graph=False), exhaustive),
    ]


def profile_nodes(model, cfg, rows: int) -> tuple[int, str]:
    """ONNX Runtime's profile of one run of ``model`` (its precision and
    layout) at ``rows`` rows on the CUDA execution provider: the nodes run,
    and the three op types with the most time ("Conv 484 us, ...")."""
    import collections
    import json
    import os
    import tempfile

    import onnxruntime as ort

    from reward_service.session import _to_fp16, convolution_options
    from tandem.config import resolve_path

    data = resolve_path(model.path).read_bytes()
    if model.precision == "fp16":
        data = _to_fp16(data, model.name)
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "profile")
    cuda = convolution_options(model, cfg)
    session = ort.InferenceSession(data, sess_options=opts, providers=[("CUDAExecutionProvider", cuda)])
    feed = {session.get_inputs()[0].name: np.random.default_rng(0).integers(0, 2, (rows, 2, 6, 7), dtype=np.uint8)}
    for _ in range(3):
        session.run(None, feed)
    with open(session.end_profiling()) as fh:
        events = json.load(fh)
    last = max((e["ts"] for e in events if e.get("name") == "model_run"), default=0)  # the last run's start
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("ts", 0) >= last
             and e["name"].endswith("_kernel_time")]
    by_op = collections.Counter()
    for e in nodes:
        by_op[e.get("args", {}).get("op_name", "?")] += e.get("dur", 0)
    return len(nodes), ", ".join(f"{op} {us} us" for op, us in by_op.most_common(3))


def runner_rows(name: str, model, cfg) -> list[dict]:
    import cupy as cp

    from reward_service.batcher import CRITICAL, Batch, Request
    from reward_service.session import ModelSession

    t0 = time.perf_counter()
    session = ModelSession(model, cfg)
    warm_up_s = time.perf_counter() - t0
    runner = session._critical  # noqa: SLF001 - the lane's runner, measured alone
    dev = runner.device
    nodes, top_ops = profile_nodes(model, cfg, BUCKETS[-1])
    rows = []
    rng = np.random.default_rng(0)
    for bucket in BUCKETS:
        wave = cp.asarray(rng.integers(0, 2, (bucket, 2, 6, 7)).astype(np.uint8))
        batch = Batch([Request({"board": wave}, bucket, CRITICAL)], bucket, bucket, [0], CRITICAL)
        slot = runner._slots[bucket]  # noqa: SLF001
        run = _timed(lambda: runner.run(batch))
        part = bucket * 3 // 4  # a wave that fills 3/4 of its bucket: the rest padded with zeros
        padded = Batch([Request({"board": wave[:part]}, part, CRITICAL)], part, bucket, [0], CRITICAL)
        run_padded = _timed(lambda: (runner.run(padded), runner.run(batch)))  # each run pads again
        start, end, gpu, host = cp.cuda.Event(), cp.cuda.Event(), [], []

        def replay():
            start.record(dev.stream)
            t = time.perf_counter()
            slot.session.run_with_iobinding(slot.binding, slot.run_options)
            host.append((time.perf_counter() - t) * 1e6)
            end.record(dev.stream)
            end.synchronize()
            gpu.append(cp.cuda.get_elapsed_time(start, end) * 1e3)

        _timed(replay)
        copy_in = _timed(lambda: (dev.copy_device(slot.dev_in["board"], 0, wave), dev.synchronize()))
        copy_out = _timed(lambda: ([dev.download(slot.host_out[n], d, bucket) for n, d in slot.dev_out.items()],
                                   dev.synchronize()))
        rows.append(dict(variant=name, bucket=bucket, run_us=_p(run, 50), run_us_p99=_p(run, 99),
                         run_padded_us=_p(run_padded, 50) - _p(run, 50),
                         gpu_us=_p(gpu, 50), host_call_us=_p(host, 50), copy_in_us=_p(copy_in, 50),
                         copy_out_us=_p(copy_out, 50), warm_up_s=warm_up_s, nodes=nodes, top_ops=top_ops,
                         cuda_graph=runner.graphs, repeats=REPEATS))
        common.progress(rows[-1])
    return rows


def served_rows(model, cfg) -> list[dict]:
    """The served variant through its critical lane as the reward service
    runs it (the batcher's worker thread, ``ModelSession.run_batch``), waves
    of device arrays submitted from this thread: ``wall_us`` submit to
    result, ``compute_us`` the run as the batcher times it (the service's
    ``compute_ms``), ``queue_us`` arrival to run start."""
    import cupy as cp

    from reward_service.batcher import CRITICAL, Batcher
    from reward_service.session import ModelSession

    session = ModelSession(model, cfg, warm=False)
    batcher = Batcher(session.run_batch, buckets=session.buckets, max_batch_size=session.max_batch_size,
                      name=model.name, warm_up=session.warm_up)
    rows = []
    try:
        rng = np.random.default_rng(1)
        for bucket in BUCKETS:
            part = bucket * 3 // 4
            wave = cp.asarray(rng.integers(0, 2, (part, 2, 6, 7)).astype(np.uint8))
            done = []

            def one():
                done.append(batcher.evaluate({"board": wave}, part, CRITICAL, None, ()))
                done[-1].result()

            wall = _timed(one)
            rows.append(dict(variant="served_batcher", bucket=bucket, wave_rows=part, wall_us=_p(wall, 50),
                             compute_us=_p([r.compute_ms * 1e3 for r in done], 50),
                             queue_us=_p([r.queue_ms * 1e3 for r in done], 50), repeats=REPEATS))
            common.progress(rows[-1])
    finally:
        batcher.close()
    return rows


def _export(conn, nbytes: int) -> None:
    """In a child process: a CUDA allocation of ``nbytes`` random bytes, its IPC
    handle sent over ``conn``; kept until ``conn`` says stop (or closes)."""
    import cupy as cp

    memory = cp.cuda.Memory(nbytes)  # its own cudaMalloc: a handle opens a whole allocation
    view = cp.ndarray((nbytes,), np.uint8, cp.cuda.MemoryPointer(memory, 0))
    view[:] = cp.random.randint(0, 2, nbytes, dtype=np.uint8)
    cp.cuda.runtime.deviceSynchronize()
    conn.send(cp.cuda.runtime.ipcGetMemHandle(memory.ptr))
    try:
        conn.recv()
    except EOFError:
        pass


def ipc_rows(model, cfg) -> list[dict]:
    """The served variant's runner fed from another process's CUDA memory
    (opened from its IPC handle, as the leaf channel's input region) against
    the same wave in this process's memory, alternating: ``run_local_us`` /
    ``run_ipc_us`` (the whole batch, 3/4-full waves), ``copy_local_us`` /
    ``copy_ipc_us`` (the copy into the bound buffer, with its synchronisation)."""
    import multiprocessing

    import cupy as cp

    from reward_service.batcher import CRITICAL, Batch, Request
    from reward_service.session import ModelSession

    session = ModelSession(model, cfg)
    runner = session._critical  # noqa: SLF001 - the lane's runner, measured alone
    dev = runner.device
    row_bytes = 2 * 6 * 7
    nbytes = BUCKETS[-1] * row_bytes
    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    child = spawn.Process(target=_export, args=(there, nbytes), daemon=True)
    child.start()
    rows = []
    ptr = None
    try:
        handle = here.recv()
        ptr = cp.cuda.runtime.ipcOpenMemHandle(handle)
        memory = cp.cuda.UnownedMemory(ptr, nbytes, child, device_id=cp.cuda.runtime.getDevice())
        remote = cp.ndarray((BUCKETS[-1], 2, 6, 7), np.uint8, cp.cuda.MemoryPointer(memory, 0))
        for bucket in BUCKETS:
            part = bucket * 3 // 4
            local = remote[:part].copy()
            slot = runner._slots[bucket]  # noqa: SLF001

            def batch_of(wave, part=part, bucket=bucket):
                return Batch([Request({"board": wave}, part, CRITICAL)], part, bucket, [0], CRITICAL)

            from_here, from_there = batch_of(local), batch_of(remote[:part])
            run_local, run_ipc = [], []
            for _ in range(REPEATS):
                run_local += _timed(lambda: runner.run(from_here), repeats=1)
                run_ipc += _timed(lambda: runner.run(from_there), repeats=1)
            copy_local = _timed(lambda: (dev.copy_device(slot.dev_in["board"], 0, local), dev.synchronize()))
            copy_ipc = _timed(lambda: (dev.copy_device(slot.dev_in["board"], 0, remote[:part]), dev.synchronize()))
            rows.append(dict(variant="ipc_source", bucket=bucket, wave_rows=part, run_local_us=_p(run_local, 50),
                             run_ipc_us=_p(run_ipc, 50), copy_local_us=_p(copy_local, 50),
                             copy_ipc_us=_p(copy_ipc, 50), repeats=REPEATS))
            common.progress(rows[-1])
    finally:
        if ptr is not None:
            cp.cuda.runtime.deviceSynchronize()
            cp.cuda.runtime.ipcCloseMemHandle(ptr)
        here.send("stop")
        child.join(30)
    return rows


def hop_row(label: str) -> dict:
    from reward_service.batcher import CRITICAL, Batcher

    batcher = Batcher(lambda batch: {"v": np.zeros((batch.bucket, 1), np.float32)}, buckets=(32,), name="hop")
    feeds = {"x": np.zeros((32, 1), np.float32)}
    try:
        hops = _timed(lambda: batcher.evaluate(feeds, 32, CRITICAL, None, ()).result(), repeats=5 * REPEATS)
    finally:
        batcher.close()
    return dict(variant="batcher_hop", threads=label, hop_us=_p(hops, 50), hop_us_p99=_p(hops, 99),
                repeats=5 * REPEATS)


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--variants", default=None,
                        help="comma list of the variants to run (default: all, served_batcher included)")
    args = parser.parse_args()
    chosen = set(args.variants.split(",")) if args.variants else None
    cfg = load_config().reward
    cfg = replace(cfg, stream_priorities=(cfg.stream_priorities[0],), execution_provider="cuda")
    model = next(m for m in cfg.models if m.name == "connect4_value")
    rows = []
    if args.quick or not common.gpu_info()[0]:
        common.note("no GPU here: only the batcher rows")
    else:
        for name, m, c in variants(model, cfg):
            if chosen is None or name in chosen:
                rows += common.attempt(f"variant {name}", runner_rows, name, m, replace(c, models=(m,))) or []
        served = replace(model, batch_buckets=BUCKETS)
        if chosen is None or "served_batcher" in chosen:
            rows += common.attempt("served_batcher", served_rows, served, replace(cfg, models=(served,))) or []
        if chosen is None or "ipc_source" in chosen:
            rows += common.attempt("ipc_source", ipc_rows, served, replace(cfg, models=(served,))) or []
    rows.append(hop_row("alone"))
    idle = threading.Event()
    threads = [threading.Thread(target=idle.wait, daemon=True) for _ in range(1000)]
    for t in threads:
        t.start()
    try:
        rows.append(hop_row("1000 idle"))
    finally:
        idle.set()
    common.finish(BENCHMARK, rows, args.out, COLUMNS)


if __name__ == "__main__":
    main()
