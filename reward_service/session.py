"""One ONNX Runtime session per configured model, and the checks of what a
client sends against the model's declared inputs."""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from tandem import tensors
from tandem.gpu import cuda_device_count
from tandem.config import ModelConfig, RewardConfig, resolve_path
from tandem.v1 import reward_pb2

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


class InputError(ValueError):
    """A request's tensors do not fit the model; the message names the tensor and field."""


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: int  # tandem.v1.DataType
    shape: tuple[int, ...]  # -1 for dynamic dimensions (the batch, at least)

    def to_proto(self) -> reward_pb2.TensorSpec:
        return reward_pb2.TensorSpec(name=self.name, dtype=self.dtype, shape=self.shape)


def _specs(nodes) -> tuple[Spec, ...]:
    return tuple(
        Spec(n.name, tensors.ort_dtype(n.type), tuple(d if isinstance(d, int) else -1 for d in n.shape))
        for n in nodes
    )


def _providers(choice: str, pool_bytes: int) -> list:
    cuda_options = {"arena_extend_strategy": "kSameAsRequested"}
    if pool_bytes:
        cuda_options["gpu_mem_limit"] = pool_bytes
    if choice == "cpu" or CUDA not in ort.get_available_providers():
        return [CPU]
    if choice == "auto" and cuda_device_count() == 0:
        return [CPU]  # no GPU: skip ONNX Runtime's failed attempt to load CUDA
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # CUDA and cuDNN from their pip packages, where installed
    return [(CUDA, cuda_options), CPU]


class ModelSession:
    """An ONNX Runtime session for one model.

    ``execution_provider`` is the provider the session really runs on: with
    ``auto`` the CUDA execution provider is tried first, and ONNX Runtime falls
    back to the CPU one where CUDA cannot load (no GPU, no driver).

    Raises (constructor):
        RuntimeError: ``cuda`` was required but the session did not get it, or
            the model file cannot be loaded.
    """

    def __init__(self, model: ModelConfig, cfg: RewardConfig):
        path = resolve_path(model.path)
        self.name = model.name
        self.description = model.description
        self.max_batch_size = model.max_batch_size
        self.version = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        options = ort.SessionOptions()
        if cfg.intra_op_threads:
            options.intra_op_num_threads = cfg.intra_op_threads
        options.log_severity_level = 3  # the CUDA fallback is reported below, once
        self.session = ort.InferenceSession(
            str(path), sess_options=options, providers=_providers(cfg.execution_provider, cfg.memory_pool_bytes)
        )
        self.execution_provider = self.session.get_providers()[0]
        if cfg.execution_provider == "cuda" and self.execution_provider != CUDA:
            raise RuntimeError(f"model {model.name}: execution_provider is 'cuda' but ONNX Runtime could not use it")
        self.inputs = _specs(self.session.get_inputs())
        self.outputs = _specs(self.session.get_outputs())
        self._nonfinite_reject = cfg.nonfinite_inputs == "reject"
        self._warm_up()
        log.info("model %s (%s) on %s", model.name, path, self.execution_provider)

    def _warm_up(self) -> None:
        """One run at batch 1 so the first request pays no lazy initialisation."""
        feeds = {
            s.name: np.zeros([1 if d == -1 else d for d in s.shape], tensors.numpy_dtype(s.dtype))
            for s in self.inputs
        }
        self.session.run(None, feeds)

    def decode(self, inputs: list[reward_pb2.Tensor]) -> dict[str, np.ndarray]:
        """Checks tensors against the model's inputs and decodes them.

        Raises:
            InputError: missing, unknown or repeated input; wrong dtype, rank,
                dimension or byte length; batch empty, too large or unequal
                across inputs; NaN/Inf where rejected.
        """
        by_name: dict[str, reward_pb2.Tensor] = {}
        for t in inputs:
            if t.name in by_name:
                raise InputError(f"inputs: tensor {t.name!r} given twice")
            by_name[t.name] = t
        expected = {s.name for s in self.inputs}
        unknown = sorted(set(by_name) - expected)
        if unknown:
            raise InputError(f"inputs: model {self.name!r} has no input {unknown[0]!r} (inputs: {sorted(expected)})")
        feeds, batch = {}, None
        for spec in self.inputs:
            t = by_name.get(spec.name)
            if t is None:
                raise InputError(f"inputs: missing input {spec.name!r}")
            if t.dtype != spec.dtype:
                raise InputError(
                    f"inputs[{spec.name!r}].dtype: expected {tensors.dtype_name(spec.dtype)}, "
                    f"got {tensors.dtype_name(t.dtype)}"
                )
            shape = tuple(t.shape)
            if len(shape) != len(spec.shape) or any(e != -1 and e != g for e, g in zip(spec.shape, shape)):
                raise InputError(f"inputs[{spec.name!r}].shape: expected {list(spec.shape)} (-1: any), got {list(shape)}")
            if shape[0] == 0:
                raise InputError(f"inputs[{spec.name!r}].shape: empty batch")
            if shape[0] > self.max_batch_size:
                raise InputError(
                    f"inputs[{spec.name!r}].shape: batch {shape[0]} exceeds max_batch_size {self.max_batch_size}"
                )
            if batch is not None and shape[0] != batch:
                raise InputError(f"inputs[{spec.name!r}].shape: batch {shape[0]} differs from the other inputs' {batch}")
            batch = shape[0]
            try:
                array = tensors.from_proto(t)
            except ValueError as exc:
                raise InputError(f"inputs[{spec.name!r}].data: {exc}") from None
            if self._nonfinite_reject and array.dtype.kind == "f" and not np.isfinite(array).all():
                raise InputError(f"inputs[{spec.name!r}].data: holds NaN or Inf (nonfinite_inputs: reject)")
            feeds[spec.name] = array
        return feeds

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> tuple[dict[str, np.ndarray], float]:
        """Runs the model. Returns the outputs by name and the run time in ms.

        Raises:
            InputError: an unknown output name.
        """
        known = [s.name for s in self.outputs]
        names = list(output_names) if output_names else known
        for n in names:
            if n not in known:
                raise InputError(f"output_names: model {self.name!r} has no output {n!r} (outputs: {known})")
        start = time.perf_counter()
        results = self.session.run(names, feeds)
        return dict(zip(names, results)), (time.perf_counter() - start) * 1e3
