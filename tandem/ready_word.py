"""The ready word: a leaf channel's "this wave's inputs are written" signal
as a sequence number in shared host memory, written by the client's GPU
stream and read by the reward service's host.

Why not only the ``ready`` CUDA event (tandem/cuda_events.py): a poll of
an event asks for its latest record, whichever wave queued it; a word
carries the wave's sequence number, so the server knows whose inputs are
written, polls host memory rather than a peer's event, and a later number
tells it a wave was superseded (docs/design.md, "The leaf channel").

The word is an unsigned 64-bit integer at offset 0 of a system shared-memory
region the client registers with the reward service like its other regions
(reward_service/shared_memory.py). The client maps it into its GPU's
address space (``cudaHostRegister``, mapped) and a store queued after the
kernels that write a wave's inputs puts the wave's sequence number there
(the driver's ``cuStreamWriteValue64`` where it has it, else a
one-thread kernel); the server polls it on the host (:class:`WordWait`).

Ordering: a kernel's stores to mapped host memory follow its stream's
earlier kernels (stream order), and ``__threadfence_system`` orders the
word after them for any observer; the server reads the inputs (device to
device) only after it sees the word. A peer that dies leaves the word
unwritten: the server's poll ends at its limit, as an event's does.
"""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np

from tandem import gpu
from tandem.gpu import cupy_module

WORD_BYTES = 8  # uint64 at offset 0 of the region
# cudaHostRegister flags (CUDA Runtime API): Portable, mapped in every context of this process;
# Mapped, with a device address for the kernel.
_REGISTER_PORTABLE, _REGISTER_MAPPED = 0x01, 0x02
_SPIN_S = 0.002  # a poll yields the GIL between reads this long (s), then sleeps between them
_BACKOFF_S = 50e-6

_SOURCE = r"""
extern "C" __global__ void tandem_ready_word(unsigned long long* word, unsigned long long seq) {
    __threadfence_system();  // what the stream's earlier kernels wrote is visible before the word
    *(volatile unsigned long long*)word = seq;
    __threadfence_system();
}
"""


def _stream_store():
    """The driver's stream memory operation (``cuStreamWriteValue64``, CUDA
    Driver API, "Stream Memory Operations"; its default flags order the store
    after the stream's earlier writes): one call, no kernel launch. None where
    this driver lacks it."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        fn = getattr(cuda, "cuStreamWriteValue64_v2", None) or cuda.cuStreamWriteValue64
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def store(stream: int, address: int, seq: int) -> None:
        status = fn(stream, address, seq, 0)
        if status:
            raise RuntimeError(f"cuStreamWriteValue64: CUresult {status}")

    return store


def _kernel_store(cupy):
    """A one-thread kernel's store: where the driver has no stream memory operations."""
    kernel = cupy.RawKernel(_SOURCE, "tandem_ready_word")

    def store(stream: int, address: int, seq: int) -> None:
        with cupy.cuda.ExternalStream(stream):  # ``stream``, whatever this thread's current one is
            kernel((1,), (1,), (np.uint64(address), np.uint64(seq)))

    return store


_chosen: dict[int, object] = {}  # device id -> the store mapped_store chose there


def mapped_store(cupy, device_address: int):
    """``store(stream, address, seq)``, the store of a uint64 at a device
    address (mapped host memory) queued on a stream after its earlier work: the
    driver's stream memory operation where this device takes it, else a
    one-thread kernel. The first call on a device chooses with a
    store of 0 at ``device_address`` (synchronised, so later ones cost no
    module load); later calls reuse the choice and wait for nothing.

    Raises:
        RuntimeError: the driver refused both.
    """
    device = cupy.cuda.Device().id
    if device in _chosen:
        return _chosen[device]
    stream = cupy.cuda.get_current_stream()
    store = _stream_store()
    if store is not None:
        try:
            store(stream.ptr, device_address, 0)  # the driver takes stream memory operations on this device
        except RuntimeError:
            store = None
    if store is None:
        store = _kernel_store(cupy)
        store(stream.ptr, device_address, 0)  # its module loads now, not behind the kernels of a wave
    stream.synchronize()
    _chosen[device] = store
    return store


