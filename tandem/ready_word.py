"""The ready word: a leaf channel's "this wave's inputs are written" signal
as a sequence number in shared host memory, written by the client's GPU
stream and waited for by the reward service.

Why not the ``ready`` CUDA event (tandem/cuda_events.py): a poll of an event
asks for its latest record, so the client may only send a wave's message
once the record that covers it is queued -- after its selection kernel.
A word carries the wave's sequence number, so the message can go first
(``LeafChannel.announce``): the reward service's socket, lease and
hand-over to its critical lane then run while the client's GPU still runs
the previous wave's model and backup and this wave's selection, instead of
after them (docs/design.md, "Announced waves").

The region (system shared memory the client registers with the reward
service like its other regions, reward_service/shared_memory.py) holds two
unsigned 64-bit words (``WORD_BYTES``):

* ``[0]``, the ready word: the client maps it into its GPU's address space
  (``cudaHostRegister``, mapped) and a store queued after the kernels that
  write a wave's inputs puts the wave's sequence number there (the driver's
  ``cuStreamWriteValue64`` where it has it, else a one-thread kernel). The
  numbers grow (one wave in flight per channel) and stay below ``MAX_SEQ``:
  the GPU's "greater or equal" is a cyclic compare.
* ``[1]``, the void word: the highest number given up -- by the client
  before its inputs were marked (:meth:`ReadyWord.cancel`, after its last
  store has landed), or by the reward service, which stopped waiting for
  them (:meth:`WordWait.abandon`). It only grows, so a wave is given up
  where it is at or past the wave's number, whatever came after. It is
  written before the ready word is raised to that number, so whoever sees
  the ready word at ``seq`` sees the void word too.

The reward service waits for the word in one of two ways. A host poll
(:meth:`WordWait.wait_host`) by the critical lane's worker before it queues
the wave's input copy; or, where its driver has stream memory operations, on
the GPU (:meth:`WordWait.wait_on_stream`: ``cuStreamWaitValue64``, "greater
or equal", on its own mapping of the region), the run queued behind the wait
at once, so the model starts as soon as the client's store lands -- no host
reaction on the GPU's path. A GPU wait is always released by the reward
service itself: :class:`WordReleaser` holds every wait until its stream is
past it, and abandons one whose word has not come within its window (void
word, then ready word raised to ``seq``; forced a window later, whatever a
client wrote), so a client that hangs, dies or writes nonsense costs the
lane that window, never the stream. The run of an abandoned wave then reads
whatever the input region holds, and its output copies are guarded
(:func:`guarded_copy`: skipped where the void word is at or past the wave's
number), so nothing lands in the client's output region, which its
previous wave's kernels may still read; the client, once the wave's
``done`` event is reached, reads the void word and gives the wave up
(:meth:`ReadyWord.given_up`). A copy may be cut short where the wave is
abandoned while it runs -- its word came at the window's very end, so the
previous wave's kernels are done -- and the client gives that wave up too.

Ordering: a store queued on a stream follows the stream's earlier kernels
(stream order; the kernel fallback adds ``__threadfence_system``); the server
reads the inputs (device to device) only after it sees the word. Host stores
of the void word, then the ready word, are seen in that order (x86-64 keeps
stores in order; the GPU reads the word after its wait is satisfied).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import numpy as np

from tandem.cuda_events import LocalEvent
from tandem.gpu import cupy_module

log = logging.getLogger(__name__)

WORD_BYTES = 16  # uint64 [2] at offset 0 of the region: the ready word, then the void word
READY, VOID = 0, 1  # their indices
# cudaHostRegister flags (CUDA Runtime API): Portable, mapped in every context of this process;
# Mapped, with a device address for the kernel.
_REGISTER_PORTABLE, _REGISTER_MAPPED = 0x01, 0x02
_SPIN_S = 0.002  # a poll yields the GIL between reads this long (s), then sleeps between them
_BACKOFF_S = 50e-6
# CU_STREAM_WAIT_VALUE_GEQ: until (int64)(word - value) >= 0, a cyclic compare (CUDA Driver API), so
# sequence numbers stay below MAX_SEQ and the host compares as the GPU does (_at_or_past).
_WAIT_GEQ = 0x0
MAX_SEQ = 1 << 62  # the reward service refuses a wave numbered past this
_NOT_SUPPORTED = 801  # CUDA_ERROR_NOT_SUPPORTED: the driver has no stream waits at all
_RELEASE_TICK_S = 0.001  # how often WordReleaser looks at the words it holds (s), while it holds any


def _at_or_past(word: int, seq: int) -> bool:
    """``word >= seq`` as ``cuStreamWaitValue64``'s GEQ compares them (cyclic, 64-bit)."""
    return (word - seq) & ((1 << 64) - 1) < 1 << 63

