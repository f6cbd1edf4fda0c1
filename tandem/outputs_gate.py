"""The outputs' gate: a search's stream holds its backup on the GPU until
the reward service's stream has written the wave's outputs, with no host
between the two.

Why: across processes, the search's host waited for the reward service's
``done`` event (tandem/cuda_events.py) and only then queued the backup; the
GPU idled 23-34 µs a wave between the outputs' copies and the backup, the
host's poll and launch (docs/benchmarks.md, "The outputs' gate"). In one
process the stream waits on the event itself (1.6 µs).

How, each side's part:

* the **done word**: a uint64 at the end of the client's CUDA output region,
  right after the outputs (64-byte aligned). The reward service's stream
  stores the wave's sequence number there after its output copies
  (``cuStreamWriteValue64``, ordered after them: tandem/ready_word.py's
  ``mapped_store``), before it records ``done``.
* the **gate**: a one-thread kernel on the search's stream, queued at the
  wave's reply (before its outputs exist) ahead of the backup. It reads the
  done word until it holds the wave's number, then writes OPEN to the
  search's verdict word (int32, device memory) and ends; the backup kernel
  reads the verdict, and backs the wave up (OPEN) or undoes it (CLOSED).
* the **cancel word** and the **report word**: two uint64 of this
  process's pinned, mapped host memory, a pair per channel
  (:class:`GateWords`). The channel's host still waits for ``done`` after
  the backup and the next selection are queued; where that wait fails (the
  deadline; the reward service died), it stores the wave's token in the
  cancel word and the gate closes at once. A gate also closes by itself
  ``timeout_ns`` after it started (``%globaltimer``), so the stream never
  waits for good, whatever the host does. Either way the gate writes
  ``token * 2 + verdict`` to the report word, and the host counts the wave
  by that (:meth:`GateWords.verdict`), never by its own wait: a done word
  that lands just after the host gave up still opens the gate, and a host
  whose wait succeeded after the gate's time ran out must not count a wave
  that was undone.

Not a stream wait (``cudaStreamWaitEvent`` on the peer's event, or
``cuStreamWaitValue64``): a waiting stream cannot be released by this
process if the peer dies with its record pending, and under MPS such a wait
held up the other process's work (docs/design.md, "Announced waves"). The
gate is a running kernel, which any process's kernels run beside, and which
the host can always close. It runs only where both services are clients of
one MPS server (:func:`enabled`): without MPS, the contexts time-slice, and
a spinning kernel would hold the GPU from the reward service's model.

Tokens: a pair of words is reused by a later channel of this process once
its channel closed, the longest-free pair first (the pinned block is never
freed: a gate may still read it), so a gate waits for a process-wide unique
token there, never a channel's sequence number.
"""
from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from tandem.gpu import cupy_module

OPEN, CLOSED = 1, 0  # the verdict word's values (search.cu: GATE_OPEN)
WORD_BYTES = 8
PAIRS = 4096  # pairs of words in this process's pinned block (64 KiB): channels open at once
ENV = "TANDEM_OUTPUTS_GATE"  # "1": on, "0": off, unset: where this process is an MPS client

_SOURCE = r"""
extern "C" __global__ void tandem_outputs_gate(const unsigned long long* done, unsigned long long seq,
                                               const unsigned long long* cancel, unsigned long long token,
                                               long long timeout_ns, int* verdict, unsigned long long* report) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  int open = 0;
  while (true) {
    if (*(volatile const unsigned long long*)done == seq) { open = 1; break; }
    if (*(volatile const unsigned long long*)cancel == token) break;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if ((long long)(now - start) > timeout_ns) break;
    __nanosleep(200);
  }
  __threadfence();  // the outputs, written before the done word, are read after the verdict
  *(volatile int*)verdict = open;
  __threadfence_system();
  *(volatile unsigned long long*)report = token * 2 + open;
}
"""


def enabled() -> bool:
    """Whether waves are gated: ``TANDEM_OUTPUTS_GATE`` 1 or 0, else where
    this process is a client of an MPS server (``tandem up`` and the
    benchmarks' ``--mps`` set ``CUDA_MPS_PIPE_DIRECTORY`` for both services
    only then: scheduler/mps.py)."""
    value = os.environ.get(ENV, "")
    if value in ("0", "1"):
        return value == "1"
    return bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))


