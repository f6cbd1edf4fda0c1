"""In-process waves, the reward service's side: the value model run for a
search service of this same process (co-located mode), straight into the
model's critical lane, with no socket, no gRPC and no shared-memory region
(the meeting point and the protocol: tandem/in_process.py).

A search asks for an :class:`InProcessLink` to one model. A link holds, on a GPU, its
own device buffers: ``inputs`` (the model's input, ``[max_rows, *row]``),
where the search's selection kernel writes a wave's leaves, and one output
buffer per model output (float32 ``[max_rows, *row]``), where the bound
runner copies the wave's outputs device to device; and two CUDA events of
this process (tandem/cuda_events.py's LocalEvent): ``ready``, recorded on
the search's stream after the kernels that wrote the leaves, polled by the
critical lane before its copy reads them (as a leaf channel's); ``done``,
recorded by the runner after its output copies, which the search's stream
waits for on the GPU. So a device wave costs the search one submit and one
wake-up on the host, and no host wait for the model.

Invariants:

* A link belongs to one caller at a time (a device wave that borrowed it, or
  the search service's host calls, which HandoffEvaluator serialises): its buffers, events and last figures (``queue_ms``,
  ``compute_ms``, ``bucket``) are that caller's thread's, and at most one of
  its waves is in flight. ``_lock`` guards only ``_closed``.
* A wave runs in the model's critical lane (reward_service/batcher.py),
  merged there with the other critical requests queued with it (other
  links' waves, leaf-channel waves, critical Evaluate calls): batching across
  searches. It runs on the lane's worker thread, never the caller's (ONNX
  Runtime's CUDA provider keeps per-thread state; batcher.py).
* A wave's figures go into the per-model metrics' critical lane, as a leaf
  channel wave's (``requested`` and ``succeeded``/``failed``), on the
  caller's thread once its outputs are in place, before it returns.
* A device wave merged with host waves (another caller's) runs the host way
  (the batch's inputs are copied to the host): its outputs come back to the
  host and are written into its output buffers on the caller's stream, as a
  leaf channel writes such a wave's into its region.
* A wave answers by its deadline (a running one ``LATE_GRACE_S`` past it):
  one still running then is DEADLINE_EXCEEDED and its outputs are dropped. A
  device wave given up so still reads and writes the link's buffers, so the
  link's next wave first waits for it (``_late``), by its own deadline.
* Every failure is a :class:`tandem.leaf_channel.LeafChannelError` with the
  gRPC status a leaf channel would answer; the lane and the link go on.
"""
from __future__ import annotations

import logging
import operator
import threading
import time

import grpc
import numpy as np
from tandem.v1 import reward_pb2

from reward_service.batcher import LANES, DeadlineExceeded
from reward_service.leaf_channel import BadRequest, WaveEvents, model_signature, wave_output
from reward_service.model_metrics import ModelMetrics
from reward_service.refusal import Refusal, refusal_for
from reward_service.session import READY_WAIT_S, ModelSession
from tandem import tensors, timeline
from tandem.cuda_events import LocalEvent
from tandem.deadline import Deadline
from tandem.errors import quote
from tandem.gpu import cupy_module
from tandem.leaf_channel import LeafChannelError

log = logging.getLogger(__name__)

CRITICAL = reward_pb2.REQUEST_CLASS_CRITICAL
CRITICAL_LANE = LANES[CRITICAL]  # the per-model metrics' lane of every wave
_VIEW_SIZES = 64  # wave sizes whose buffer views a device link keeps
LATE_GRACE_S = 0.0005  # how long past its deadline a running wave is waited for (s), as a leaf channel's done event


