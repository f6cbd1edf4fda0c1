"""value_model_run: where one run of the value model goes, on its critical runner.

A search wave is one run of ``connect4_value`` (bench/neural_search.py); this
benchmark times that run alone, in variants of how the reward service builds
it, in one process and one run (so the variants compare as ratios):
``precision`` (fp32 | fp16: an FP16 body with an FP32 head) x ``layout``
(nchw | nhwc: ONNX Runtime's ``prefer_nhwc``) x ``cuda_graph`` (on | off), at
each batch of ``--batches``. Per variant and batch, p50 of ``--repeats`` runs
of the bound bucket (inputs already on the device, as a leaf channel's wave):

* ``host_us``: the ``run_with_iobinding`` call's wall time (what the calling
  thread spends: ONNX Runtime's per-run work, the graph launch);
* ``gpu_us``: CUDA events on the runner's stream around the call (the device
  time of the run: kernels and the gaps between them);
* ``wall_us``: the call plus the stream synchronisation (what a wave waits).

``kernels`` is the number of graph nodes ONNX Runtime runs on the CUDA
execution provider after its optimisations (from its profile of one run per
variant: every ``Node`` event of one run); ``top_ops`` the three op types
with the most device time there.

Command: ``python3 -m bench.value_model_run`` (GPU only: on the CPU it writes
nothing and says so).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import tempfile
import time

import numpy as np

from bench import common
from tandem.config import load_config

BENCHMARK = "value_model_run"
COLUMNS = ("precision", "layout", "cuda_graph", "batch", "host_us", "gpu_us", "wall_us", "kernels", "top_ops")


def _profile(model_cfg, reward_cfg, bucket: int) -> tuple[int | None, str]:
    """ONNX Runtime's profile of one run at ``bucket``: (nodes run, top op types by time)."""
    import onnxruntime as ort

    from reward_service import session as sess

    path = sess.resolve_path(model_cfg.path)
    data = path.read_bytes()
    if model_cfg.precision == "fp16":
        data = sess._to_fp16(data, model_cfg.name)
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "prof")
    cuda = {"cudnn_conv_algo_search": reward_cfg.cudnn_conv_algo_search}
    if model_cfg.prefer_nhwc:
        cuda["prefer_nhwc"] = "1"
    s = ort.InferenceSession(data, sess_options=opts, providers=[("CUDAExecutionProvider", cuda)])
    feed = {s.get_inputs()[0].name: np.random.default_rng(0).integers(0, 2, (bucket, 2, 6, 7), dtype=np.uint8)}
    for _ in range(3):
        s.run(None, feed)
    with open(s.end_profiling()) as fh:
        events = json.load(fh)
    # The last run's node events: those after the last "model_run" start.
    runs = [e for e in events if e.get("name") == "model_run"]
    start = runs[-1]["ts"] if runs else 0
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("ts", 0) >= start and e["name"].endswith("_kernel_time")]
    by_op = collections.Counter()
    for e in nodes:
        by_op[e.get("args", {}).get("op_name", "?")] += e.get("dur", 0)
    top = ", ".join(f"{op} {us} us" for op, us in by_op.most_common(3))
    return len(nodes), top


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--batches", type=common.int_list, default=[1, 32, 256, 4096])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    from tandem.gpu import cuda_device_count, cupy_module

    cupy = cupy_module()
    if cupy is None or cuda_device_count() == 0:
        common.note("value_model_run: no GPU (CuPy and a CUDA device needed); nothing measured")
        return
    from reward_service.batcher import CRITICAL
    from reward_service.session import ModelSession

    cfg = load_config()
    base = next(m for m in cfg.reward.models if m.name == "connect4_value")
    rows = []
    for precision in ("fp32", "fp16"):
        for nhwc in (False, True):
            for graph in (True, False):
                model = dataclasses.replace(base, precision=precision, prefer_nhwc=nhwc, cuda_graph=graph,
                                            batch_buckets=tuple(args.batches))
                s = ModelSession(model, cfg.reward, pool_bytes=0)
                runner = s.lane_runners(CRITICAL)[0]
                stream = runner.device.stream
                kernels, top = common.attempt("profile", _profile, model, cfg.reward, args.batches[-1]) or (None, "")
                for bucket in args.batches:
                    slot = runner._slots[bucket]
                    for d in slot.dev_in.values():  # random boards, not zeros
                        d[...] = cupy.asarray(np.random.default_rng(bucket).integers(0, 2, d.shape, dtype=d.dtype))
                    host, gpu, wall = [], [], []
                    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                    for i in range(args.repeats + 10):
                        e0.record(stream)
                        t0 = time.perf_counter()
                        slot.session.run_with_iobinding(slot.binding, slot.run_options)
                        t1 = time.perf_counter()
                        e1.record(stream)
                        stream.synchronize()
                        t2 = time.perf_counter()
                        if i >= 10:
                            host.append((t1 - t0) * 1e6)
                            wall.append((t2 - t0) * 1e6)
                            gpu.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3)
                    row = dict(precision=precision, layout="nhwc" if nhwc else "nchw",
                               cuda_graph="on" if runner.graphs else "off", batch=bucket,
                               host_us=float(np.median(host)), gpu_us=float(np.median(gpu)),
                               wall_us=float(np.median(wall)), kernels=kernels, top_ops=top,
                               repeats=args.repeats)
                    common.progress(row)
                    rows.append(row)
                del s, runner, slot
    common.finish(BENCHMARK, rows, args.out, COLUMNS)


if __name__ == "__main__":
    main()
