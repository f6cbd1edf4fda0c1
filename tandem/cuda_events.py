"""CUDA events shared between two processes: how a leaf channel orders a
wave's GPU work across the search and reward services without a
synchronisation of either side's stream.

A leaf channel with events has two, one made by each side and exported by
its IPC handle (``cudaIpcGetEventHandle``, 64 bytes; opened by the other
process with ``cudaIpcOpenEventHandle``):

* ``ready``, the client's: recorded on its stream after the kernels that
  write a wave's inputs, just before the wave's message is sent; the
  server's critical lane waits for it (at most a few ms) before its copy
  reads them.
* ``done``, the server's: recorded on its stream after the copies that write
  the wave's outputs, just before the reply is sent; the client waits for it
  before its kernels read them.

The waits are host polls (``cudaEventQuery``) bounded by the wave's
deadline, not ``cudaStreamWaitEvent``: a stream waiting on another
process's event hangs for good if that process dies before its record
completes, and a killed peer must cost one wave, not a service (a client's
fault never stalls the server). The poll
costs little: each side reaches its wait after its own work of a socket
hop and more (~100 µs), by which time the other's kernels have mostly run.

A record is made before the socket message that lets the other side wait,
and a poll asks for the latest record, so each wait sees its wave's record
and no later one (one wave is in flight per channel). Events are made with
``cudaEventDisableTiming | cudaEventInterprocess``, as IPC requires (CUDA
Runtime API, "Event Management" and "Interprocess Communication").
"""
from __future__ import annotations

import time

from tandem import gpu
from tandem.gpu import cupy_module

IPC_EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
_SPIN_S = 0.002  # a wait polls without yielding this long (s): a wave's GPU work is ~0.1-0.5 ms
_BACKOFF_S = 50e-6  # then sleeps this long between polls (s)
_NOT_READY = 600  # cudaErrorNotReady: queried before its record completed (cudaEventQuery)


class _Event:
    """One CUDA event (``ptr``: its cudaEvent_t) and what either side does with it."""

    ptr: int = 0

    def __init__(self):
        cupy = cupy_module()
        if cupy is None:
            raise RuntimeError("CUDA events need CuPy and a GPU")
        self._cupy, self._rt = cupy, cupy.cuda.runtime

    def record(self, stream_ptr: int) -> None:
        """Records the event after the work queued on ``stream_ptr`` so far."""
        self._rt.eventRecord(self.ptr, stream_ptr)

    def wait_host(self, deadline: float | None) -> bool:
        """Polls until the event's latest record has completed (True) or
        ``deadline`` (``time.monotonic()`` s; None: none) has passed (False).

        Raises:
            cupy.cuda.runtime.CUDARuntimeError: the driver reports an error
                for the event (e.g. its process's context is gone).
        """
        spin_until = time.monotonic() + (_SPIN_S if gpu.spins() else 0.0)
        while not self.query():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if now >= spin_until:  # longer than a wave's GPU work: let the process's other threads run
                time.sleep(_BACKOFF_S)
        return True

    def query(self) -> bool:
        """Whether the event's latest record has completed (cudaEventQuery).

        Raises:
            cupy.cuda.runtime.CUDARuntimeError: as :meth:`wait_host`.
        """
        try:
            status = self._rt.eventQuery(self.ptr)  # CuPy returns the status, not-ready included
        except self._rt.CUDARuntimeError as exc:
            status = exc.status
        if status in (0, _NOT_READY):
            return status == 0
        raise self._rt.CUDARuntimeError(status)


class ExportedEvent(_Event):
    """An event of this process that another may open by :attr:`handle` (bytes).

    Raises:
        RuntimeError: no CuPy GPU here.
    """

    def __init__(self):
        super().__init__()
        self._event = self._cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
        self.ptr = self._event.ptr
        self.handle = bytes(self._rt.ipcGetEventHandle(self.ptr))


class OpenedEvent(_Event):
    """Another process's event, opened from its IPC handle; :meth:`close` releases it.

    Raises:
        ValueError: not a handle's size, or the driver cannot open it (stale:
            its process ended; made in this very process; not an event handle).
        RuntimeError: no CuPy GPU here.
    """

    def __init__(self, handle: bytes):
        super().__init__()
        if len(handle) != IPC_EVENT_HANDLE_BYTES:
            raise ValueError(f"{len(handle)} bytes; a cudaIpcEventHandle_t has {IPC_EVENT_HANDLE_BYTES}")
        try:
            self.ptr = self._rt.ipcOpenEventHandle(handle)
        except self._rt.CUDARuntimeError as exc:
            raise ValueError(f"cannot be opened ({exc}): stale (its process ended), made by this process, "
                             "or not a CUDA IPC event handle") from None

    def close(self) -> None:
        """Releases the event (safe to call twice)."""
        if self.ptr:
            self._rt.eventDestroy(self.ptr)
            self.ptr = 0


class LocalEvent(_Event):
    """An event of this process for this process alone (in-process waves,
    tandem/in_process.py): no IPC handle, and a stream may wait for it on
    the GPU, since no other process records it.

    Raises:
        RuntimeError: no CuPy GPU here.
    """

    def __init__(self):
        super().__init__()
        self._event = self._cupy.cuda.Event(block=False, disable_timing=True)
        self.ptr = self._event.ptr

    def wait_on_stream(self, stream_ptr: int) -> None:
        """Makes the work queued on ``stream_ptr`` from now on wait, on the
        GPU, for the event's latest record (``cudaStreamWaitEvent``); the host
        goes on at once."""
        self._rt.streamWaitEvent(stream_ptr, self.ptr, 0)