class InProcessServer:
    """The reward service's in-process waves: links to its models for
    searches of this process.

    Args:
        sessions, batchers, metrics: the reward servicer's.
        max_rows: the most rows of one wave (``reward.leaf_channel.max_rows``:
            the same bound as the leaf channel's).
    """

    def __init__(self, sessions: dict[str, ModelSession], batchers: dict, metrics: ModelMetrics, max_rows: int):
        self.sessions, self.batchers, self.metrics, self.max_rows = sessions, batchers, metrics, max_rows
        self._lock = threading.Lock()
        self._closed = False  # guarded by _lock

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def close(self) -> None:
        """Refuses new links and waves (UNAVAILABLE); waves running end as they are."""
        with self._lock:
            self._closed = True

    def link(self, model: str, max_rows: int, device: bool) -> InProcessLink:
        """A link to ``model`` carrying waves of up to ``max_rows`` rows, narrowed
        to ``reward.leaf_channel.max_rows`` and the model's max_batch_size (the
        link's ``max_rows`` says how many); ``device``: with device buffers and
        events (a GPU search's device waves), else host waves (NumPy in, NumPy out).

        Raises:
            LeafChannelError: UNAVAILABLE (stopped), NOT_FOUND (no such model),
                INVALID_ARGUMENT (``max_rows`` not an integer >= 1), FAILED_PRECONDITION (a model whose
                signature does not fit a wave; device waves where the model's
                critical lane cannot order them by CUDA events: the CPU, or no
                bound runner).
        """
        if self.closed:
            raise LeafChannelError(grpc.StatusCode.UNAVAILABLE, "the reward service is stopping")
        session = self.sessions.get(model)
        if session is None:
            raise LeafChannelError(grpc.StatusCode.NOT_FOUND,
                                   f"model: no model named {quote(model)} (models: {sorted(self.sessions)})")
        try:
            wanted = None if isinstance(max_rows, bool) else operator.index(max_rows)
        except TypeError:
            wanted = None
        if wanted is None or wanted < 1:
            raise LeafChannelError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"max_rows: {quote(str(max_rows))}, must be an integer >= 1")
        # Narrowed, as a leaf channel's client narrows its attach (LeafChannel.offered).
        max_rows = min(wanted, self.max_rows, session.max_batch_size)
        try:
            spec, row, outputs = model_signature(session)
        except BadRequest as exc:
            raise LeafChannelError(exc.code, str(exc)) from None
        if device and not session.orders_by_events:
            raise LeafChannelError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"model {model!r}: its critical lane cannot take device waves "
                                   f"({session.execution_provider}, no CUDA events); send host waves")
        return InProcessLink(self, session, max_rows, spec.name, row, tensors.numpy_dtype(spec.dtype),
                    [(o.name, r) for o, r in outputs], device)


