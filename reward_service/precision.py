"""Mixed precision: an FP16 model whose last layer and outputs stay FP32, and
a report of its latency and accuracy against the FP32 model.

    tandem convert-fp16 MODEL.onnx [--out MODEL.fp16.onnx] [--report JSON]

Conversion (:func:`convert_fp16`): onnxconverter-common's
``float16.convert_float_to_float16`` with ``keep_io_types=True`` and the
model's head (:func:`head_nodes`: from each output back to and including the
last layer with weights) in ``node_block_list``, then two repairs that the
converter leaves to its caller (checked by :func:`check_fp16_head`):

* a blocked last node is still followed by a Cast to FP16 (and the graph
  output declared FP16), so the FP32 result would be rounded to FP16 on its
  way out: the Casts between the head and each output are removed and the
  output declared FP32 again;
* a Cast *to* FLOAT inside the body (e.g. the uint8 frame -> float
  conversion at the input) keeps ``to = FLOAT`` although the converter
  declares its output FP16, which ONNX Runtime refuses: such Casts are made
  to cast to FLOAT16.

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
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

WEIGHTED_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "Einsum"}


def _named(model: onnx.ModelProto) -> onnx.ModelProto:
    """Gives every unnamed node a unique name (the block list names nodes)."""
    taken = {n.name for n in model.graph.node if n.name}
    for i, n in enumerate(model.graph.node):
        if not n.name:
            name = f"{n.op_type}_{i}"
            while name in taken:
                name += "_"
            n.name = name
            taken.add(name)
    return model


def head_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes of the last layer: walking back from each graph
    output through single-input nodes (activations, Flatten, ...) up to and
    including the first node with weights (Conv, Gemm, MatMul, ...).

    Raises:
        ValueError: an output with no weighted layer behind it.
    """
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    weights = {i.name for i in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output
    }
    head: list[str] = []
    for out in graph.output:
        node = producer.get(out.name)
        while node is not None:
            if node.name not in head:
                head.append(node.name)
            data_inputs = [i for i in node.input if i and i not in weights]
            if node.op_type in WEIGHTED_OPS and len(data_inputs) < len(node.input):
                break
            if len(data_inputs) != 1:
                raise ValueError(f"output {out.name!r}: no single-input path back to a weighted layer at {node.name!r}")
            node = producer.get(data_inputs[0])
        else:
            raise ValueError(f"output {out.name!r}: no weighted layer found behind it")
    return head


def convert_fp16(model: onnx.ModelProto, block: list[str] | None = None) -> onnx.ModelProto:
    """An FP16 copy of ``model`` whose head (``block``, default
    :func:`head_nodes`) and outputs stay FP32; inputs keep their types.

    Raises:
        ImportError: onnxconverter-common is not installed.
        ValueError: the result fails :func:`check_fp16_head`.
    """
    from onnxconverter_common import float16

    model = _named(onnx.ModelProto.FromString(model.SerializeToString()))
    block = list(block) if block is not None else head_nodes(model)
    float_outputs = {o.name for o in model.graph.output if o.type.tensor_type.elem_type == TensorProto.FLOAT}
    with warnings.catch_warnings():
        # "values truncated to the FP16 range": expected for tiny weights; the report measures the effect
        warnings.simplefilter("ignore", UserWarning)
        converted = float16.convert_float_to_float16(model, keep_io_types=True, node_block_list=block)
    _fix_body_casts(converted, set(block))
    _fix_output_casts(converted, set(block), float_outputs)
    check_fp16_head(converted, block, float_outputs)
    return converted


def _fix_body_casts(model: onnx.ModelProto, block: set[str]) -> None:
    outputs = {o.name for o in model.graph.output}
    for n in model.graph.node:
        if n.op_type != "Cast" or n.name in block or any(o in outputs for o in n.output):
            continue
        if "_input_cast" in n.name or "_output_cast" in n.name:
            continue  # the converter's own casts are right
        for a in n.attribute:
            if a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.FLOAT16


def _fix_output_casts(model: onnx.ModelProto, block: set[str], float_outputs: set[str]) -> None:
    """Removes Cast chains between a blocked (FP32) node and an FP32 graph output."""
    graph = model.graph
    for out in graph.output:
        if out.name not in float_outputs:
            continue
        producer = {o: n for n in graph.node for o in n.output}
        chain, node = [], producer.get(out.name)
        while node is not None and node.op_type == "Cast" and node.name not in block:
            chain.append(node)
            node = producer.get(node.input[0])
        if not chain or node is None or node.name not in block:
            continue
        inner = chain[-1].input[0]  # the blocked node's FP32 result
        consumers = [n for n in graph.node if inner in n.input and n not in chain]
        for n in chain:
            graph.node.remove(n)
        for i, o in enumerate(node.output):
            if o == inner:
                node.output[i] = out.name
        for n in consumers:
            for i, x in enumerate(n.input):
                if x == inner:
                    n.input[i] = out.name
        stale = [v for v in graph.value_info if v.name in {inner, out.name}]
        for v in stale:
            graph.value_info.remove(v)
        out.type.tensor_type.elem_type = TensorProto.FLOAT


def check_fp16_head(model: onnx.ModelProto, block: list[str], float_outputs: set[str]) -> None:
    """Checks that each FP32 output is declared FP32 and produced directly by
    a blocked node, that the blocked nodes' weights are FP32, and that the
    body holds FP16 weights.

    Raises:
        ValueError: naming the output or node that breaks the rule.
    """
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    inits = {i.name: i for i in graph.initializer}
    for out in graph.output:
        if out.name not in float_outputs:
            continue
        if out.type.tensor_type.elem_type != TensorProto.FLOAT:
            raise ValueError(f"output {out.name!r} is not FP32")
        node = producer.get(out.name)
        if node is None or node.name not in block:
            raise ValueError(f"output {out.name!r} is produced by {node.name if node else None!r}, not by the FP32 head")
    for n in graph.node:
        if n.name in block:
            for i in n.input:
                if i in inits and inits[i].data_type == TensorProto.FLOAT16:
                    raise ValueError(f"head node {n.name!r} has an FP16 weight {i!r}")
    if not any(i.data_type == TensorProto.FLOAT16 for i in graph.initializer):
        raise ValueError("no FP16 weights: the body was not converted")


# -- the report ----------------------------------------------------------------


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
        from reward_service.training.train_frame_reward import heldout_sets, render_heldout

        chunks, targets = [], []
        for set_name, (moves, t) in heldout_sets(seed).items():
            moves, t = moves[:limit], t[:limit]
            for i in range(0, len(moves), 256):
                chunks.append(render_heldout(moves, seed, i, min(i + 256, len(moves))))
            targets.append(t)
        return name, chunks, np.concatenate(targets), "frame model held-out frames (all held-out sets)"
    if name == "board" and elem == TensorProto.UINT8 and shape[1:] == [2, 6, 7]:
        from reward_service.training.connect4_data import load_sources
        from reward_service.training.train_connect4_value import split_sources

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

    providers = providers or ort.get_available_providers()
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
    print(f"wrote {dst} ({dst.stat().st_size} bytes); FP32 head: {', '.join(head_nodes(_named(fp32)))}")
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
              f"({100 * r['latency_reduction'][b]:.0f} % less)")
    if args.report:
        Path(args.report).write_text(json.dumps(r, indent=2) + "\n")
    return 0
