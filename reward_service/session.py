"""ONNX Runtime session(s) for one model, and the checks of what a client
sends against the model's declared inputs.

A model is served by two lanes (reward_service/batcher.py), each with its own
worker thread and its own runner(s) -- a runner being a set of sessions and
the buffers bound to them:

* the **critical** lane (frames, a search's leaves): one runner of its own,
  on the most urgent (greatest) CUDA stream priority the model holds
  (``min(reward.stream_priorities)``), whatever the scheduler assigns;
* the **bulk** lane: one runner per CUDA stream priority the service may be
  assigned (``reward.stream_priorities``); the scheduler's assignment picks
  which one runs (:meth:`ModelSession.set_stream_priority`,
  :func:`tandem.stream_priority.nearest_allowed`).

So a model holds ``len(stream_priorities) + 1`` runners on the GPU: when the
bulk lane is assigned the greatest stream priority it runs on its own runner
at that priority, never on the critical lane's (see :class:`ModelSession`
for who owns what, and the memory this costs).

On a GPU (CUDA execution provider and CuPy) each runner has:

* one ONNX Runtime session per batch bucket (``batch_buckets``), each bound
  to the runner's CuPy stream (of its stream priority) through
  ``user_compute_stream``;
* per bucket: preallocated device input and output buffers bound once with
  IO binding, and pinned host staging buffers: request bytes are copied once
  into pinned memory, uploaded asynchronously on the runner's stream, and the
  outputs come back the same way, with one stream synchronisation per batch;
* with ``cuda_graph``, one CUDA graph per bucket (``enable_cuda_graph``, run
  option ``gpu_graph_id`` = the bucket's index), captured at construction and
  replayed afterwards; a batch larger than the largest bucket runs as
  bucket-sized chunks, so every run replays a captured graph;
* ``gpu_mem_limit`` with ``arena_extend_strategy: kSameAsRequested``, so the
  sessions live in the configured memory pool, and ``cudnn_conv_algo_search``
  as configured;
* warm-up at start, on the thread of the lane that owns the runner: every
  bucket runs three times (cuDNN algorithm search, arena growth, graph
  capture), so the first request pays none of it.

On the CPU (no GPU, no CUDA build, or ``execution_provider: cpu``) the model
runs through ``InferenceSession.run`` on host arrays: no device buffers, no
pinned staging, no graphs, no padding to buckets, one session, which both
lanes' threads share (``InferenceSession.run`` is thread-safe and that
runner keeps no buffers). The same holds with the CUDA provider but without
CuPy. Each model says which features are off and why, and which stream
priority each lane runs on, in :attr:`ModelSession.runtime` (served in
``ModelMetadata``) and in the log.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnxruntime as ort
from tandem.v1 import reward_pb2

from reward_service.batcher import BULK, CRITICAL, LANES, Batch, Request, bucket_for
from tandem import nvtx, tensors, timeline
from tandem.config import ModelConfig, RewardConfig, resolve_path
from tandem.deadline import Deadline, earliest
from tandem.errors import quote
from tandem.gpu import cuda_device_count, cupy_module
from tandem.stream_priority import nearest_allowed

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
WARM_UP_RUNS = 3  # per bucket: a regular run (allocations), the capture, one replay
CPU_WARM_ROWS = 16  # the CPU path warms every batch size up to this (a frame's critical requests: 1-16 images)


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


def _use_cuda(choice: str) -> bool:
    """Whether to try the CUDA execution provider for ``execution_provider: choice``."""
    if choice == "cpu" or CUDA not in ort.get_available_providers():
        return False
    if choice == "auto" and cuda_device_count() == 0:
        return False  # no GPU: skip ONNX Runtime's failed attempt to load CUDA
    return True


# -- memory on one side of the binding -------------------------------------------


def _row_bytes(array) -> int:
    """Bytes of one row (first-axis element) of a C-contiguous ``array``."""
    return array.dtype.itemsize * math.prod(array.shape[1:])


class _CupyDevice:
    """Device buffers, pinned host staging and one CuPy stream of a given CUDA stream priority."""

    ort_device = "cuda"

    def __init__(self, cupy, stream_priority: int):
        import cupyx

        self._cp, self._cupyx = cupy, cupyx
        self.stream_priority = stream_priority
        self.stream = cupy.cuda.Stream(non_blocking=True, priority=stream_priority)

    @property
    def stream_handle(self) -> str:
        return str(self.stream.ptr)

    def device_zeros(self, shape, dtype):
        with self.stream:
            return self._cp.zeros(shape, dtype)

    def host_empty(self, shape, dtype) -> np.ndarray:
        return self._cupyx.empty_pinned(shape, dtype)

    @staticmethod
    def ptr(array) -> int:
        return array.data.ptr

    def upload(self, dev, host: np.ndarray, rows: int) -> None:
        dev[:rows].set(host[:rows], stream=self.stream)

    def _copy(self, dst, dst_row: int, src, src_row: int, rows: int) -> None:
        """Rows ``src_row:src_row + rows`` of ``src`` into rows ``dst_row:`` of
        ``dst`` (device arrays of one row shape and dtype), on this stream:
        one cudaMemcpyAsync from the rows' addresses where both are
        C-contiguous (a few µs of host time, against ~10 for slicing each
        CuPy array and ~20 for CuPy's element-wise copy), else CuPy's copy."""
        if dst_row + rows > len(dst) or src_row + rows > len(src):  # a raw copy past either would corrupt memory
            raise ValueError(f"copy of {rows} rows: rows {dst_row}.. of {len(dst)}, from rows {src_row}.. of {len(src)}")
        if (dst.dtype == src.dtype and dst.shape[1:] == src.shape[1:] and dst.flags.c_contiguous
                and src.flags.c_contiguous):
            # A row's bytes from its shape, not strides[0]: a one-row array is C-contiguous whatever its stride.
            runtime, row = self._cp.cuda.runtime, _row_bytes(dst)
            runtime.memcpyAsync(dst.data.ptr + dst_row * row, src.data.ptr + src_row * row, rows * row,
                                runtime.memcpyDeviceToDevice, self.stream.ptr)
        else:
            with self.stream:
                dst[dst_row : dst_row + rows] = src[src_row : src_row + rows]

    def copy_device(self, dev, start: int, src) -> None:
        """Device to device, on this stream: ``src`` (another process's CUDA
        IPC memory, already written) into rows ``start:`` of ``dev``."""
        self._copy(dev, start, src, 0, len(src))

    def copy_out(self, dst, src, start: int) -> None:
        """Device to device, on this stream: rows ``start:start + len(dst)`` of
        ``src`` (a bound output) into ``dst`` (another process's CUDA IPC memory)."""
        self._copy(dst, 0, src, start, len(dst))

    def zero(self, dev, start: int, stop: int) -> None:
        if dev.flags.c_contiguous:  # one cudaMemsetAsync: no slice, no kernel launch from Python
            row = _row_bytes(dev)
            self._cp.cuda.runtime.memsetAsync(dev.data.ptr + start * row, 0, (stop - start) * row, self.stream.ptr)
        else:
            with self.stream:
                dev[start:stop].fill(0)

    def download(self, host: np.ndarray, dev, rows: int) -> None:
        try:
            dev[:rows].get(stream=self.stream, out=host[:rows], blocking=False)  # synchronised once per batch
        except TypeError:  # a CuPy without ``blocking``: a copy that waits for the stream
            dev[:rows].get(stream=self.stream, out=host[:rows])

    def synchronize(self) -> None:
        self.stream.synchronize()


class _HostDevice:
    """The same interface over plain host arrays and the CPU execution provider:
    lets the IO-binding path run (and be tested) without a GPU."""

    ort_device = "cpu"
    stream_priority = 0  # no stream: CUDA's least urgent level, as a GPU's default stream
    stream_handle = ""

    @staticmethod
    def device_zeros(shape, dtype):
        return np.zeros(shape, dtype)

    @staticmethod
    def host_empty(shape, dtype):
        return np.empty(shape, dtype)

    @staticmethod
    def ptr(array) -> int:
        return array.ctypes.data

    @staticmethod
    def upload(dev, host, rows):
        dev[:rows] = host[:rows]

    @staticmethod
    def zero(dev, start, stop):
        dev[start:stop] = 0

    @staticmethod
    def download(host, dev, rows):
        host[:rows] = dev[:rows]

    @staticmethod
    def synchronize():
        pass


# -- runners: how one batch reaches the model ------------------------------------


class _PlainRunner:
    """``InferenceSession.run`` on host arrays (the CPU path).

    Thread-safe: it keeps no buffers and ``InferenceSession.run`` may be
    called from several threads at once, so both lanes' workers share one.
    """

    stream_priority = 0  # no stream: CUDA's least urgent level, as a GPU's default stream

    def __init__(self, session: ort.InferenceSession, output_names: list[str], warm_rows: int = 1):
        self.session = session
        self._names = output_names
        self._warm_rows = warm_rows

    def run(self, batch: Batch) -> dict[str, np.ndarray]:
        return dict(zip(self._names, self.session.run(self._names, batch.feeds())))

    def warm_up(self, inputs: tuple[Spec, ...]) -> None:
        """One run at every batch size 1 .. ``warm_rows``: ONNX Runtime's CPU
        provider plans memory per input shape on the first run at it, which
        took 2-3x the next runs' time (frame_reward, bench/first_request.py),
        so the sizes a frame's critical requests take are planned before the
        first request. Both lanes share the session, and so the plans."""
        for rows in range(1, self._warm_rows + 1):
            feeds = {s.name: np.zeros([rows if d == -1 else d for d in s.shape], tensors.numpy_dtype(s.dtype))
                     for s in inputs}
            self.session.run(self._names, feeds)


@dataclass
class _Slot:
    """Everything bound for one bucket: device and pinned host buffers, the IO
    binding and the run options (graph id)."""

    host_in: dict
    dev_in: dict
    host_out: dict
    dev_out: dict
    session: ort.InferenceSession  # this bucket's own session: its input shapes never change
    binding: object
    run_options: ort.RunOptions
    dirty_rows: int = 0  # device input rows [0, dirty_rows) may hold an earlier batch's data


READY_WAIT_S = 0.005  # how long a run waits for its leaf-channel waves' ready events (s): ~20 selection kernels


def _wait_inputs(requests) -> None:
    """Waits for the batch's ``ready`` events or ready words (Request.events),
    all within one limit: READY_WAIT_S from now, and no later than the
    earliest deadline in the batch (a ready word's wait gives its client
    READY_WAIT_S from its previous outputs' end instead, up to its deadline:
    tandem/ready_word.py). A request whose inputs are not written by then
    (its client hangs, or died with its kernels queued, or gave the wave up)
    is marked ``inputs_late``: it runs with whatever its rows hold and
    nothing is written back to it (its client's output region may still be
    read by its previous wave's kernels), for its own error answer. So a
    stuck client costs the lane at most READY_WAIT_S per wave of its, and no
    other request its answer."""
    waiting = [req for req in requests if req.events is not None]
    if not waiting:
        return
    limit = earliest(Deadline.after_s(READY_WAIT_S), *(r.deadline for r in requests))
    for req in waiting:
        try:
            req.inputs_late = not req.events.ready.wait_host(limit.at)
        except Exception:  # noqa: BLE001 - CUDARuntimeError: the client's context is gone
            req.inputs_late = True


class _BoundRunner:
    """One session per bucket, IO-bound to preallocated buffers, optionally
    with a CUDA graph.

    Why a session per bucket: ONNX Runtime's CUDA convolutions keep the cuDNN
    algorithm found for the input shape they saw last, and searched again on
    every change of shape (with EXHAUSTIVE: 80-185 ms per switch on the H200,
    measured by bench/first_request.py, 2026-11-30, with one session for all
    buckets). A session that only ever sees one shape searches once, at warm-up.
    That warm-up is most of a start-up: about 0.65 s a bucket on the H200
    (connect4_value, EXHAUSTIVE), whatever the bucket's size, so 3 runners x 14
    buckets take ~30 s (bench/startup.py). One session per runner with a graph
    per bucket took longer, 0.85-1.2 s a bucket, paid again by each lane's
    warm-up (docs/decisions/0011-start-up.md).

    Not thread-safe: its buffers, IO bindings and ``dirty_rows`` belong to
    the one lane's worker thread that owns the runner (or to a benchmark with
    no batcher), one batch at a time; no other thread ever runs it.

    Attributes:
        create_s: seconds the sessions' creation and binding took (wall clock, all buckets).
        warm_up_s: seconds of each bucket's last warm-up ({bucket: s}).
        warmed_on: ``threading.get_ident()`` of the thread that last warmed it
            up (None: not yet), the one whose first request pays no warm-up.

    Args:
        make_session: returns a fresh session (on ``device``'s stream), one per bucket.
    """

    def __init__(self, make_session: Callable[[], ort.InferenceSession], device, inputs: tuple[Spec, ...],
                 outputs: tuple[Spec, ...], buckets: tuple[int, ...], graphs: bool):
        self.device, self.buckets, self.graphs = device, buckets, graphs
        self.stream_priority = device.stream_priority
        self._inputs, self._outputs = inputs, outputs
        began = time.perf_counter()
        self._slots = {b: self._bind(make_session(), b) for b in buckets}
        self.create_s = time.perf_counter() - began
        self.warm_up_s: dict[int, float] = {}
        self.warmed_on: int | None = None
        self.session = self._slots[buckets[0]].session  # one of them, for its provider options

    def _bind(self, session: ort.InferenceSession, bucket: int) -> _Slot:
        dev, binding = self.device, session.io_binding()
        host_in, dev_in, host_out, dev_out = {}, {}, {}, {}
        for spec in self._inputs:
            shape, dtype = (bucket, *spec.shape[1:]), tensors.numpy_dtype(spec.dtype)
            host_in[spec.name], dev_in[spec.name] = dev.host_empty(shape, dtype), dev.device_zeros(shape, dtype)
            binding.bind_input(spec.name, dev.ort_device, 0, dtype, list(shape), dev.ptr(dev_in[spec.name]))
        for spec in self._outputs:
            shape, dtype = (bucket, *spec.shape[1:]), tensors.numpy_dtype(spec.dtype)
            host_out[spec.name], dev_out[spec.name] = dev.host_empty(shape, dtype), dev.device_zeros(shape, dtype)
            binding.bind_output(spec.name, dev.ort_device, 0, dtype, list(shape), dev.ptr(dev_out[spec.name]))
        run_options = ort.RunOptions()
        # The output copy is queued on the same stream after the run: one sync per batch, ours.
        run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        # The default graph id, set: ONNX Runtime's Python run_with_iobinding (1.31, 1.32) asks for
        # it at every run, and an entry not set is a C++ exception turned into RuntimeError
        # (~96 µs of host time per run on the H200's host, 30 µs on a 2-core CPU; 0.2 µs set).
        run_options.add_run_config_entry("gpu_graph_id", "0")
        return _Slot(host_in, dev_in, host_out, dev_out, session, binding, run_options)

    def _run_slot(self, bucket: int, rows: int, fill: Callable[[dict], None] | None,
                  device_batch: Batch | None = None) -> dict[str, np.ndarray]:
        slot, dev = self._slots[bucket], self.device
        events = [] if device_batch is None else [r.events for r in device_batch.requests if r.events is not None]
        if device_batch is not None:  # the inputs are on the device already: no host copy at all
            _wait_inputs(device_batch.requests)  # the copies below come after the waits
            if timeline.GPU_ENABLED:
                with dev.stream:
                    timeline.gpu_mark("gpu.model_start")
            for name, d in slot.dev_in.items():
                for req, off in zip(device_batch.requests, device_batch.offsets):
                    dev.copy_device(d, off, req.feeds[name])
        else:
            fill(slot.host_in)  # rows [0, rows) of the pinned staging buffers
            for name, d in slot.dev_in.items():
                dev.upload(d, slot.host_in[name], rows)
        for d in slot.dev_in.values():
            if slot.dirty_rows > rows:  # padding rows: zeros, never an earlier request's data
                dev.zero(d, rows, slot.dirty_rows)
        slot.dirty_rows = rows
        timeline.mark("batch.copied")
        slot.session.run_with_iobinding(slot.binding, slot.run_options)
        timeline.mark("batch.launched")
        # Requests with device targets (a leaf channel's CUDA output region) get their rows
        # device to device; the host copy is made only for those without.
        targeted = [] if device_batch is None else [  # a late request gets nothing written (_wait_inputs)
            (req, off) for req, off in zip(device_batch.requests, device_batch.offsets)
            if req.targets and not req.inputs_late]
        for req, off in targeted:
            for name, target in req.targets.items():
                dev.copy_out(target, slot.dev_out[name], off)
        if device_batch is not None and timeline.GPU_ENABLED:
            with dev.stream:
                timeline.gpu_mark("gpu.model_end")
        everyone = device_batch is not None and len(targeted) == len(device_batch.requests)
        if not everyone:
            for name, d in slot.dev_out.items():
                dev.download(slot.host_out[name], d, rows)
        for ev in events:  # after the targets' copies: the client waits for it
            ev.done.record(dev.stream.ptr)
        if not (everyone and len(events) == len(device_batch.requests)):  # else no host waits for the GPU
            dev.synchronize()
        timeline.mark("batch.synced")
        for req, _ in targeted:
            req.targets_written = True
        return {} if everyone else {name: h[:rows].copy() for name, h in slot.host_out.items()}

    def run(self, batch: Batch) -> dict[str, np.ndarray]:
        """The batch's outputs (see Request: ``events``)."""
        if batch.bucket in self._slots and batch.on_device and hasattr(self.device, "copy_device"):
            return self._run_slot(batch.bucket, batch.rows, None, batch)
        _wait_inputs(batch.requests)
        outputs = self._run_host_feeds(batch)
        for req in batch.requests:  # run and synchronised: the outputs reach the host, which writes them
            if req.events is not None:
                req.events.done.record(self.device.stream.ptr)
        return outputs

    def _run_host_feeds(self, batch: Batch) -> dict[str, np.ndarray]:
        if batch.bucket in self._slots:
            return self._run_slot(batch.bucket, batch.rows, lambda bufs: batch.fill(bufs, zero_padding=False))
        # Larger than every bucket: bucket-sized chunks, so only captured shapes ever run.
        feeds, step, parts = batch.feeds(), self.buckets[-1], []
        for start in range(0, batch.rows, step):
            chunk = {n: a[start : start + step] for n, a in feeds.items()}
            k = len(next(iter(chunk.values())))

            def fill(bufs, chunk=chunk, k=k):
                for n, a in chunk.items():
                    bufs[n][:k] = a

            parts.append(self._run_slot(bucket_for(k, self.buckets), k, fill))
        return {n: np.concatenate([p[n] for p in parts]) for n in parts[0]}

    def warm_up(self, inputs) -> None:
        """Runs every bucket WARM_UP_RUNS times on the calling thread (the
        first run of a graph session captures its graph; later warm-ups replay),
        then, on a device that copies device to device, once more from device
        inputs of fewer rows than the bucket: the leaf channel's path, whose
        copy and padding kernels CuPy would otherwise load on the first wave."""
        for bucket in self.buckets:
            began = time.perf_counter()
            for _ in range(WARM_UP_RUNS):
                self._run_slot(bucket, bucket, lambda bufs: [b.fill(0) for b in bufs.values()])
            if hasattr(self.device, "copy_device"):
                rows = max(bucket // 2, 1)
                feeds = {n: self.device.device_zeros((rows, *d.shape[1:]), d.dtype)
                         for n, d in self._slots[bucket].dev_in.items()}
                self._run_slot(bucket, rows, None, Batch([Request(feeds, rows, CRITICAL)], rows, bucket, [0], CRITICAL))
            self.warm_up_s[bucket] = time.perf_counter() - began
        self.warmed_on = threading.get_ident()


# -- sessions ---------------------------------------------------------------------


def convolution_options(model: ModelConfig, cfg: RewardConfig) -> dict[str, str]:
    """The CUDA execution provider's options that decide how ``model``'s
    convolutions run: cuDNN's algorithm search, the NHWC layout, the bias
    inside the convolution's kernel."""
    options = {"cudnn_conv_algo_search": cfg.cudnn_conv_algo_search}
    if model.prefer_nhwc:
        options["prefer_nhwc"] = "1"
    if model.fuse_conv_bias:
        options["fuse_conv_bias"] = "1"
    return options


_ARENA_LOCK = threading.Lock()
_arena_registered = False  # guarded by _ARENA_LOCK


def shared_cpu_arena() -> None:
    """Registers, once per process, the CPU arena every CPU session of the
    process allocates from (ONNX Runtime's environment allocator, which a
    session takes with ``session.use_env_allocators``), growing by what a run
    asks (``kSameAsRequested``), never by powers of two.

    Each session's own arena keeps, for good, the most its session's largest
    run needed: one per session (the lanes' runners, each model), each up to
    twice that with memory patterns. One shared arena keeps the most that the
    runs in flight at once needed, whichever sessions made them: 12 rounds of
    frame_reward at 256 rows on two sessions leave 428 MiB resident, where
    the sessions' own arenas left 1,644 MiB (CPU, 2026-12-05).
    """
    global _arena_registered
    with _ARENA_LOCK:
        if _arena_registered:
            return
        cpu = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        # OrtArenaCfg(max_mem (0: no limit), arena_extend_strategy (1: kSameAsRequested),
        # initial_chunk_size_bytes, max_dead_bytes_per_chunk) (-1: ONNX Runtime's defaults)
        ort.create_and_register_allocator(cpu, ort.OrtArenaCfg(0, 1, -1, -1))
        _arena_registered = True


class _SessionFactory:
    """Makes one model's ONNX Runtime sessions, all with the same session options.

    Args:
        raw: the model's ONNX bytes (in the configured precision).
        model, cfg: the model's and the reward service's configuration.
        pool_bytes: ``gpu_mem_limit`` of each CUDA session (bytes; 0 = no limit).

    Each method raises what ``ort.InferenceSession`` raises where the model cannot be loaded.
    """

    def __init__(self, raw: bytes, model: ModelConfig, cfg: RewardConfig, pool_bytes: int):
        self._raw, self._model, self._cfg = raw, model, cfg
        self.pool_bytes = pool_bytes
        self._options = self._base_options()

    def _base_options(self) -> ort.SessionOptions:
        """The session options every session of the model starts from."""
        options = ort.SessionOptions()
        if self._cfg.intra_op_threads:
            options.intra_op_num_threads = self._cfg.intra_op_threads
        spin = "1" if self._cfg.ort_thread_spinning else "0"  # spinning threads burn a core each between runs
        for pool in ("intra_op", "inter_op"):
            options.add_session_config_entry(f"session.{pool}.allow_spinning", spin)
        options.log_severity_level = 3  # a CUDA fallback is reported by ModelSession, once
        return options

    def cpu(self) -> ort.InferenceSession:
        """A session on the CPU execution provider only, its memory in the
        process's one CPU arena (:func:`shared_cpu_arena`) and without memory
        patterns."""
        options = self._base_options()
        # Memory patterns plan one block per input shape, kept beside the arena's chunks of the
        # first run of that shape: twice a batch's working set, per shape. Off, every run takes
        # its tensors from the one arena; a run costs the same (frame_reward at 256 rows: 37 ms
        # with, 38-39 ms without; connect4_value at 1-512 rows within noise; CPU, 2 cores).
        options.enable_mem_pattern = False
        shared_cpu_arena()
        options.add_session_config_entry("session.use_env_allocators", "1")
        return ort.InferenceSession(self._raw, sess_options=options, providers=[CPU])

    def cuda(self, stream_handle: str = "", graphs: bool = False) -> ort.InferenceSession:
        """A session on the CUDA execution provider (ONNX Runtime falls back to
        the CPU where CUDA does not load). ``stream_handle``: the address of the
        CUDA stream it runs on, in decimal (empty: ONNX Runtime's own stream);
        ``graphs``: CUDA graph capture and replay."""
        options = {"arena_extend_strategy": "kSameAsRequested", **convolution_options(self._model, self._cfg)}
        if self.pool_bytes:
            options["gpu_mem_limit"] = str(self.pool_bytes)
        if stream_handle:
            options["user_compute_stream"] = stream_handle
        if graphs:
            options["enable_cuda_graph"] = "1"
        return ort.InferenceSession(self._raw, sess_options=self._options, providers=[(CUDA, options), CPU])


# -- the model -------------------------------------------------------------------


class ModelSession:
    """One configured model: its session(s), input checks and batch runs, for
    the two lanes of its batcher.

    Attributes:
        name, description, max_batch_size, precision: from the config.
        version: sha256 prefix of the model file (and the precision).
        inputs, outputs: the model's tensor specs.
        execution_provider: the provider the model really runs on (with
            ``auto`` CUDA is tried first; ONNX Runtime falls back to the CPU).
        buckets: batch sizes the batcher pads to (empty: no padding, the CPU path).
        mergeable: whether requests can be concatenated along the batch (every
            other dimension of every tensor is fixed).
        stream_priorities: CUDA stream priorities the bulk lane holds a runner
            bound to a stream of (the configured ones; empty where streams are
            not used). The critical lane runs on the greatest (most urgent) of them.
        runtime: feature -> how it runs here, or why it is off (ModelMetadata.runtime).
        warm_up_ms: time the start-up warm-ups took, every lane's together (ms).

    Args:
        model, cfg: the model's and the reward service's configuration.
        pool_bytes: ``gpu_mem_limit`` of each of this model's runners, split
            evenly over the runner's per-bucket sessions (bytes; 0 = no
            limit); default ``cfg.memory_pool_bytes``. A model has
            :func:`runners_per_model` runners.
        host_binding: run the IO-binding path over host buffers and the CPU
            provider (tests of that path without a GPU).
        critical_lane: build the critical lane's runner (False: the bulk
            server's models, which serve bulk batches only: ``lane_runners(CRITICAL)``
            is empty and a critical batch raises RuntimeError).
        warm: warm up every runner now, on this thread (:meth:`warm_up`). The
            server passes False and has each lane's batcher worker -- the one
            thread that runs that lane's requests -- warm that lane's runners
            up before the service reports SERVING:
            ONNX Runtime's CUDA execution provider keeps per-thread state, so a
            warm-up on another thread left the first request at each bucket
            paying for it (80-130 ms with cuDNN's EXHAUSTIVE search, on the H200).

    Raises (constructor):
        RuntimeError: ``cuda`` was required but the session did not get it;
            the model cannot be loaded; ``fp16`` without onnxconverter-common.

    Runners and threads (the invariants; reward_service/batcher.py has the lanes')
    ------------------------------------------------------------------------------
    * ``_runners``: the bulk lane's runners, one per configured stream
      priority (config order). Run by the bulk lane's worker thread only
      (:meth:`warm_up` with ``BULK``, :meth:`run_batch` of a bulk batch).
    * ``_critical``: the critical lane's own runner, on the greatest held
      stream priority (None on the bulk server: ``critical_lane=False``). Run by the critical lane's worker thread only
      (:meth:`warm_up` with ``CRITICAL``, :meth:`run_batch` of a critical
      batch). On the bound paths it is never one of ``_runners``: when the
      scheduler assigns the bulk lane the greatest stream priority, the bulk
      lane runs on its own runner at that priority, so no runner's IO-bound
      buffers (or ``dirty_rows``) are ever touched by two threads. On the
      plain path (CPU) it is the same :class:`_PlainRunner` as
      ``_runners[0]``, shared by both threads: it keeps no buffers and
      ``InferenceSession.run`` is thread-safe.
    * ``_active``: which of ``_runners`` the bulk lane runs next. Written by
      :meth:`set_stream_priority` (the scheduler client's thread) as one
      reference assignment, read once per bulk batch by the bulk worker; no
      lock is needed because every runner it can point at belongs to the bulk
      worker anyway. A switch takes effect from the next bulk batch.
    * ``runtime`` and ``warm_up_ms`` are written at construction and by the
      lanes' warm-ups, which the batcher runs one after the other before the
      service serves; afterwards they are only read (ModelMetadata), except
      the per-lane warm-up entry each :meth:`warm_up` call rewrites.
    * :meth:`run` (unbatched, tools and benchmarks) uses the bulk lane's
      runner: never while a batcher serves the model.

    Memory: the critical lane's dedicated runner is a whole extra runner --
    one more ONNX Runtime session per bucket (its own copy of the weights, its
    own arena up to the per-runner ``gpu_mem_limit``, cuDNN workspace), its
    own device and pinned staging buffers per bucket, and with ``cuda_graph``
    its own graph per bucket. A model's GPU memory is so ``(n + 1) / n`` times
    what ``n`` bulk runners alone take (1.5x with the default stream
    priorities (0, -5)), and under a fixed ``reward.memory_pool_bytes`` the
    server splits the pool over ``n + 1`` runners per model (each runner's
    arena limit shrinks to match). Warm-up takes one runner's warm-up longer.
    Sharing the bulk lane's runner at the greatest stream priority instead
    would need a lock between the lanes, and put a critical request back
    behind a running bulk batch whenever the bulk lane is assigned that
    stream priority.
    """

    def __init__(self, model: ModelConfig, cfg: RewardConfig, *, pool_bytes: int | None = None,
                 host_binding: bool = False, warm: bool = True, critical_lane: bool = True):
        self.name = model.name
        self.critical_lane = critical_lane
        self.description = model.description
        self.max_batch_size = model.max_batch_size
        want_cuda = _use_cuda(cfg.execution_provider)
        self.precision = resolve_precision(model.precision, want_cuda)  # "fp32" or "fp16"
        self._nonfinite_reject = cfg.nonfinite_inputs == "reject"
        self.runtime: dict[str, str] = {}
        path = resolve_path(model.path)
        cupy = cupy_module() if want_cuda else None
        if want_cuda and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA and cuDNN from their pip packages, where installed
        pool = cfg.memory_pool_bytes if pool_bytes is None else pool_bytes
        try:
            factory = _SessionFactory(self._load(path, self.precision), model, cfg, pool)
            probe = factory.cuda() if want_cuda else factory.cpu()
            on_cuda = probe.get_providers()[0] == CUDA
            if self.precision != resolve_precision(model.precision, on_cuda):
                # "auto" chose fp16 for CUDA, but ONNX Runtime fell back to the CPU (e.g. cuDNN
                # missing), where FP16 convolutions are emulated: fp32 there, as "auto" says.
                self.precision = resolve_precision(model.precision, on_cuda)
                factory = _SessionFactory(self._load(path, self.precision), model, cfg, pool)
                probe = factory.cpu()
        except Exception as exc:  # ONNX Runtime's errors are not RuntimeErrors, and span lines
            raise RuntimeError(f"model {model.name}: cannot load {path}: {' '.join(str(exc).split())[:300]}") from None
        self._read_signature(probe, cfg.execution_provider)
        self.buckets: tuple[int, ...] = ()
        self.stream_priorities: tuple[int, ...] = ()
        why_unbound = self._why_unbound(cupy, host_binding)
        if why_unbound:
            self._build_plain_runner(probe, why_unbound, model.cuda_graph)
        else:
            del probe  # its arena is released before the bound sessions allocate theirs
            self._build_bound_runners(factory, model, cfg, cupy)
        self._active = self._runners[0]  # swapped by set_stream_priority (one reference write)
        self._warm_up_ms: dict[str, float] = {}  # lane name (or "all") -> ms of its last warm-up
        self.warm_up_ms = 0.0
        if warm:
            self.warm_up()
        log.info("model %s (%s) on %s: %s", model.name, path, self.execution_provider,
                 "; ".join(f"{k}: {v}" for k, v in self.runtime.items()))

    # -- construction, one step each ---------------------------------------------

    def _load(self, path: Path, precision: str) -> bytes:
        """The model file's ONNX bytes in ``precision`` ("fp32" or "fp16"); sets
        ``version`` (of the file as read, and the precision) and ``runtime["precision"]``.

        Raises:
            OSError: the file cannot be read.
            RuntimeError: ``fp16`` without onnxconverter-common.
        """
        raw = path.read_bytes()
        self.version = hashlib.sha256(raw + precision.encode()).hexdigest()[:12]
        self.runtime["precision"] = precision
        if precision == "fp16":
            raw = _to_fp16(raw, self.name)
            self.runtime["precision"] = "fp16 (FP16 body, FP32 last layer and outputs)"
        return raw

    def _read_signature(self, probe: ort.InferenceSession, choice: str) -> None:
        """Sets ``execution_provider``, ``inputs``, ``outputs`` and ``mergeable``
        from the first session made (``choice``: the configured execution_provider).

        Raises:
            RuntimeError: ``choice`` is "cuda" but the session fell back to the
                CPU; a tensor has no batch dimension (0-d).
        """
        self.execution_provider = probe.get_providers()[0]
        if choice == "cuda" and self.execution_provider != CUDA:
            raise RuntimeError(f"model {self.name}: execution_provider is 'cuda' but ONNX Runtime could not use it")
        self.inputs = _specs(probe.get_inputs())
        self.outputs = _specs(probe.get_outputs())
        for s in self.inputs + self.outputs:
            if not s.shape:
                raise RuntimeError(f"model {self.name}: tensor {s.name!r} has no batch dimension (0-d)")
        # Requests can be concatenated along the batch, and bound to fixed-size
        # buffers, only when every other dimension is fixed.
        self.mergeable = all(s.shape[0] == -1 and all(d > 0 for d in s.shape[1:]) for s in self.inputs + self.outputs)

    def _why_unbound(self, cupy, host_binding: bool) -> str:
        """Why the model runs without IO binding, as a runtime note ("off: ..."),
        or "" where it runs bound (on the GPU, or over host buffers with ``host_binding``)."""
        if host_binding and self.mergeable:
            return ""
        if self.execution_provider != CUDA:
            return "off: CPU execution provider"
        if cupy is None:
            return "off: CuPy not installed (the gpu extra)"
        if not self.mergeable:
            return "off: a tensor has a dynamic dimension besides the batch"
        return ""

    def _build_plain_runner(self, probe: ort.InferenceSession, why: str, graphs_requested: bool) -> None:
        """The CPU path: one runner over ``InferenceSession.run`` on the probe
        session, which both lanes share (thread-safe, no buffers); every GPU
        feature's runtime note says ``why`` it is off."""
        self._runners = [_PlainRunner(probe, [s.name for s in self.outputs],
                                      warm_rows=min(self.max_batch_size, CPU_WARM_ROWS))]
        self._critical = self._runners[0] if self.critical_lane else None
        self.runtime.update(io_binding=why, cuda_graph=why if graphs_requested else "off: not requested",
                            batch_buckets="off: no padding without bound buffers", stream_priorities=why,
                            lanes="critical and bulk: a worker thread each, sharing the one session "
                                  "(InferenceSession.run is thread-safe); no streams" if self.critical_lane else
                                  "bulk only (the bulk server): one session on the bulk worker thread; no streams")

    def _build_bound_runners(self, factory: _SessionFactory, model: ModelConfig, cfg: RewardConfig, cupy) -> None:
        """The IO-binding path: ``buckets`` from the config; for the bulk lane
        one runner per configured CUDA stream priority on the GPU (one over
        host buffers otherwise), and one more for the critical lane on the
        greatest of them; each with a CUDA graph per bucket where asked for
        and capturable. Sets ``stream_priorities`` and the runtime notes."""
        on_gpu = self.execution_provider == CUDA
        self.buckets = tuple(b for b in model.batch_buckets if b <= self.max_batch_size) or (self.max_batch_size,)
        factory.pool_bytes //= len(self.buckets)  # the model's share, split over its per-bucket sessions
        graphs = model.cuda_graph and on_gpu
        graph_note = "on (one graph per bucket: a session per bucket)" if graphs else (
            "off: not requested" if not model.cuda_graph else "off: CPU execution provider")
        bulk_devices = [_CupyDevice(cupy, p) for p in cfg.stream_priorities] if on_gpu else [_HostDevice()]
        critical_devices = []
        if self.critical_lane:  # the critical lane's own device: its own stream (and buffers), never a bulk runner's
            critical_devices.append(_CupyDevice(cupy, min(cfg.stream_priorities)) if on_gpu else _HostDevice())
        runners = []
        for device in [*bulk_devices, *critical_devices]:
            runner, failure = self._bound_runner(factory, device, graphs)
            if failure:  # the sessions after this one run without graphs too
                graphs, graph_note = False, failure
            runners.append(runner)
            self._log_times(runner, "created its sessions in %.2f s" % runner.create_s)
        self._runners = runners[: len(bulk_devices)]
        self._critical = runners[len(bulk_devices)] if self.critical_lane else None
        if not graphs and any(r.graphs for r in runners):
            graph_note += "; graphs on for " + ", ".join(
                f"{'the critical lane' if r is self._critical else 'bulk'} at stream priority {r.stream_priority}"
                for r in runners if r.graphs)
        self.stream_priorities = tuple(r.stream_priority for r in self._runners) if on_gpu else ()
        held = ",".join(map(str, self.stream_priorities))
        self.runtime.update(
            io_binding="device buffers, pinned host staging" if on_gpu else "host buffers (CPU test path)",
            cuda_graph=graph_note,
            batch_buckets=",".join(map(str, self.buckets)),
            stream_priorities=held if on_gpu else "off: CPU execution provider",
            lanes=self._lanes_note(held, on_gpu),
        )
        if on_gpu:
            self.runtime["layout"] = "nhwc preferred" if model.prefer_nhwc else "nchw"
            self.runtime["conv_bias"] = ("asked inside the convolution's kernel (fuse_conv_bias)" if model.fuse_conv_bias
                                         else "a kernel of its own")
            self.runtime["cudnn_conv_algo_search"] = cfg.cudnn_conv_algo_search
            self.runtime["gpu_mem_limit_bytes"] = str(factory.pool_bytes) if factory.pool_bytes else "none"  # per session

    def _lanes_note(self, held: str, on_gpu: bool) -> str:
        if not self.critical_lane:
            return (f"bulk only (the bulk server): own worker thread and sessions at {held}, the scheduler's "
                    "assignment picks" if on_gpu else "bulk only (the bulk server): host-bound sessions; no streams")
        if on_gpu:
            return (f"critical: own worker thread and sessions at stream priority {self._critical.stream_priority} "
                    f"(the greatest held); bulk: own worker thread and sessions at {held}, "
                    "the scheduler's assignment picks")
        return "critical and bulk: a worker thread and host-bound sessions each; no streams"

    def _bound_runner(self, factory: _SessionFactory, device, graphs: bool) -> tuple[_BoundRunner, str]:
        """A runner bound to ``device``'s buffers (and stream), with a CUDA graph
        per bucket if ``graphs`` and the capture succeeds: it is captured here,
        so that a failure falls back to a runner without graphs at construction.

        Returns the runner and, where the capture failed, the runtime note saying why ("" otherwise).
        """
        failure = ""
        if graphs:
            try:
                runner = _BoundRunner(lambda: factory.cuda(device.stream_handle, graphs=True), device, self.inputs,
                                      self.outputs, self.buckets, True)
                runner.warm_up(self.inputs)
                return runner, ""
            except Exception as exc:  # capture needs every node on the CUDA provider
                failure = f"off: capture failed ({str(exc).splitlines()[0][:200]})"
                log.warning("model %s: CUDA graphs off: %s", self.name, exc)
        make = (lambda: factory.cuda(device.stream_handle)) if device.ort_device == "cuda" else factory.cpu
        return _BoundRunner(make, device, self.inputs, self.outputs, self.buckets, False), failure

    def _log_times(self, runner, what: str) -> None:
        """One start-up line for a bound runner: ``what``, then its buckets' last
        warm-ups (s), slowest first (where a restart's seconds go)."""
        if isinstance(runner, _BoundRunner):
            warm = sorted(runner.warm_up_s.items(), key=lambda kv: -kv[1])
            log.info("model %s, runner at stream priority %d: %s; warm-ups %.2f s (%s)", self.name,
                     runner.stream_priority, what, sum(runner.warm_up_s.values()),
                     ", ".join(f"{b}: {t:.2f}" for b, t in warm[:4]) or "none yet")

    @property
    def orders_by_events(self) -> bool:
        """Whether the critical lane can order leaf-channel waves by CUDA
        events (a bound runner on a CuPy stream; Request.events)."""
        return isinstance(self._critical, _BoundRunner) and isinstance(self._critical.device, _CupyDevice)

    def lane_runners(self, lane: int | None = None) -> list:
        """The runners ``lane`` (``CRITICAL`` or ``BULK``) runs on; None: every
        runner, each once (the CPU's shared one too)."""
        critical = [] if self._critical is None else [self._critical]
        if lane == CRITICAL:
            return critical
        if lane == BULK:
            return list(self._runners)
        if lane is None:  # the CPU's one runner serves both lanes: listed once
            return list(self._runners) + [r for r in critical if r not in self._runners]
        raise ValueError(f"lane: expected REQUEST_CLASS_CRITICAL or REQUEST_CLASS_BULK, got {lane}")

    def warm_up(self, lane: int | None = None) -> None:
        """Runs every bucket of ``lane``'s runners (None: every runner) --
        cuDNN algorithm search, arena growth, graph capture -- on the calling
        thread, so that the first request run on this thread pays none of it.
        The batcher calls it on each lane's worker thread with that lane
        (``warm_up=session.warm_up``). Sets ``warm_up_ms`` (ms, every lane's
        last warm-up together)."""
        start = time.perf_counter()
        for runner in self.lane_runners(lane):
            runner.warm_up(self.inputs)
            self._log_times(runner, "warmed up on the %s lane's thread" % ("every" if lane is None else LANES[lane]))
        self._warm_up_ms["all" if lane is None else LANES[lane]] = (time.perf_counter() - start) * 1e3
        self.warm_up_ms = sum(self._warm_up_ms.values())
        self.runtime["warm_up_ms"] = f"{self.warm_up_ms:.0f}"

    # -- requests -------------------------------------------------------------

    def decode(self, inputs: list[reward_pb2.Tensor]) -> dict[str, np.ndarray]:
        """Checks tensors against the model's inputs and decodes them (no copy).

        Returns input name -> read-only array; all share the batch size.

        Raises:
            InputError: missing, unknown or repeated input; wrong dtype, rank,
                dimension or byte length; batch empty, too large or unequal
                across inputs; NaN/Inf where rejected.
        """
        by_name: dict[str, reward_pb2.Tensor] = {}
        expected = {s.name for s in self.inputs}
        # Each tensor known and new, or the loop ends: at most one more pass than the
        # model has inputs, however many tensors the client sent.
        for t in inputs:
            if t.name not in expected:
                raise InputError(f"inputs: model {self.name!r} has no input {quote(t.name)} (inputs: {sorted(expected)})")
            if t.name in by_name:
                raise InputError(f"inputs: tensor {quote(t.name)} given twice")
            by_name[t.name] = t
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
            if len(t.shape) != len(spec.shape):
                raise InputError(f"inputs[{spec.name!r}].shape: expected {list(spec.shape)} (-1: any), "
                                 f"got {len(t.shape)} dimensions")
            shape = tuple(t.shape)
            if any(e != -1 and e != g for e, g in zip(spec.shape, shape)):
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

    def check_output_names(self, output_names) -> tuple[str, ...]:
        """The requested output names (empty: all), checked.

        Raises:
            InputError: more names than the model has outputs (checked first,
                in O(1)), an unknown name or one given twice.
        """
        known = [s.name for s in self.outputs]
        if len(output_names) > len(known):  # before any per-name work: the count is the client's
            raise InputError(f"output_names: {len(output_names)} names, but model {self.name!r} has "
                             f"{len(known)} outputs ({known})")
        for i, n in enumerate(output_names):
            if n not in known:
                raise InputError(f"output_names: model {self.name!r} has no output {quote(n)} (outputs: {known})")
            if n in output_names[:i]:
                raise InputError(f"output_names: {quote(n)} given twice")
        return tuple(output_names)

    def output_row_bytes(self, names: tuple[str, ...] = ()) -> int:
        """Bytes one row of the outputs ``names`` (empty: all) takes, by their
        specs; a dynamic dimension besides the batch counts as 1 (unknown
        before the run)."""
        wanted = [s for s in self.outputs if not names or s.name in names]
        return sum(math.prod(max(d, 1) for d in s.shape[1:]) * tensors.numpy_dtype(s.dtype).itemsize
                   for s in wanted)

    # -- runs -----------------------------------------------------------------

    def run_batch(self, batch: Batch) -> dict[str, np.ndarray]:
        """The batcher's callback: runs a merged batch on its lane's runner --
        a critical batch on the critical lane's own runner (the greatest held
        stream priority), a bulk batch on the bulk runner the scheduler's
        assignment picked.

        Returns output name -> array of >= ``batch.rows`` rows, not reused later.
        Called from the worker thread of ``batch.lane`` only.
        """
        runner = self._critical if batch.lane == CRITICAL else self._active
        if runner is None:  # the servicer refuses critical requests first (FAILED_PRECONDITION)
            raise RuntimeError(f"model {self.name}: no critical lane here (the bulk server)")
        with nvtx.span(f"model.{self.name}.{LANES[batch.lane]}"):  # the lane, on the Nsight timeline
            return runner.run(batch)

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> tuple[dict[str, np.ndarray], float]:
        """Runs the model once, unbatched (tools and benchmarks). Returns the
        outputs by name and the run time in ms.

        Not safe to call while a batcher serves this model (both would use
        the same bound buffers).

        Raises:
            InputError: an unknown output name.
        """
        names = self.check_output_names(output_names or ())
        rows = len(next(iter(feeds.values())))
        start = time.perf_counter()
        outputs = self.run_batch(Batch([Request(feeds, rows)], rows, bucket_for(rows, self.buckets), [0]))
        ms = (time.perf_counter() - start) * 1e3
        return {n: outputs[n][:rows] for n in (names or outputs)}, ms

    def set_stream_priority(self, stream_priority: int) -> int:
        """Switches the bulk lane to its runner bound to the held stream that
        :func:`tandem.stream_priority.nearest_allowed` picks for the assigned
        CUDA ``stream_priority`` (the rule the search service follows too).
        Returns the stream priority the bulk lane now uses (0 on the CPU,
        which holds no stream). Takes effect from the next bulk batch. The
        critical lane is not moved: it stays on the greatest held stream priority."""
        chosen = nearest_allowed(stream_priority, [r.stream_priority for r in self._runners])
        self._active = next(r for r in self._runners if r.stream_priority == chosen)
        return chosen

    @property
    def active_stream_priority(self) -> int:
        """The CUDA stream priority the next bulk batch runs at (0 on the CPU)."""
        return self._active.stream_priority

    @property
    def critical_stream_priority(self) -> int:
        """The CUDA stream priority every critical batch runs at: the greatest
        held (0 on the CPU, and on the bulk server, which has no critical lane)."""
        return 0 if self._critical is None else self._critical.stream_priority


def runners_per_model(cfg: RewardConfig, critical_lane: bool = True) -> int:
    """Runners a model holds on the GPU: one per configured stream priority
    for the bulk lane, plus the critical lane's own unless ``critical_lane``
    is False (the bulk server); the memory pool is split over them."""
    return len(cfg.stream_priorities) + int(critical_lane)


def resolve_precision(precision: str, cuda: bool) -> str:
    """``ModelConfig.precision`` made concrete: "auto" is "fp16" where the model
    is to run on the CUDA execution provider (``cuda``), else "fp32"."""
    if precision == "auto":
        return "fp16" if cuda else "fp32"
    return precision


def _to_fp16(raw: bytes, name: str) -> bytes:
    """The model converted to FP16 with an FP32 head (reward_service/precision.py)."""
    try:
        from reward_service import precision
    except ImportError as exc:  # onnxconverter-common missing
        raise RuntimeError(
            f"model {name}: precision fp16 needs onnxconverter-common (pip install onnxconverter-common==1.16.0): {exc}"
        ) from None
    import onnx

    return precision.convert_fp16(onnx.load_from_string(raw)).SerializeToString()