class InProcessLink:
    """One caller's way to one model (see the module's invariants). It
    answers to what a search asks of a :class:`tandem.leaf_channel.LeafChannel`
    (``evaluate``, ``evaluate_device``, ``device_inputs``, ``ordered``,
    ``kind``, ``closed``, ``close``, the last wave's figures), so the search's
    evaluators take either.

    Attributes:
        model, max_rows: as asked for.
        input_row, input_dtype: one row of the model's input (e.g. ``(2, 6, 7)``, uint8).
        output_rows: (name, row shape) of each output, in the model's order.
        inputs: a device link's input buffer, CuPy ``[max_rows, *input_row]``
            of ``input_dtype``; None for host waves.
        outputs: a device link's output buffers, name -> CuPy float32
            ``[max_rows, *row]``; empty for host waves.
        queue_ms, compute_ms, bucket: the last wave's (the lane's queue, its
            run's host time, the batch's padded size).
        kind: ``"cuda"`` where the model's critical lane takes device waves
            (a device link may be asked for), else ``"system"``.
    """

    path = "in-process"  # where the waves go, for logs (a leaf channel's socket path)

    def __init__(self, server: InProcessServer, session: ModelSession, max_rows: int, input_name: str,
                 input_row: tuple[int, ...], input_dtype: np.dtype, output_rows: list[tuple[str, tuple[int, ...]]],
                 device: bool):
        self._server = server
        self.model, self.max_rows = session.name, max_rows
        self._input_name, self.input_row, self.input_dtype = input_name, input_row, input_dtype
        self.output_rows = output_rows
        self._names = tuple(name for name, _ in output_rows)
        self.queue_ms = self.compute_ms = 0.0
        self.bucket = 0
        self.inputs, self.outputs, self._events, self._cupy = None, {}, None, None
        self._views: dict[int, tuple[dict, dict]] = {}  # rows -> a device wave's feeds and targets
        self._late = None  # a device wave given up at its deadline while it ran (Request), until done
        self.kind = "cuda" if session.orders_by_events else "system"
        if device:
            cupy = self._cupy = cupy_module()
            self.inputs = cupy.zeros((max_rows, *input_row), input_dtype)
            self.outputs = {name: cupy.zeros((max_rows, *r), np.float32) for name, r in output_rows}
            self._events = WaveEvents(LocalEvent(), LocalEvent())

    @property
    def device_inputs(self):
        """:attr:`inputs` (None for host waves), as a leaf channel names its input region."""
        return self.inputs

    @property
    def ordered(self) -> bool:
        """A device link's waves are ordered by CUDA events: the caller calls
        :meth:`evaluate_device` without synchronising its stream."""
        return self._events is not None

    @property
    def closed(self) -> bool:
        """Whether the reward service stopped (its waves are UNAVAILABLE)."""
        return self._server.closed

    def close(self) -> None:
        """Nothing to release but memory, freed with the link (as a leaf channel's close)."""

    def evaluate(self, inputs: np.ndarray, deadline: Deadline | None = None) -> dict[str, np.ndarray]:
        """One host wave: ``inputs`` (``[N, *input_row]`` of ``input_dtype``,
        1 <= N <= max_rows) through the model, by ``deadline``
        (None: none). Returns name -> float32
        ``[N, *row]`` (arrays of their own).

        Raises:
            LeafChannelError: INVALID_ARGUMENT (another dtype than the
                model's input -- never cast --, rows out of range or of another
                shape: nothing run), DEADLINE_EXCEEDED (not run by ``deadline``,
                or still running ``LATE_GRACE_S`` past it), RESOURCE_EXHAUSTED,
                UNAVAILABLE, INTERNAL (the run failed, or an output of another
                shape than the model's signature).
        """
        inputs = self._host_inputs(inputs)
        return self._wave({self._input_name: inputs}, None, len(inputs), deadline)

    def _host_inputs(self, inputs) -> np.ndarray:
        """A host wave's inputs, checked, as an array of their own.

        Raises:
            LeafChannelError: INVALID_ARGUMENT, as :meth:`evaluate` says.
        """
        inputs = np.asarray(inputs)
        if inputs.dtype != self.input_dtype:  # never cast: 0.7 would become 0, 300.0 44
            raise self._invalid(f"inputs: dtype {inputs.dtype}, the model {self.model!r} takes {self.input_dtype}")
        rows = inputs.shape[0] if inputs.ndim else 0
        if not 1 <= rows <= self.max_rows or tuple(inputs.shape[1:]) != self.input_row:
            raise self._invalid(f"inputs: shape {list(inputs.shape)}, the link carries 1..{self.max_rows} rows of "
                                f"{list(self.input_row)}")
        # A copy: a run given up at its deadline may still read it after the caller has moved on.
        return np.array(inputs, order="C")

    def evaluate_device(self, rows: int, deadline: Deadline | None = None) -> dict:
        """One device wave: rows ``[0, rows)`` of :attr:`inputs`, written by
        kernels queued on the current CUDA stream. Returns :attr:`outputs`
        (rows ``[0, rows)`` this wave's, valid until the next wave); the
        current stream waits for them on the GPU, so kernels queued on it
        after the return read them in place.

        Raises:
            LeafChannelError: as :meth:`evaluate`; INVALID_ARGUMENT also for a host link.
        """
        rows = self._device_rows(rows)
        stream = self._cupy.cuda.get_current_stream().ptr
        self._events.ready.record(stream)
        self._wave(*self._device_views(rows), rows, deadline)
        timeline.mark("link.answered")
        self._events.done.wait_on_stream(stream)
        return self.outputs

    def _device_rows(self, rows) -> int:
        """A device wave's row count, checked.

        Raises:
            LeafChannelError: INVALID_ARGUMENT: a host link, or not an integer in 1..max_rows.
        """
        if self.inputs is None:
            raise self._invalid("evaluate_device: a host link; use evaluate")
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or not 1 <= rows <= self.max_rows:
            raise self._invalid(f"rows: {rows!r}, the link carries 1..{self.max_rows} (an integer)")
        return int(rows)

    def _device_views(self, rows: int) -> tuple[dict, dict]:
        """The feeds and targets of a device wave of ``rows`` rows: views of the
        buffers, kept per size (a CuPy slice costs µs, and a search's waves
        repeat a few sizes; at most _VIEW_SIZES sizes are kept)."""
        views = self._views.get(rows)
        if views is None:
            if len(self._views) >= _VIEW_SIZES:
                self._views.clear()
            views = self._views[rows] = ({self._input_name: self.inputs[:rows]},
                                         {name: out[:rows] for name, out in self.outputs.items()})
        return views

    def _invalid(self, message: str) -> LeafChannelError:
        """A wave refused before it runs: counted as the leaf channel counts one."""
        self._server.metrics.requested(self.model, CRITICAL_LANE)
        self._server.metrics.failed(self.model, CRITICAL_LANE, "invalid_input", 0.0)
        return LeafChannelError(grpc.StatusCode.INVALID_ARGUMENT, message)

    def _wave(self, feeds: dict, targets: dict | None, rows: int, deadline: Deadline | None):
        """Runs one wave in the critical lane and records its figures; returns
        host outputs (a host wave) or None (a device wave: in its targets)."""
        self._server.metrics.requested(self.model, CRITICAL_LANE)
        start = time.perf_counter()
        try:
            self._wait_late(deadline)
            if self._server.closed:
                raise Refusal(grpc.StatusCode.UNAVAILABLE, "unavailable", "the reward service is stopping")
            outputs = self._answer(self._run(feeds, targets, rows, deadline), targets, rows)
        except Exception as exc:  # every failure a status; the link and the lane go on
            raise self._failed(exc, start) from None
        self._server.metrics.succeeded(self.model, CRITICAL_LANE, rows, time.perf_counter() - start,
                                       self.queue_ms / 1e3)
        return outputs

    def _answer(self, done, targets: dict | None, rows: int):
        """A done wave's outputs: host arrays of their own (a host wave), or
        None (a device wave's, in its targets: written there on the caller's
        stream where the run sent them to the host); its figures kept.

        Raises:
            Refusal: DEADLINE_EXCEEDED: its inputs came late.
            Exception: an output of another shape than the signature (INTERNAL).
        """
        if done.inputs_late:
            raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded",
                          f"wave: its inputs were not written within {READY_WAIT_S * 1e3:g} ms of its run "
                          "(the search's ready event)")
        outputs = None if targets is not None and done.targets_written else {
            key: wave_output(done, key, row, rows, self.model).copy() for key, row in self.output_rows}
        if targets is not None and outputs is not None:
            # Run in a batch with host waves (another caller's), its outputs came back to the
            # host: written into the targets on the caller's stream, before its next kernels.
            for key, array in outputs.items():
                targets[key].set(array)
            outputs = None
        self.queue_ms, self.compute_ms, self.bucket = done.queue_ms, done.compute_ms, done.bucket
        return outputs

    def _failed(self, exc: Exception, start: float) -> LeafChannelError:
        """A wave's failure, counted, as the status a leaf channel would answer."""
        refused = refusal_for(exc, self.model)
        if refused is not exc and refused.reason == "run_failed":
            log.exception("in-process wave of model %r failed", self.model)
        self._server.metrics.failed(self.model, CRITICAL_LANE, refused.reason, time.perf_counter() - start)
        return LeafChannelError(refused.code, refused.message)

    def _run(self, feeds: dict, targets: dict | None, rows: int, deadline: Deadline | None):
        """Submits the wave and waits for it until ``deadline`` (a running one
        ``LATE_GRACE_S`` more); returns the done request.

        Raises:
            DeadlineExceeded, QueueFull, BatcherClosed: as Batcher.submit, or
                not run by ``deadline``.
            Refusal: DEADLINE_EXCEEDED: still running past the grace (a device
                wave's run is then waited for by the link's next wave: it
                writes into the link's buffers).
            Exception: what the run raised.
        """
        batcher = self._server.batchers[self.model]
        req = batcher.submit(feeds, rows, CRITICAL, deadline, self._names, targets, None,
                             self._events if targets is not None else None)
        if not req.wait(None if deadline is None else deadline.wait_s()):
            if batcher.cancel(req):
                raise DeadlineExceeded("deadline passed before the run")
            if not req.wait(LATE_GRACE_S):
                if targets is not None:
                    self._late = req
                raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded",
                              f"model {self.model!r}: wave still running {LATE_GRACE_S * 1e3:g} ms past its "
                              "deadline; its outputs are dropped")
        req.result()
        return req

    def _wait_late(self, deadline: Deadline | None) -> None:
        """Waits (until ``deadline``) for a device wave given up at its deadline
        while it ran: its copies read and write this link's buffers.

        Raises:
            Refusal: DEADLINE_EXCEEDED: still running at ``deadline``.
        """
        late = self._late
        if late is None:
            return
        if not late.wait(None if deadline is None else deadline.wait_s()):
            raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded",
                          f"model {self.model!r}: the link's previous wave, given up at its deadline, still runs")
        self._late = None
