"""The FP16 report: an FP16 model with an FP32 head (made by
:func:`reward_service.precision.convert_fp16`) against the FP32 model, on the
same held-out data, for latency and accuracy.

    tandem convert-fp16 MODEL.onnx [--out MODEL.fp16.onnx] [--report JSON]

The report (:func:`report`) runs both models on the same held-out data: the
frame model's held-out frames (input ``frame`` uint8 [N, 224, 224, 3]), the
value network's held-out boards (input ``board`` uint8 [N, 2, 6, 7]), or, for
any other model, seeded random inputs (agreement only, no labels). Accuracy
is the outcome class of ``value`` (v >= 1/3 win, v <= -1/3 loss, else draw)
against the solver's.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from reward_service.precision import convert_fp16, head_nodes, with_node_names
from tandem.gpu import cuda_device_count


def _spec(model: onnx.ModelProto):
    (inp,) = [i for i in model.graph.input if i.name not in {x.name for x in model.graph.initializer}][:1]
    t = inp.type.tensor_type
    return inp.name, t.elem_type, [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]


def heldout_data(model: onnx.ModelProto, limit: int | None = None, seed: int = 1995):
    """``(input name, chunks, targets or None, description)`` where ``chunks``
    is a list of input arrays and ``targets`` float32 [N] solver values.

    Frame models get the frame model's held-out frames, board models the
    value network's held-out boards (both: all held-out sets, the first
    ``limit`` positions of each when given); others seeded random inputs."""
    name, elem, shape = _spec(model)
    if name == "frame" and elem == TensorProto.UINT8 and shape[1:] == [224, 224, 3]:
        from training.train_frame_reward import heldout_sets, render_heldout

        chunks, targets = [], []
        for set_name, (moves, t) in heldout_sets(seed).items():
            moves, t = moves[:limit], t[:limit]
            for i in range(0, len(moves), 256):
                chunks.append(render_heldout(moves, seed, i, min(i + 256, len(moves))))
            targets.append(t)
        return name, chunks, np.concatenate(targets), "frame model held-out frames (all held-out sets)"
    if name == "board" and elem == TensorProto.UINT8 and shape[1:] == [2, 6, 7]:
        from training.connect4_data import load_sources
        from training.train_connect4_value import split_sources

        _, _, held = split_sources(load_sources(), seed)
        boards = np.concatenate([s.boards[:limit] for s in held.values()])
        targets = np.concatenate([s.value_target[:limit] for s in held.values()])
        return name, [boards[i : i + 1024] for i in range(0, len(boards), 1024)], targets, "value network held-out boards"
    rng = np.random.default_rng(seed)
    dims = [8 if d <= 0 else d for d in shape]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    scale = 255 if dtype.kind in "ui" else 1
    chunks = [(rng.random(dims) * scale).astype(dtype) for _ in range(8)]
    return name, chunks, None, "seeded random inputs (no labels)"


def _outcome(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v).reshape(-1)
    return np.where(v >= 1 / 3, 1, np.where(v <= -1 / 3, -1, 0))


def _latency(session, name: str, sample: np.ndarray, batch: int, repeats: int) -> float:
    x = np.ascontiguousarray(np.resize(sample, (batch, *sample.shape[1:])))
    for _ in range(3):
        session.run(None, {name: x})
    ms = []
    for _ in range(repeats):
        t = time.perf_counter()
        session.run(None, {name: x})
        ms.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ms))


def report(fp32: onnx.ModelProto, fp16: onnx.ModelProto, *, providers=None, batches=(1, 64), repeats: int = 20,
           limit: int | None = None) -> dict:
    """Runs both models on the same held-out data and times them.

    Returns ``{"data", "positions", "provider", "accuracy_fp32",
    "accuracy_fp16", "accuracy_loss", "outcome_agreement",
    "max_abs_diff", "latency_ms_p50": {"fp32": {batch: ms}, "fp16": {...}},
    "latency_reduction"}`` (accuracies as fractions; None without labels).
    ``value`` is the first output.
    """
    import onnxruntime as ort

    if providers is None:  # the CUDA provider only where the driver sees a GPU (tandem/gpu.py)
        providers = ort.get_available_providers() if cuda_device_count() else ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in providers and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    s32 = ort.InferenceSession(fp32.SerializeToString(), providers=providers)
    s16 = ort.InferenceSession(fp16.SerializeToString(), providers=providers)
    name, chunks, targets, data = heldout_data(fp32, limit)
    v32 = np.concatenate([s32.run(None, {name: c})[0].reshape(len(c), -1)[:, 0] for c in chunks])
    v16 = np.concatenate([s16.run(None, {name: c})[0].reshape(len(c), -1)[:, 0] for c in chunks])
    out = {
        "data": data,
        "positions": int(len(v32)),
        "provider": s16.get_providers()[0],
        "outcome_agreement": float((_outcome(v32) == _outcome(v16)).mean()),
        "max_abs_diff": float(np.abs(v32.astype(np.float64) - v16).max()),
        "accuracy_fp32": None,
        "accuracy_fp16": None,
        "accuracy_loss": None,
    }
    if targets is not None:
        t = np.sign(targets).astype(int)
        out["accuracy_fp32"] = float((_outcome(v32) == t).mean())
        out["accuracy_fp16"] = float((_outcome(v16) == t).mean())
        out["accuracy_loss"] = out["accuracy_fp32"] - out["accuracy_fp16"]
    lat = {"fp32": {}, "fp16": {}}
    for b in batches:
        lat["fp32"][b] = _latency(s32, name, chunks[0], b, repeats)
        lat["fp16"][b] = _latency(s16, name, chunks[0], b, repeats)
    out["latency_ms_p50"] = lat
    out["latency_reduction"] = {b: 1 - lat["fp16"][b] / lat["fp32"][b] for b in batches}
    return out


def main(args) -> int:
    """``tandem convert-fp16``: writes the FP16 model and prints the report."""
    src = Path(args.model)
    dst = Path(args.out) if args.out else src.with_name(src.stem + ".fp16.onnx")
    fp32 = onnx.load(str(src))
    fp16 = convert_fp16(fp32)
    onnx.save(fp16, str(dst))
    print(f"wrote {dst} ({dst.stat().st_size} bytes); FP32 head: {', '.join(head_nodes(with_node_names(fp32)))}")
    if args.no_report:
        return 0
    r = report(fp32, fp16, limit=args.limit, repeats=args.repeats)
    pct = lambda x: "—" if x is None else f"{100 * x:.2f} %"  # noqa: E731
    print(f"data: {r['data']} ({r['positions']} positions), provider {r['provider']}")
    print(f"accuracy fp32 {pct(r['accuracy_fp32'])}  fp16 {pct(r['accuracy_fp16'])}  "
          f"loss {pct(r['accuracy_loss'])}  outcome agreement {pct(r['outcome_agreement'])}  "
          f"max |diff| {r['max_abs_diff']:.2e}")
    for b in r["latency_ms_p50"]["fp32"]:
        print(f"batch {b:4d}: fp32 {r['latency_ms_p50']['fp32'][b]:.3f} ms  fp16 {r['latency_ms_p50']['fp16'][b]:.3f} ms  "
              f"(FP16 {abs(100 * r['latency_reduction'][b]):.0f} % {'faster' if r['latency_reduction'][b] >= 0 else 'slower'})")
    if args.report:
        Path(args.report).write_text(json.dumps(r, indent=2) + "\n")
    return 0