@dataclass(frozen=True)
class Gate:
    """One wave's gate: what :func:`queue` needs. Device addresses (int):
    ``done``, the channel's done word; ``cancel`` and ``report``, its
    GateWords'. ``seq``: the wave's number; ``token``: what a cancel
    stores; ``timeout_ns``: when the gate closes by itself (ns after it
    starts)."""

    done: int
    seq: int
    cancel: int
    report: int
    token: int
    timeout_ns: int


class GateWords:
    """A channel's pair of words in this process's pinned block: the cancel
    word (``cancel_address`` for the GPU, :meth:`cancel` from the host) and
    the report word (``report_address``, :meth:`verdict`);
    :meth:`release` once its channel closed.

    Raises:
        RuntimeError: no CuPy GPU here, or every pair is taken.
    """

    _lock = threading.Lock()
    _block = None  # (host view uint64 [PAIRS, 2], device address of word 0)
    _free: collections.deque[int] = collections.deque()
    _tokens = itertools.count(1)

    def __init__(self):
        with GateWords._lock:
            if GateWords._block is None:
                GateWords._block = _pinned_block()
                GateWords._free.extend(range(PAIRS))
            if not GateWords._free:
                raise RuntimeError(f"all {PAIRS} pairs of gate words are taken")
            self._index = GateWords._free.popleft()  # the longest free: a late gate of its last channel is done
        view, base = GateWords._block
        self._view = view[self._index]
        self.cancel_address = base + self._index * 2 * WORD_BYTES
        self.report_address = self.cancel_address + WORD_BYTES

    @staticmethod
    def token() -> int:
        """A token no gate of this process waited for before."""
        with GateWords._lock:
            return next(GateWords._tokens)

    def cancel(self, token: int) -> None:
        """Closes the gate that waits for ``token``: a host store, seen by the
        gate's next read."""
        self._view[0] = token

    def verdict(self, token: int, limit: float) -> int | None:
        """The verdict of the gate of ``token`` (OPEN or CLOSED), read from the
        report word once the gate wrote it; None if it did not by ``limit``
        (``time.monotonic()`` s). The thread yields between reads."""
        while True:
            report = int(self._view[1])
            if report >> 1 == token:
                return report & 1
            if time.monotonic() >= limit:
                return None
            os.sched_yield()

    def release(self) -> None:
        """Gives the pair back for a later channel (safe to call twice)."""
        if self._index is not None:
            with GateWords._lock:
                GateWords._free.append(self._index)
            self._index = None


def _pinned_block():
    """PAIRS pairs of words of pinned host memory mapped for the GPU, zeroed:
    (host view uint64 [PAIRS, 2], device address). Never freed: a gate may
    read any word."""
    cupy = cupy_module()
    if cupy is None:
        raise RuntimeError("the outputs' gate needs CuPy and a GPU")
    import cupyx  # noqa: PLC0415 - with CuPy

    view = cupyx.empty_pinned((PAIRS, 2), np.uint64)  # mapped for the GPU too (unified addressing)
    view[:] = 0
    return view, cupy.cuda.runtime.pointerGetAttributes(view.ctypes.data).devicePointer


_kernels: dict[int, object] = {}  # device id -> the gate's kernel, compiled


def load():
    """The gate's kernel on the current device, compiled and loaded at the
    first call (a channel's attach), not at its first wave.

    Raises:
        RuntimeError: no CuPy GPU here. cupy.cuda.compiler.CompileException.
    """
    cupy = cupy_module()
    if cupy is None:
        raise RuntimeError("the outputs' gate needs CuPy and a GPU")
    device = cupy.cuda.Device().id
    kernel = _kernels.get(device)
    if kernel is None:
        kernel = cupy.RawKernel(_SOURCE, "tandem_outputs_gate")
        kernel.compile()
        _kernels[device] = kernel
    return kernel


def queue(gate: Gate, verdict_address: int) -> None:
    """Queues ``gate``'s kernel on the current stream: the stream's later
    work runs once the wave's outputs are written (OPEN at
    ``verdict_address``, int32 device memory) or the gate closed (CLOSED);
    the gate reports its verdict to the host too (GateWords.verdict).

    Raises:
        cupy.cuda.driver.CUDADriverError: the launch failed.
    """
    u64 = np.uint64
    load()((1,), (1,), (u64(gate.done), u64(gate.seq), u64(gate.cancel), u64(gate.token),
                        np.int64(gate.timeout_ns), u64(verdict_address), u64(gate.report)))
