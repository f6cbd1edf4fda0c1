"""Mixed precision at load time: an FP16 model whose last layer and outputs
stay FP32 (``precision: fp16`` in a model's config; the offline report is
``training/fp16_report.py``, ``tandem convert-fp16``).

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
"""
from __future__ import annotations

import warnings

import onnx
from onnx import TensorProto

WEIGHTED_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "Einsum"}


def with_node_names(model: onnx.ModelProto) -> onnx.ModelProto:
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

    model = with_node_names(onnx.ModelProto.FromString(model.SerializeToString()))
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
