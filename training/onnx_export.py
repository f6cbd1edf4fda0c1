"""ONNX export shared by the training scripts: export with a dynamic batch,
attach metadata, check the file, and compare ONNX Runtime with torch."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

OPSET = 17


def export_onnx(model, path: Path, sample: np.ndarray, metadata: dict, input_name: str,
                output_names: list[str]) -> float:
    """Exports ``model`` (opset 17, batch axis 0 dynamic on every tensor),
    stores ``metadata`` in the file, runs ``onnx.checker`` and compares ONNX
    Runtime (CPU) with torch on ``sample`` (a uint8 batch shaped like the input).

    Returns the largest absolute difference over all outputs.

    Raises:
        SystemExit: the two disagree by more than 1e-4.
    """
    import onnx
    import onnxruntime as ort
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    dummy = torch.zeros((1, *sample.shape[1:]), dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        # dynamo=False: the TorchScript exporter needs no onnxscript dependency
        torch.onnx.export(model, (dummy,), str(path), dynamo=False, opset_version=OPSET,
                          input_names=[input_name], output_names=output_names,
                          dynamic_axes={n: {0: "N"} for n in [input_name, *output_names]})
    proto = onnx.load(str(path))
    for k, v in metadata.items():
        proto.metadata_props.add(key=k, value=v)
    onnx.save(proto, str(path))
    onnx.checker.check_model(str(path), full_check=True)

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ort_outputs = sess.run(output_names, {input_name: sample})
    with torch.no_grad():
        torch_outputs = model(torch.from_numpy(sample))
    if isinstance(torch_outputs, torch.Tensor):
        torch_outputs = (torch_outputs,)
    diff = max(float(np.abs(o - t.numpy()).max()) for o, t in zip(ort_outputs, torch_outputs))
    if diff > 1e-4:
        raise SystemExit(f"ONNX Runtime and torch disagree by {diff}")
    return diff
