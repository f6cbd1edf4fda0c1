"""The leaf channel: a search's leaf observations to the reward service and its
values and priors back, through shared memory, with one Unix-domain socket
message each way per wave instead of a gRPC call.

Why: a gRPC ``Evaluate`` from Python costs ~1.5 ms per wave on the H200 for a
few kilobytes, which bounds a neural search to a few waves per frame; a Unix
``SOCK_SEQPACKET`` round trip is ~17 µs p50 (docs/design.md, "Measured
physics"). The tensors themselves never cross the socket: they lie in two
regions of the reward service's shared-memory table
(reward_service/shared_memory.py), which the channel pins to its connection.
A CUDA region is registered with ``RegisterSharedMemory`` like any bulk
client's; host memory is a memfd sealed against resizing
(:class:`~tandem.shared_memory_client.SealedMemory`) whose descriptor the
attach message carries (SCM_RIGHTS), registered by the server for the
attach's client: it cannot shrink under the server's mapping, and it has no
name in /dev/shm for another client to register.

* the **input region**: a CUDA allocation exported by its IPC handle when the
  reward service runs on this GPU and CuPy is here (the server copies the
  wave device to device into its bound buffers), else a sealed memfd.
  The model's input dtype, ``[max_rows, *row]`` from offset 0.
* the **output region**: of the input region's kind: each output float32
  ``[max_rows, *row]``, one after another on 64-byte boundaries
  (:func:`output_layout`). A CUDA output region is written by the server's
  bound runner device to device, on its stream, before its one
  synchronisation; the search's backup kernels read it there
  (:meth:`LeafChannel.evaluate_device`): a wave's tensors never touch the host.

The protocol (every message one datagram; the first byte is its kind):

====================  ==========================================================
client -> server      server -> client
====================  ==========================================================
``A`` + JSON attach   ``A`` + JSON layout, or ``E``: the model, the regions and
(+ descriptors)       ``max_rows``; ``memfds`` lists the regions (of
                      ``input_region``, ``output_region``, ``ready_region``)
                      whose memfds the message carries, in order; the server
                      checks their seals (F_SEAL_SHRINK), registers them, checks
                      every region (owner, kind, size) and holds them for the
                      connection's life
``W`` + WAVE          ``R`` + REPLY once the outputs are in the output region,
                      or ``E`` + ERROR (a gRPC status code and a message)
====================  ==========================================================

Ordering: the client writes a wave's inputs (and synchronises a CUDA copy)
before it sends ``W``; the server reads them only after, and writes the
outputs before it sends ``R``. A channel of two CUDA regions whose server
runs it on a bound runner orders them on the GPU's side instead
(:attr:`LeafChannel.ordered`): the layout carries the server's
``done_event`` (tandem/cuda_events.py), and the attach either a
``ready_region`` -- a sealed memfd holding the client's ready word
(tandem/ready_word.py): a sequence number its stream stores after the
kernels that write a wave's inputs -- or, where this process cannot map
one, its ``ready_event``. The critical lane's worker waits for the word (or
the event) before it copies the inputs in (at most 5 ms once the previous
wave's outputs are done), records ``done`` after its output copies and
sends ``R`` once they are queued, not done; the client waits for ``done``
before its kernels read them. Each side's wait is then for the other's GPU
work alone, past the socket hops and host work between, not for a
synchronisation followed by a hop. One wave is in flight per connection;
the server answers waves in order, so a client that gave up on a wave (its
deadline) skips replies whose ``seq`` is older than the wave it waits for.
The connection closing (either side, or a process dying) unregisters its
regions on the server. The server serves its own user only (SO_PEERCRED),
and closes a connection not attached within
``reward.leaf_channel.attach_timeout_ms`` of connecting (DEADLINE_EXCEEDED).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass

import grpc
import numpy as np
from tandem.v1 import reward_pb2, reward_pb2_grpc

from tandem import gpu, tensors, timeline
from tandem.cuda_events import ExportedEvent, OpenedEvent
from tandem.deadline import Deadline
from tandem.ready_word import WORD_BYTES, ReadyWord
from tandem.shared_memory_client import CudaSharedMemoryRegion, SealedMemory, aligned
from tandem.gpu import cupy_module

log = logging.getLogger(__name__)

ATTACH, WAVE, REPLY, ERROR = b"A", b"W", b"R", b"E"
WAVE_FORMAT = struct.Struct("<QIq")  # seq, rows, timeout (µs; <= 0: none)
REPLY_FORMAT = struct.Struct("<QIff")  # seq, padded batch rows, queue ms, model ms
ERROR_FORMAT = struct.Struct("<QI")  # seq (0: the attach), grpc status code value; then a UTF-8 message
MAX_MESSAGE_BYTES = 4096  # attach and error messages; a wave is 21 bytes
DONE_GRACE_S = 0.0005  # how long past its deadline an ordered wave's queued run is waited for (s)
DETACH_WAIT_S = 1.0  # how long close() waits for the server to let go of the regions (s)
# How long a wave's reply is read for without blocking before the read blocks (s): the
# reply comes ~0.1-0.3 ms after the message, and a thread woken from a blocking read
# starts cold (docs/design.md, "The leaf channel": waits that keep the host warm). 0: block at once.
REPLY_SPIN_S = 0.002
RUNTIME_KEY = "leaf_channel"  # ModelMetadata.runtime key holding the server's socket path


class LeafChannelError(Exception):
    """The channel failed: ``code`` is the gRPC status the server answered
    (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED, ...) or UNAVAILABLE when the connection broke."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code