class ReadyWord:
    """The client's end: the word of ``view`` (NumPy uint64 ``[1]`` over a
    system shared-memory region of this process) mapped for its GPU.

    Raises:
        RuntimeError: no CuPy GPU here, or the driver refuses to map the
            memory (``cudaHostRegister``); the caller then orders waves by
            the ``ready`` event instead.
    """

    def __init__(self, view: np.ndarray):
        cupy = cupy_module()
        if cupy is None:
            raise RuntimeError("a ready word needs CuPy and a GPU")
        self._cupy, rt = cupy, cupy.cuda.runtime
        self.view = view
        view[0] = 0
        self._host = view.ctypes.data
        self._stream = cupy.cuda.get_current_stream()  # of the last store: held, so close may synchronise it
        try:
            rt.hostRegister(self._host, WORD_BYTES, _REGISTER_PORTABLE | _REGISTER_MAPPED)
        except rt.CUDARuntimeError as exc:
            raise RuntimeError(f"cudaHostRegister of the ready word: {exc}") from None
        try:
            self._device = rt.pointerGetAttributes(self._host).devicePointer
            self._store = mapped_store(cupy, self._device)
        except Exception:
            rt.hostUnregister(self._host)
            raise

    def write(self, seq: int) -> None:
        """Queues the store of ``seq`` on the current stream, after the work
        queued there so far (the kernels that write the wave's inputs).

        Raises:
            RuntimeError: the driver refused the store.
        """
        self._stream = self._cupy.cuda.get_current_stream()
        self._store(self._stream.ptr, self._device, seq)

    def close(self) -> None:
        """Waits for the last store (its stream synchronised: this object holds
        that stream, so it outlives its user's ``with``), then unmaps the word
        and drops the view, so its region may be freed (safe to call twice)."""
        self.view = None
        if self._host:
            host, self._host = self._host, 0
            stream, self._stream = self._stream, None
            try:
                stream.synchronize()
            finally:
                self._cupy.cuda.runtime.hostUnregister(host)


class WordWait:
    """The server's end for one wave: polls ``view`` (NumPy uint64 ``[1]``
    over the client's region) for ``seq``; an object a batcher request
    carries as its ``events.ready`` (reward_service/session.py polls it).

    ``after``: this channel's ``done`` event, whose latest record is the
    previous wave's (None: no previous wave). While it is pending the client
    cannot have written this wave's inputs (it waits for those outputs
    first), so the client gets ``window`` s from the moment the poll first
    sees it done, whatever limit the caller set (a batch's limit is shared);
    never past ``hard_limit`` (``time.monotonic()`` s, the wave's deadline).
    """

    def __init__(self, view: np.ndarray, seq: int, after=None, window: float = 0.005,
                 hard_limit: float | None = None):
        self.view, self.seq, self.after, self.window, self.hard_limit = view, seq, after, window, hard_limit

    def wait_host(self, deadline: float | None) -> bool:
        """True once the word holds ``seq``; False once it holds a later
        number (the wave was superseded), or once both ``deadline`` (``time.monotonic()``
        s; None: none) and the client's window after its previous outputs have
        passed. Between reads the GIL is let go (``os.sched_yield``): the wait
        may last a previous wave's model run, and the service's other threads
        run on."""
        start = time.monotonic()
        spin_until = start + (_SPIN_S if gpu.spins() else 0.0)
        window_end = None if self.after is not None else start + self.window
        while True:
            word = int(self.view[0])
            if word == self.seq:
                return True
            if word > self.seq:
                return False
            now = time.monotonic()
            if window_end is None and self._previous_done():
                window_end = now + self.window
            if self.hard_limit is not None and now >= self.hard_limit:
                return False
            if window_end is not None and now >= window_end and (deadline is None or now >= deadline):
                return False
            if now < spin_until:
                os.sched_yield()  # the GIL goes too; time.sleep(0) would wait out the timer slack (~50 µs)
            else:
                time.sleep(_BACKOFF_S)

    def _previous_done(self) -> bool:
        try:
            return self.after.query()
        except Exception:  # noqa: BLE001 - CUDARuntimeError: nothing to wait for any more
            return True