_SOURCE = r"""
extern "C" __global__ void tandem_ready_word(unsigned long long* word, unsigned long long seq) {
    __threadfence_system();  // what the stream's earlier kernels wrote is visible before the word
    *(volatile unsigned long long*)word = seq;
    __threadfence_system();
}

// Copies n 32-bit words from src to dst unless *void_word >= seq: the wave was given up, and dst
// (the client's output region) may still be read by its previous wave's kernels.
extern "C" __global__ void tandem_guarded_copy(unsigned int* dst, const unsigned int* src, unsigned long long n,
                                               const unsigned long long* void_word, unsigned long long seq) {
    __shared__ int skip;
    if (threadIdx.x == 0) skip = *(volatile const unsigned long long*)void_word >= seq;
    __syncthreads();
    if (skip) return;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


def _driver_function(*names: str):
    """The first of ``names`` that libcuda exports, or None (no driver here)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in names:
        fn = getattr(cuda, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None


def _stream_store():
    """The driver's stream memory operation (``cuStreamWriteValue64``, CUDA
    Driver API, "Stream Memory Operations"; its default flags order the store
    after the stream's earlier writes): one call, no kernel launch. None where
    this driver lacks it."""
    fn = _driver_function("cuStreamWriteValue64_v2", "cuStreamWriteValue64")
    if fn is None:
        return None

    def store(stream: int, address: int, seq: int) -> None:
        status = fn(stream, address, seq, 0)
        if status:
            raise RuntimeError(f"cuStreamWriteValue64: CUresult {status}")

    return store


def stream_wait():
    """``wait(stream, address, seq)``: the stream's later work waits, on the
    GPU, until the 64-bit word at device ``address`` is >= ``seq``
    (``cuStreamWaitValue64``, "greater or equal"; CUDA Driver API, "Stream
    Memory Operations"). None where this driver lacks it.

    Raises (the returned function):
        RuntimeError: the driver refused the wait (its ``status``: the CUresult).
    """
    fn = _driver_function("cuStreamWaitValue64_v2", "cuStreamWaitValue64")
    if fn is None:
        return None

    def wait(stream: int, address: int, seq: int) -> None:
        status = fn(stream, address, seq, _WAIT_GEQ)
        if status:
            exc = RuntimeError(f"cuStreamWaitValue64: CUresult {status}")
            exc.status = status
            raise exc

    return wait


def _kernel_store(cupy):
    """A one-thread kernel's store: where the driver has no stream memory operations."""
    kernel = cupy.RawKernel(_SOURCE, "tandem_ready_word")

    def store(stream: int, address: int, seq: int) -> None:  # on the current stream, which is ``stream``
        kernel((1,), (1,), (np.uint64(address), np.uint64(seq)))

    return store


def guarded_copy(cupy):
    """``copy(dst, src, nbytes, void_address, seq)``: queues on the current
    stream a device-to-device copy of ``nbytes`` (a multiple of 4) from
    device address ``src`` to ``dst``, skipped on the GPU where the void word
    at device ``void_address`` is at or past ``seq`` (an abandoned wave's outputs
    never reach the client's region). A kernel launch, in place of a
    ``cudaMemcpyAsync``; compiled and loaded here, not at a wave's copy.

    Raises (the returned function):
        ValueError: ``nbytes`` not a multiple of 4.
    """
    kernel = cupy.RawKernel(_SOURCE, "tandem_guarded_copy")
    kernel.attributes  # noqa: B018 - compiles and loads the module now

    def copy(dst: int, src: int, nbytes: int, void_address: int, seq: int) -> None:
        if nbytes % 4:
            raise ValueError(f"guarded copy of {nbytes} bytes: a multiple of 4 expected")
        n = nbytes // 4
        kernel((max(min((n + 255) // 256, 64), 1),), (256,),
               (np.uint64(dst), np.uint64(src), np.uint64(n), np.uint64(void_address), np.uint64(seq)))

    return copy


class MappedWords:
    """The region's two words (``view``: NumPy uint64 ``[2]`` over system
    shared memory of this process) registered with the driver, mapped for
    this process's GPU: ``device`` is their device address (the ready word
    at ``device``, the void word at ``device + 8``).

    Raises:
        RuntimeError: no CuPy GPU here, or the driver refuses to map the
            memory (``cudaHostRegister``).
    """

    def __init__(self, view: np.ndarray):
        cupy = cupy_module()
        if cupy is None:
            raise RuntimeError("a ready word on the GPU needs CuPy and a GPU")
        self._cupy, rt = cupy, cupy.cuda.runtime
        self.view = view
        self._host = view.ctypes.data
        try:
            rt.hostRegister(self._host, WORD_BYTES, _REGISTER_PORTABLE | _REGISTER_MAPPED)
        except rt.CUDARuntimeError as exc:
            raise RuntimeError(f"cudaHostRegister of the ready word: {exc}") from None
        try:
            self.device = rt.pointerGetAttributes(self._host).devicePointer
        except Exception:
            rt.hostUnregister(self._host)
            raise

    def unmap(self) -> None:
        """Unregisters the memory (safe to call twice); the caller has made
        sure no queued GPU work still touches it."""
        self.view = None
        if self._host:
            host, self._host = self._host, 0
            self._cupy.cuda.runtime.hostUnregister(host)


class ReadyWord(MappedWords):
    """The client's end: the region's words (``view``: NumPy uint64 ``[2]``
    over a system shared-memory region of this process), zeroed and mapped
    for its GPU.

    Raises:
        RuntimeError: no CuPy GPU here, or the driver refuses to map the
            memory (``cudaHostRegister``); the caller then orders waves by
            the ``ready`` event instead.
    """

    def __init__(self, view: np.ndarray):
        view[:] = 0
        super().__init__(view)
        cupy = self._cupy
        self._stream = cupy.cuda.get_current_stream()  # of the last store: held, so close may synchronise it
        try:
            self._store = _stream_store()
            try:
                self.write(0)  # the driver takes stream memory operations on this device
            except RuntimeError:
                self._store = None
            if self._store is None:
                self._store = _kernel_store(cupy)
                self.write(0)  # its module loads now, not behind the kernels of a wave
            self._stream.synchronize()
        except Exception:
            self.unmap()
            raise

    def write(self, seq: int) -> None:
        """Queues the store of ``seq`` on the current stream, after the work
        queued there so far (the kernels that write the wave's inputs).

        Raises:
            RuntimeError: the driver refused the store.
        """
        self._stream = self._cupy.cuda.get_current_stream()
        self._store(self._stream.ptr, self.device, seq)

    def cancel(self, seq: int) -> None:
        """Tells the server that wave ``seq`` will have no inputs (no store for
        ``seq`` may be queued): the last store queued is waited for first (a
        late store of an earlier number would lower the word), then host
        stores of the void word, then the ready word, release its wait at once."""
        if self._stream is not None:
            self._stream.synchronize()
        self.view[VOID] = max(int(self.view[VOID]), seq)
        self.view[READY] = seq

    def given_up(self, seq: int) -> bool:
        """Whether wave ``seq`` was given up -- by this client, or by the
        server, which abandoned its wait (its outputs, if its ``done`` came,
        were not written). The void word only grows: a later wave given up
        too still says so."""
        return int(self.view[VOID]) >= seq

    def close(self) -> None:
        """Waits for the last store (its stream synchronised: this object holds
        that stream, so it outlives its user's ``with``), then unmaps the words
        and drops the view, so its region may be freed (safe to call twice)."""
        stream, self._stream = self._stream, None
        try:
            if stream is not None and self._host:
                stream.synchronize()
        finally:
            self.unmap()


class WordWait:
    """The server's end for one wave: waits for ``words[READY] >= seq``
    (``words``: NumPy uint64 ``[2]``, this process's view of the client's
    region); an object a batcher request carries as its ``events.ready``
    (reward_service/session.py's ``_wait_inputs`` polls it, or has the run's
    stream wait for it on the GPU where ``ready_on_gpu``).

    ``after``: this channel's ``done`` event, whose latest record is the
    previous wave's (None: no previous wave). While it is pending the client
    cannot have written this wave's inputs (it waits for those outputs
    first), so the client gets ``window`` s from the moment the wait first
    sees it done, whatever limit the caller set (a batch's limit is shared,
    and an announced wave's message comes while its previous outputs are
    still being made); never past ``hard_limit`` (``time.monotonic()`` s,
    the wave's deadline).

    ``mapped``: the server's :class:`MappedWords` of the region and its
    :class:`WordReleaser`, ``(mapped, releaser)``, for a wait on the GPU
    (None: host polls only). ``words`` must then be ``mapped.view``, writable.
    """

    def __init__(self, words: np.ndarray, seq: int, after=None, window: float = 0.005,
                 hard_limit: float | None = None, mapped: tuple | None = None):
        self.words, self.seq, self.after, self.window, self.hard_limit = words, seq, after, window, hard_limit
        self._mapped = mapped
        self.ready_on_gpu = mapped is not None
        self._window_end = None  # monotonic s: the client's window, once its previous outputs are seen done
        self.passed = None  # a GPU wait's: an event recorded right after it (query(): the stream is past it)
        self.abandoned = False

    @property
    def output_guard(self) -> tuple[int, int] | None:
        """(the void word's device address, seq) for :func:`guarded_copy`,
        where the words are mapped for this GPU; else None."""
        return None if self._mapped is None else (self._mapped[0].device + 8 * VOID, self.seq)

    def ready(self) -> bool | None:
        """True: the inputs are written; False: the wave was given up (cancelled,
        abandoned: the void word at or past ``seq``) or superseded; None: not yet."""
        if int(self.words[VOID]) >= self.seq:
            return False
        word = int(self.words[READY])
        if not _at_or_past(word, self.seq):
            return None
        return word == self.seq

    def wait_host(self, deadline: float | None) -> bool:
        """True once the ready word holds ``seq``; False once the wave was
        given up or superseded, or once both ``deadline`` (``time.monotonic()``
        s; None: none) and the client's window after its previous outputs
        have passed. Between reads the GIL is let go (``os.sched_yield``): the
        wait may last a previous wave's model run, and the service's other
        threads run on."""
        spin_until = time.monotonic() + _SPIN_S
        while True:
            state = self.ready()
            if state is not None:
                return state
            now = time.monotonic()
            if self.expired(now) and (deadline is None or now >= deadline):
                return False
            if now < spin_until:
                os.sched_yield()  # the GIL goes too; time.sleep(0) would wait out the timer slack (~50 µs)
            else:
                time.sleep(_BACKOFF_S)

    def expired(self, now: float) -> bool:
        """Whether the client's time for its inputs is over at ``now``
        (monotonic s): its window after its previous outputs, or the hard limit."""
        if self.hard_limit is not None and now >= self.hard_limit:
            return True
        if self._window_end is None:
            if self.after is not None and not self._previous_done():
                return False
            self._window_end = now + self.window
        return now >= self._window_end

    def wait_on_stream(self, stream_ptr: int) -> None:
        """Makes the work queued on ``stream_ptr`` from now on wait, on the
        GPU, for the ready word, and hands the wait to the releaser, which
        abandons it once :meth:`expired`. The host goes on at once.

        ``after`` becomes an event recorded on the stream just before the
        wait (the releaser's mark): the channel's ``done`` gets this wave's
        own record before the wait can end, so it cannot say when the
        previous outputs were done.

        Raises:
            RuntimeError: the driver refused the wait (none is queued then).
        """
        mapped, releaser = self._mapped
        releaser.wait(stream_ptr, mapped.device + 8 * READY, self)

    def abandon(self, force: bool = False) -> None:
        """Gives the wave up on the server's side: the void word raised to
        ``seq``, then the ready word, where it is below ``seq`` (a GPU wait
        on it ends; the client, or a late store of its own, finds the void
        word); ``force``: set to ``seq`` whatever it holds (a word no
        store of the protocol wrote)."""
        if int(self.words[VOID]) < self.seq:
            self.words[VOID] = self.seq
        if force or not _at_or_past(int(self.words[READY]), self.seq):
            self.words[READY] = self.seq

    def _previous_done(self) -> bool:
        try:
            return self.after.query()
        except Exception:  # noqa: BLE001 - CUDARuntimeError: nothing to wait for any more
            return True


def _stream_mark(stream_ptr: int) -> LocalEvent:
    """An event recorded on ``stream_ptr`` after the work queued there so far."""
    mark = LocalEvent()
    mark.record(stream_ptr)
    return mark


class WordReleaser:
    """The reward service's guarantee that every GPU wait on a ready word ends:
    one thread that looks at the waits queued (:meth:`WordWait.wait_on_stream`)
    every ``_RELEASE_TICK_S`` while it holds any. A wait is held until the
    stream is past it (its ``passed`` event, recorded right after it): a
    host read of the word alone cannot say so, since the word may still
    change before the GPU looks. One not past once :meth:`WordWait.expired`
    is abandoned (:meth:`WordWait.abandon`), and again, forced, a window
    later: whatever a client writes into its word, the stream goes on.
    Idle, the thread sleeps on its condition. ``abandoned`` counts the waves
    it gave up; ``on_abandon(waiter)`` is called for each (outside the lock).

    Invariants: a wait is registered under the lock before its
    ``cuStreamWaitValue64`` is queued, so no queued wait is ever unknown to
    the releaser; a wait whose registration or driver call failed is not
    held (the wave is polled on the host); :meth:`release` abandons a
    connection's waits before its region is unmapped; a driver without
    stream waits (CUDA_ERROR_NOT_SUPPORTED) turns them off for good, any
    other refusal costs one wave's host poll.
    """

    def __init__(self, wait=None, mark=None, on_abandon=None):
        # Stand-ins for tests without a GPU: ``wait`` for the driver's call, ``mark(stream)`` for
        # an event recorded on the stream (an object with ``query()``).
        self._wait = wait or stream_wait()
        self._mark = mark or _stream_mark
        self._on_abandon = on_abandon
        self._cond = threading.Condition()
        self._pending: list[WordWait] = []  # guarded by _cond
        self.abandoned = 0
        self._closed = False
        self._thread = None  # started at the first wait

    @property
    def available(self) -> bool:
        """Whether this driver has stream waits on a word."""
        return self._wait is not None

    def wait(self, stream_ptr: int, address: int, waiter: WordWait) -> None:
        """Queues ``stream_ptr``'s wait for ``waiter``'s word at device
        ``address``, between two marks: ``waiter.after``, the work before it
        (its window starts once that is done), and ``waiter.passed``.

        Raises:
            RuntimeError: the releaser is closed, or its thread cannot run,
                or the driver refused the wait (nothing is held then).
        """
        waiter.after = self._mark(stream_ptr)  # the previous outputs: what came before the wait
        with self._cond:
            if self._closed:
                raise RuntimeError("the ready-word releaser is closed")
            if self._wait is None:
                raise RuntimeError("no stream waits on a ready word here")
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._run, name="ready-word-releaser", daemon=True)
                thread.start()  # raises RuntimeError where no thread can start: nothing is held
                self._thread = thread
            self._pending.append(waiter)
            try:
                self._wait(stream_ptr, address, waiter.seq)
            except BaseException as exc:
                self._pending.remove(waiter)
                if getattr(exc, "status", None) == _NOT_SUPPORTED:  # every later wave is polled instead
                    log.warning("leaf channel: %s; ready words are polled on the host from now on", str(exc))
                    self._wait = None
                raise
            self._cond.notify()
        waiter.passed = self._mark(stream_ptr)  # the worker queues nothing on this stream in between

    def release(self, words: np.ndarray | None = None) -> None:
        """Abandons at once every wait held on ``words`` (a connection's
        region, before it is unmapped; None: every wait), forced."""
        with self._cond:
            given_up = [w for w in self._pending if words is None or w.words is words]
            for w in given_up:
                self._abandon(w, force=True)
            self._pending = [w for w in self._pending if w not in given_up]
        self._report(given_up)

    def close(self) -> None:
        """Abandons every wait held and stops the thread; later waits are refused."""
        with self._cond:
            self._closed = True
            given_up = list(self._pending)
            for w in given_up:
                self._abandon(w, force=True)
            self._pending = []
            self._cond.notify()
        self._report(given_up)
        if self._thread is not None:
            self._thread.join(5.0)

    def _abandon(self, w: WordWait, force: bool = False) -> None:
        if not w.abandoned:
            if w.ready() is not None and not force:
                return  # the word came: the GPU is about to pass the wait
            w.abandoned = True
            self.abandoned += 1
        w.abandon(force)

    def _report(self, waiters) -> None:
        for w in waiters:
            if w.abandoned and self._on_abandon is not None:
                self._on_abandon(w)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                if not self._pending:
                    self._cond.wait()
                    continue
                given_up = []
                try:
                    given_up = self._tick(time.monotonic())
                except Exception:  # noqa: BLE001 - a query that failed: logged, the loop goes on
                    log.exception("ready-word releaser: a look at the pending waits failed")
                self._cond.wait(_RELEASE_TICK_S)
            self._report(given_up)

    def _tick(self, now: float) -> list[WordWait]:
        """One look at every pending wait (under the lock): drops those the
        stream is past; abandons those expired, again forced a window later.
        Returns the waits given up in this look."""
        keep, given_up = [], []
        for w in self._pending:
            if w.passed is not None and _passed(w.passed):
                continue
            keep.append(w)
            if w.expired(now):  # a window later and still not past: forced, whatever the word says
                first = not w.abandoned
                self._abandon(w, force=w.expired(now - w.window))
                if first and w.abandoned:
                    given_up.append(w)
        self._pending = keep
        return given_up


def _passed(event) -> bool:
    try:
        return event.query()
    except Exception:  # noqa: BLE001 - CUDARuntimeError: a broken context runs nothing any more
        return True