@dataclass(frozen=True)
class OutputSlot:
    """Where one output lies in the output region: float32 ``[max_rows, *row]`` from ``offset``."""

    name: str
    row: tuple[int, ...]
    offset: int

    def nbytes(self, rows: int) -> int:
        return rows * int(np.prod(self.row, dtype=np.int64)) * 4


def output_layout(outputs: list[tuple[str, tuple[int, ...]]], max_rows: int) -> tuple[list[OutputSlot], int]:
    """The output slots of ``outputs`` ((name, row shape) pairs, float32) for
    ``max_rows`` rows, and the bytes the output region needs."""
    slots, offset = [], 0
    for name, row in outputs:
        slots.append(OutputSlot(name, tuple(row), offset))
        offset = aligned(offset + slots[-1].nbytes(max_rows))
    return slots, offset


def pack_error(seq: int, code: grpc.StatusCode, message: str) -> bytes:
    body = message.encode("utf-8", "replace")[: MAX_MESSAGE_BYTES - 1 - ERROR_FORMAT.size]
    return ERROR + ERROR_FORMAT.pack(seq, code.value[0]) + body


def unpack_error(message: bytes) -> tuple[int, LeafChannelError]:
    """The sequence number and the error of an ``E`` message.

    Raises:
        LeafChannelError: INTERNAL: the message is too short to be one.
    """
    if len(message) < 1 + ERROR_FORMAT.size:
        raise LeafChannelError(grpc.StatusCode.INTERNAL, f"malformed error message ({len(message)} bytes)")
    seq, value = ERROR_FORMAT.unpack_from(message, 1)
    code = next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)
    return seq, LeafChannelError(code, message[1 + ERROR_FORMAT.size :].decode("utf-8", "replace"))


def _input_region(stub, byte_size: int, device_id: int, timeout_s: float):
    """A CUDA region on ``device_id`` where it can be (CuPy here, and the server
    can open the handle: not in the process that made it, as in a co-located
    stack), else a sealed memfd (registered with the attach).

    Raises:
        grpc.RpcError: the server refused the CUDA region for another reason.
        OSError: the memfd cannot be made.
    """
    if device_id >= 0 and cupy_module() is not None:
        try:
            return CudaSharedMemoryRegion(stub, byte_size, device_id=device_id, timeout_s=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise
    return SealedMemory(byte_size)


def _metadata(stub, model: str, timeout_s: float) -> reward_pb2.ModelMetadataResponse:
    """``model``'s ModelMetadata.

    Raises:
        LeafChannelError: the server's status (NOT_FOUND for an unknown model).
    """
    try:
        return stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=model), timeout=timeout_s)
    except grpc.RpcError as exc:
        raise LeafChannelError(exc.code(), f"model metadata: {exc.details()}") from None


class LeafChannel:
    """The client's end: regions registered with the reward service, a socket
    attached to them, then :meth:`evaluate` per wave. One caller at a time
    (the search service's HandoffEvaluator serialises its host calls).

    Args:
        stub: a ``RewardServiceStub`` (registers the regions over gRPC).
        path: the server's socket (``ModelMetadata.runtime["leaf_channel"]``).
        model: the model's name; its one input is ``[N, *row]`` of any dtype,
            its outputs float32 ``[N, *row]`` with static rows.
        max_rows: the most rows one wave may carry (the regions' size).
        device_id: the reward service's CUDA device, or -1 (it runs on the
            CPU): a CUDA input region when it is >= 0, CuPy is here and the
            server can open its handle; else a sealed memfd (``kind`` "memfd").
        timeout_s: connect, register and attach deadline (s).
        meta: the model's ModelMetadata, if the caller has it (else asked here).
        cuda_outputs: with a CUDA input region, a CUDA output region too (the
            server says it takes one: ``ModelMetadata.runtime["leaf_channel_outputs"]``);
            else a sealed memfd.
        events: with two CUDA regions, offer the server CUDA events to order
            waves by (:attr:`ordered`; False: every wave synchronised).
        ready_word: with events, a ready word to order the inputs by, where
            this process can map one (False: the ``ready`` event orders them).

    Raises:
        LeafChannelError: the model's metadata, the registration, the socket
            or the attach failed: the server's status (NOT_FOUND for an
            unknown model), UNAVAILABLE when the socket does not answer.
    """

    def __init__(self, stub: reward_pb2_grpc.RewardServiceStub, path: str, model: str, max_rows: int,
                 device_id: int = -1, timeout_s: float = 5.0,
                 meta: reward_pb2.ModelMetadataResponse | None = None, cuda_outputs: bool = True,
                 events: bool = True, ready_word: bool = True):
        self.path, self.model, self.max_rows, self._timeout_s = path, model, max_rows, timeout_s
        meta = meta or _metadata(stub, model, timeout_s)
        spec = meta.inputs[0]
        self.input_name, self.input_row = spec.name, tuple(spec.shape[1:])
        self.input_dtype = tensors.numpy_dtype(spec.dtype)
        self._outputs, out_bytes = output_layout([(o.name, tuple(o.shape[1:])) for o in meta.outputs], max_rows)
        in_bytes = max_rows * int(np.prod(self.input_row, dtype=np.int64)) * self.input_dtype.itemsize
        self._sock = None
        self._inputs = self._outputs_region = None
        self._in_view, self._out_views = None, {}
        self._attached = False
        self._ready = self._done = None  # the CUDA events of an ordered channel
        self._word_region = self._word = None  # its ready word, where this process can map one
        self._marked = 0  # the last seq whose inputs' ready word or event is queued
        try:
            self._inputs = _input_region(stub, in_bytes, device_id, timeout_s)
            self.kind = self._inputs.kind
            if self.kind == "cuda" and cuda_outputs:
                self._outputs_region = CudaSharedMemoryRegion(stub, out_bytes, device_id=device_id,
                                                              client_id=self._inputs.client_id, timeout_s=timeout_s)
            else:
                self._outputs_region = SealedMemory(out_bytes, client_id=self._inputs.client_id)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._sock.settimeout(timeout_s)
            self._sock.connect(path)
            attach = {"client_id": self._inputs.client_id, "model": model, "max_rows": max_rows,
                      "input_region": self._inputs.name, "output_region": self._outputs_region.name}
            if self.device_outputs and events:
                self._word = self._ready_word() if ready_word else None
                if self._word is not None:
                    attach["ready_region"] = self._word_region.name
                else:
                    self._ready = ExportedEvent()
                    attach["ready_event"] = self._ready.handle.hex()
            memfds = [(role, r) for role, r in (("input_region", self._inputs), ("output_region", self._outputs_region),
                                                ("ready_region", self._word_region)) if isinstance(r, SealedMemory)]
            attach["memfds"] = [role for role, _ in memfds]
            socket.send_fds(self._sock, [ATTACH + json.dumps(attach).encode()], [r.fd for _, r in memfds])
            reply = self._sock.recv(MAX_MESSAGE_BYTES)
        except grpc.RpcError as exc:
            self.close()
            raise LeafChannelError(exc.code(), f"registering the regions: {exc.details()}") from None
        except OSError as exc:
            self.close()
            raise LeafChannelError(grpc.StatusCode.UNAVAILABLE, f"socket {path}: {exc}") from None
        if reply[:1] != ATTACH:
            self.close()
            if reply[:1] == ERROR:
                raise unpack_error(reply)[1]
            raise LeafChannelError(grpc.StatusCode.UNAVAILABLE, f"socket {path}: closed during the attach")
        self._attached = True
        self._open_done_event(reply[1:])
        self._seq = 0
        self._in_view = self._inputs.array(0, self.input_dtype, (max_rows, *self.input_row))
        self._out_views = {s.name: self._outputs_region.array(s.offset, np.dtype(np.float32), (max_rows, *s.row))
                           for s in self._outputs}
        # The server's time of the last wave (ms): queue and model, and its padded rows.
        self.queue_ms = self.compute_ms = 0.0
        self.bucket = 0

    def _open_done_event(self, layout: bytes) -> None:
        """Opens the server's ``done_event`` where its layout gives one (the
        channel is then ordered by events); else drops this side's.

        Raises:
            LeafChannelError: INTERNAL: a layout that is not JSON, or an event
                this process cannot open (the channel is closed).
        """
        try:
            offered = self._ready is not None or self._word is not None
            handle = json.loads(layout).get("done_event") if offered else None
            if handle is not None:
                self._done = OpenedEvent(bytes.fromhex(handle))
        except (ValueError, TypeError, AttributeError) as exc:  # the server waits for events nobody records
            self.close(wait_detached=False)
            raise LeafChannelError(grpc.StatusCode.INTERNAL, f"attach: the server's done_event: {exc}") from None
        if self._done is None:  # synchronised waves: the word (still attached there) and the event go unused
            self._ready = None
            if self._word is not None:
                self._word.close()
                self._word = None

    def _ready_word(self) -> ReadyWord | None:
        """A ready word (tandem/ready_word.py) in a sealed memfd of its own,
        registered with the attach for this channel's client; None where this
        process cannot map one for its GPU (the ``ready`` event orders the waves then).

        Raises:
            OSError: the memfd cannot be made.
        """
        self._word_region = SealedMemory(WORD_BYTES, client_id=self._inputs.client_id)
        try:
            return ReadyWord(self._word_region.array(0, np.uint64, (1,)))
        except Exception as exc:  # noqa: BLE001 - RuntimeError, CUDARuntimeError, CompileException: the event instead
            why = f"{type(exc).__name__}: {exc}"
        # Outside the except: its traceback held the view, and the region is not freed under a view.
        log.info("leaf channel: no ready word (%s); the ready event orders the waves", why)
        self._word_region.close()
        self._word_region = None
        return None

    @property
    def ordered(self) -> bool:
        """Whether waves are ordered by CUDA events (module docstring): a wave's
        inputs need only be queued on the caller's current stream before
        :meth:`evaluate_device` (no synchronisation); its outputs are in place
        when it returns, as on any channel."""
        return self._done is not None

    @classmethod
    def offered(cls, stub: reward_pb2_grpc.RewardServiceStub, model: str, max_rows: int,
                timeout_s: float = 5.0, events: bool = True, ready_word: bool = True) -> LeafChannel | None:
        """The leaf channel the reward service behind ``stub`` offers for
        ``model`` (``ModelMetadata.runtime``: its socket and device), attached
        for at most ``max_rows`` rows per wave, fewer where the model's
        ``max_batch_size`` is smaller; None when it offers none (``events``,
        ``ready_word``: as the constructor's).

        Raises:
            LeafChannelError: as the constructor.
        """
        meta = _metadata(stub, model, timeout_s)
        path = meta.runtime.get(RUNTIME_KEY, "")
        if not path:
            return None
        device = int(meta.runtime.get(f"{RUNTIME_KEY}_device", "-1"))
        if meta.max_batch_size:  # the server refuses a channel wider than the model's batches
            max_rows = min(max_rows, meta.max_batch_size)
        cuda_outputs = "cuda" in meta.runtime.get(f"{RUNTIME_KEY}_outputs", "system").split(",")
        return cls(stub, path, model, max_rows, device, timeout_s, meta, cuda_outputs, events, ready_word)

    def evaluate(self, inputs, deadline: Deadline | None = None) -> dict[str, np.ndarray]:
        """The model's outputs (name -> float32 ``[N, *row]``, copies) for
        ``inputs`` (``[N, *row]``, NumPy, or CuPy on a CUDA region; N <= max_rows).

        ``deadline``: by when the answer is due, or None (no deadline); it
        travels to the server as the time left (the wave message's ``timeout_us``).

        Raises:
            LeafChannelError: the server's status (DEADLINE_EXCEEDED when the
                deadline passed first, here or there); UNAVAILABLE once the
                connection broke, INTERNAL for a message that is not the
                protocol's (the channel is closed then, in both cases).
            ValueError: N out of 1..max_rows, or rows not of the model's
                row shape (nothing sent).
        """
        rows = len(inputs)
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"inputs: {rows} rows, the channel carries 1..{self.max_rows}")
        if tuple(inputs.shape[1:]) != self.input_row:  # else a row of another shape could broadcast into place
            raise ValueError(f"inputs: rows of shape {list(inputs.shape[1:])}, the model "
                             f"{self.model!r} takes {list(self.input_row)}")
        if self._sock is None:
            raise LeafChannelError(grpc.StatusCode.UNAVAILABLE, "leaf channel closed")
        self._inputs.write_rows(self._in_view, inputs)
        self._wave(rows, deadline)
        cuda = self._outputs_region.kind == "cuda"
        return {name: (view[:rows].get() if cuda else view[:rows].copy()) for name, view in self._out_views.items()}

    @property
    def output_rows(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, row shape) of each output, in the output region's order."""
        return [(slot.name, slot.row) for slot in self._outputs]

    @property
    def device_inputs(self):
        """The input region as a CuPy array ``[max_rows, *row]`` of the model's
        input dtype (a CUDA channel only; None otherwise): a search's kernels
        write a wave's leaves here, then call :meth:`evaluate_device`."""
        return self._in_view if self.device_outputs else None

    @property
    def device_outputs(self) -> bool:
        """Whether both regions are CUDA memory (:meth:`evaluate_device` works)."""
        return self.kind == "cuda" and self._outputs_region is not None and self._outputs_region.kind == "cuda"

    def evaluate_device(self, rows: int, deadline: Deadline | None = None) -> dict:
        """Runs rows ``[0, rows)`` already in :attr:`device_inputs` (written and
        synchronised by the caller; on an :attr:`ordered` channel, queued on
        its current stream) and returns the output region's views (name ->
        CuPy float32 ``[max_rows, *row]``, rows ``[0, rows)`` this wave's,
        valid until the next wave): no copy either way.

        Raises:
            LeafChannelError: as :meth:`evaluate`.
            ValueError: ``rows`` out of 1..max_rows, or not a CUDA channel.
        """
        if not self.device_outputs:
            raise ValueError("evaluate_device: the channel's regions are not both CUDA memory; use evaluate")
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"rows: {rows}, the channel carries 1..{self.max_rows}")
        if self._sock is None:
            raise LeafChannelError(grpc.StatusCode.UNAVAILABLE, "leaf channel closed")
        self._wave(rows, deadline)
        return self._out_views

    def inputs_written(self) -> None:
        """Marks the next wave's inputs written after the work queued on the
        current stream so far (an :attr:`ordered` channel: its ready word's
        store, or its ``ready`` event's record; else nothing): call it right
        after the kernels that write them, before any other work.

        Raises:
            LeafChannelError: UNAVAILABLE: this process's CUDA state is broken (closed then).
        """
        if self._done is None:
            return
        if self._marked == self._seq + 1:
            self._seq += 1  # a number marked and never sent (its wave failed first): never stored twice
        seq = self._seq + 1
        try:
            if self._word is not None:
                self._word.write(seq)
            else:  # on the current stream; 0: the legacy default one
                self._ready.record(cupy_module().cuda.get_current_stream().ptr)
        except Exception as exc:  # CUDARuntimeError
            self.close(wait_detached=False)
            raise LeafChannelError(grpc.StatusCode.UNAVAILABLE, f"marking the inputs written: {exc}") from None
        self._marked = seq

    def _send(self, rows: int, deadline: Deadline | None) -> None:
        """Sends the next wave's ``W`` message.

        Raises:
            LeafChannelError: UNAVAILABLE: the connection broke (closed then).
        """
        self._seq += 1
        timeout_us = 0 if deadline is None else max(int(deadline.left_s() * 1e6), 1)
        try:
            timeline.mark("wave.sent")
            self._sock.send(WAVE + WAVE_FORMAT.pack(self._seq, rows, timeout_us))
        except OSError as exc:
            self.close(wait_detached=False)
            raise LeafChannelError(grpc.StatusCode.UNAVAILABLE, f"socket {self.path}: {exc}") from None

    def _wave(self, rows: int, deadline: Deadline | None) -> None:
        """Sends one wave of ``rows`` rows (its inputs in place) and waits
        for its reply and its outputs in place; see :meth:`evaluate` for the errors."""
        ordered = self._done is not None
        if ordered and self._marked != self._seq + 1:
            self.inputs_written()
        self._send(rows, deadline)
        try:
            while True:  # answers to waves given up earlier come first: skipped
                reply = self._recv_reply(deadline)
                if not reply:
                    raise OSError("the server closed the connection")
                if reply[:1] == REPLY and len(reply) != 1 + REPLY_FORMAT.size:
                    raise LeafChannelError(grpc.StatusCode.INTERNAL, f"malformed reply ({len(reply)} bytes)")
                seq = (unpack_error(reply)[0] if reply[:1] == ERROR else
                       REPLY_FORMAT.unpack_from(reply, 1)[0] if reply[:1] == REPLY else self._seq)
                if seq == self._seq:
                    timeline.mark("wave.answered")
                    break
        except TimeoutError:
            raise LeafChannelError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer by the search's deadline") from None
        except OSError as exc:
            self.close(wait_detached=False)
            raise LeafChannelError(grpc.StatusCode.UNAVAILABLE, f"socket {self.path}: {exc}") from None
        except LeafChannelError:  # a server that does not speak the protocol: no later answer can be trusted
            self.close(wait_detached=False)
            raise
        if reply[:1] == ERROR:
            raise unpack_error(reply)[1]
        if reply[:1] != REPLY:
            self.close(wait_detached=False)
            raise LeafChannelError(grpc.StatusCode.INTERNAL, f"unexpected message kind {reply[:1]!r}")
        _, self.bucket, self.queue_ms, self.compute_ms = REPLY_FORMAT.unpack_from(reply, 1)
        if ordered:  # the outputs' copies, queued by the server before its reply
            self._wait_done(deadline)

    def _recv_reply(self, deadline: Deadline | None) -> bytes:
        """The next message from the server: read without blocking for up
        to REPLY_SPIN_S (the GIL let go between reads), then waited for.

        Raises:
            TimeoutError: none by ``deadline``. OSError: the socket broke.
        """
        if REPLY_SPIN_S > 0 and gpu.spins():
            spin_until = time.monotonic() + REPLY_SPIN_S
            self._sock.settimeout(None)  # blocking: MSG_DONTWAIT reads at once, and a send may still wait
            while True:
                try:
                    return self._sock.recv(MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass
                now = time.monotonic()
                if deadline is not None and deadline.passed(now):  # no blocking read past it
                    raise TimeoutError("no reply by the deadline")
                if now >= spin_until:
                    break
                os.sched_yield()  # the GIL goes too
        self._sock.settimeout(None if deadline is None else max(deadline.wait_s(), 1e-4))  # wait_s: a far one fits
        return self._sock.recv(MAX_MESSAGE_BYTES)

    def _wait_done(self, deadline: Deadline | None) -> None:
        """Waits for the server's ``done`` event (its wave's output copies):
        the reply came, so the wave's run is queued on the GPU, a few hundred
        µs from done; a wave that straddles the deadline is waited for up to
        ``DONE_GRACE_S`` past it rather than thrown away.

        Raises:
            LeafChannelError: DEADLINE_EXCEEDED (not done by ``deadline`` plus
                the grace, or ``timeout_s`` without one); UNAVAILABLE (the
                driver reports an error for it: the channel is closed).
        """
        limit = Deadline.after_s(self._timeout_s) if deadline is None else deadline.later_s(DONE_GRACE_S)
        try:
            ok = self._done.wait_host(limit.at)
        except Exception as exc:  # CUDARuntimeError: its process's context is gone
            self.close(wait_detached=False)
            raise LeafChannelError(grpc.StatusCode.UNAVAILABLE, f"the server's done_event: {exc}") from None
        if not ok:
            raise LeafChannelError(grpc.StatusCode.DEADLINE_EXCEEDED, "the wave's outputs not written by the deadline")

    def _wait_detached(self, limit: float) -> None:
        """Half-closes the socket and reads (and drops) what the server still
        sends until it closes its end, or until ``limit`` (monotonic s)."""
        try:
            self._sock.shutdown(socket.SHUT_WR)  # the server's thread reads the end, finishes, detaches
            while (left := limit - time.monotonic()) > 0:
                self._sock.settimeout(left)
                if not self._sock.recv(MAX_MESSAGE_BYTES):
                    return
        except OSError:  # TimeoutError (a server stuck in a run), or the connection already broken
            pass

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self, wait_detached: bool = True) -> None:
        """Closes the socket (the server unregisters the regions then) and
        frees this side's memory. Safe to call twice.

        An attached channel first waits (``DETACH_WAIT_S`` at most) for the
        server to close its end, which it does only after its last wave's
        copies and the regions' unregistration: a wave given up at its
        deadline may still be running there, and its copies must not land in
        memory this process has freed and reused. ``wait_detached=False``
        (the channel's own closes: a broken socket, a peer not speaking the
        protocol, a broken CUDA context) skips the wait."""
        if self._sock is not None:
            if self._attached and wait_detached:
                self._wait_detached(time.monotonic() + DETACH_WAIT_S)
            self._sock.close()
            self._sock = None
        if self._done is not None:  # its last wave's output copies end before the regions are freed
            done, self._done, self._ready = self._done, None, None
            try:
                done.wait_host(time.monotonic() + DETACH_WAIT_S)
                done.close()
            except Exception:  # noqa: BLE001 - a dead server's event: the regions are freed all the same
                pass
        if self._word is not None:  # its last store ends before the word is unmapped
            word, self._word = self._word, None
            try:
                word.close()
            except Exception:  # noqa: BLE001 - a broken context: the region is freed all the same
                pass
        self._in_view, self._out_views = None, {}  # views into the regions: released before they are freed
        for region in (self._inputs, self._outputs_region, self._word_region):
            if region is not None:  # attached: the server unregisters them as the socket closes
                region.close(unregister=not self._attached)
        self._inputs = self._outputs_region = self._word_region = None
