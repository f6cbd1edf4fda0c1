"""Worker processes of one server: copies of it in processes of their own
that share its address, so that more than one interpreter serves its calls.

A Python gRPC server spends about a millisecond of CPU on each call, under
one interpreter lock: one process serves about a thousand calls a second
(docs/benchmarks.md, "Many engines"). With ``workers`` > 1 the first process
binds the address with ``SO_REUSEPORT`` and starts ``workers - 1`` more
(multiprocessing's spawn, which a CUDA context survives), each binding the
same port; the kernel spreads new connections over them, and a connection
stays with one worker for its life (gRPC's own multiprocessing example does
the same).

Invariants:

* the address is checked free (a plain bind, no ``SO_REUSEPORT``) before the
  first worker binds it: a stale server cannot share the port unseen;
* a worker dies with the first process (``PR_SET_PDEATHSIG`` and a watch on
  its parent); a worker that dies unasked is started again by the first
  process after a growing delay (:class:`Restarts`) while the others serve
  on (its connections' calls fail UNAVAILABLE, and their clients reconnect
  to a live worker), and one that keeps dying (``MAX_IN_A_ROW`` deaths in a
  row, each within ``WINDOW_S`` of its start) stops the first process (exit
  1), so that ``tandem up`` restarts the whole server under its policy;
* stopping the first process stops every worker (SIGTERM; each drains as a
  server does), then it exits;
* workers start one after another, each once the last serves: two warming
  up at once would time cuDNN's candidate kernels against each other (the
  reason ``tandem up`` starts its servers in order);
* worker 0 (the first process) serves the metrics endpoint, and it serves
  every worker's metrics merged: prometheus-client's multiprocess mode
  (tandem/multiprocess_metrics.py; ``tandem serve`` chooses it before
  anything imports prometheus-client), counters and histograms summed over
  the workers, a dead one's counts kept, gauges as each one's
  ``multiprocess_mode`` says; a dead worker's ``live*`` gauges are dropped
  as it is restarted.
"""
from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tandem import multiprocess_metrics
from tandem.config import TandemConfig
from tandem.server import can_bind, catch_stop_signals

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerPlace:
    """Which of a server's processes one is: worker ``index`` (0: the first)
    of ``count``, serving on ``port`` (None: its configured address's)."""

    index: int = 0
    count: int = 1
    port: int | None = None

    def address(self, configured: str) -> str:
        return configured if self.port is None else f"{configured.rpartition(':')[0]}:{self.port}"

    def metrics_port(self, configured: int) -> int:
        return configured if self.index == 0 else 0  # worker 0 serves every worker's metrics

    @property
    def shares_port(self) -> bool:
        """Other workers bind the same port (``SO_REUSEPORT``)."""
        return self.count > 1


def check_free(address: str) -> None:
    """Raises RuntimeError if ``address`` ("host:port") is bound by anyone."""
    if not can_bind(address):
        raise RuntimeError(f"could not bind {address}: it is in use")


def children(pid: int) -> list[int]:
    """The pids of process ``pid``'s children (Linux, /proc): its workers, and
    the resource tracker multiprocessing's spawn starts."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:  # "pid (comm) state ppid ...": comm may hold spaces
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, ValueError, IndexError):  # gone meanwhile
                pass
    return kids


def die_with(parent: int) -> None:
    """In a child process: SIGTERM to itself when process ``parent`` dies,
    even by SIGKILL (the kernel's parent-death signal, and a watch on the
    parent for the case where the signal never came)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def _watch_parent(parent: int, interval_s: float = 1.0) -> None:
    while os.getppid() == parent:
        time.sleep(interval_s)
    log.warning("the parent process (pid %d) is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)


FIRST_DELAY_S = 0.5  # a dead worker's first restart waits this long; each in a row twice the last...
MAX_DELAY_S = 30.0  # ...up to this
MAX_IN_A_ROW = 5  # deaths in a row (each within WINDOW_S of its start) before the server gives up
WINDOW_S = 60.0


@dataclass
class Restarts:
    """When a dead worker starts again (``time.monotonic()`` seconds): after
    ``FIRST_DELAY_S``, doubling with each death in a row up to
    ``MAX_DELAY_S``; a run of ``WINDOW_S`` or more ends the series. Not
    thread-safe: the watch thread's alone."""

    started: dict[int, float] = field(default_factory=dict)  # worker index -> when its running process started
    in_a_row: dict[int, int] = field(default_factory=dict)  # worker index -> its deaths in a row

    def died(self, index: int, now: float) -> float | None:
        """The delay (s) before worker ``index`` starts again, or None: it
        died ``MAX_IN_A_ROW`` times in a row (the server should give up)."""
        if now - self.started.get(index, now) >= WINDOW_S:
            self.in_a_row[index] = 0
        n = self.in_a_row.get(index, 0)
        if n >= MAX_IN_A_ROW:
            return None
        self.in_a_row[index] = n + 1
        return min(FIRST_DELAY_S * 2.0 ** n, MAX_DELAY_S)


class Workers:
    """Processes 1 .. ``count`` of a server, each running ``target(*args,
    index, parent_pid, ready)`` (a module-level function: spawn pickles it)
    until SIGTERM; it sets ``ready`` (a multiprocessing Event) once it serves.
    :meth:`watch` starts a worker that ends before :meth:`stop` again
    (:class:`Restarts`), calling ``on_death(index, exitcode, delay_s)``
    first; where ``delay_s`` is None (it keeps dying) it starts none and
    watches no more. ``procs`` and ``ready`` are replaced by the watch
    thread only; :meth:`stop` reads them after setting ``_stopping``."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], count: int):
        self._ctx = multiprocessing.get_context("spawn")
        self._target, self._args = target, args
        self._stopping = threading.Event()
        self._restarts = Restarts()
        self.ready = [self._ctx.Event() for _ in range(count)]
        self.procs = [self._process(i) for i in range(1, count + 1)]

    def _process(self, index: int):
        return self._ctx.Process(target=self._target, args=(*self._args, index, os.getpid(), self.ready[index - 1]),
                                 name=f"worker-{index}", daemon=False)

    def _start_one(self, index: int, timeout_s: float) -> None:
        """Starts worker ``index`` and waits until it serves, ends or ``timeout_s`` passes."""
        p, ready = self.procs[index - 1], self.ready[index - 1]
        p.start()
        self._restarts.started[index] = time.monotonic()
        end = time.monotonic() + timeout_s
        while not ready.wait(0.5) and p.is_alive() and time.monotonic() < end and not self._stopping.is_set():
            pass

    def start(self, timeout_s: float = 300.0, stop: Callable[[], bool] = lambda: False) -> None:
        """Starts the workers one after another, each once the last serves (or
        has ended: :meth:`watch` reports it) or ``timeout_s`` has passed; none
        more once ``stop()`` is true (a stop signal came meanwhile)."""
        for index in range(1, len(self.procs) + 1):
            if stop():
                return
            self._start_one(index, timeout_s)

    def watch(self, on_death: Callable[[int, int | None, float | None], None], timeout_s: float = 300.0) -> None:
        def run() -> None:
            while not self._stopping.is_set():
                by_sentinel = {p.sentinel: i for i, p in enumerate(self.procs, start=1)}
                ended = multiprocessing.connection.wait(list(by_sentinel), timeout=0.5)
                if not ended or self._stopping.is_set():
                    continue
                index = by_sentinel[ended[0]]
                multiprocess_metrics.mark_dead(self.procs[index - 1].pid)  # its live gauges count no more
                delay = self._restarts.died(index, time.monotonic())
                on_death(index, self.procs[index - 1].exitcode, delay)
                if delay is None or self._stopping.wait(delay):
                    return
                self.ready[index - 1] = self._ctx.Event()
                self.procs[index - 1] = self._process(index)
                self._start_one(index, timeout_s)

        threading.Thread(target=run, name="workers-watch", daemon=True).start()

    def stop(self, timeout_s: float) -> list[int | None]:
        """SIGTERM to every worker, each waited for up to ``timeout_s`` (then
        SIGKILL); returns their exit codes."""
        self._stopping.set()  # the watch thread starts no worker from now on (one it is starting dies with us)
        started = [p for p in self.procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in started:
            p.join(max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                log.error("worker %s did not stop in %.1f s: killed", p.name, timeout_s)
                p.kill()
                p.join(5)
        return [p.exitcode for p in self.procs]


def serve(cfg: TandemConfig, count: int, address: str, grace_ms: float, start: str) -> None:
    """Runs a server until SIGINT/SIGTERM as ``count`` processes sharing
    ``address``: this one, then ``count - 1`` workers. ``start`` names the
    server's start function ("module:function", called as ``function(cfg,
    place=WorkerPlace(...))`` and returning a :class:`tandem.service.Service`).

    Raises:
        RuntimeError: the address is bound by another process (``count`` > 1).
        SystemExit: 1, a worker kept dying (:class:`Restarts`; every other worker stopped).
    """
    first = _start_function(start)
    # The start reports SERVING before it returns: a stop signal from here on is recorded, and stops the
    # server (and its workers, none more started) once it has started, never killing it half-started.
    seen = catch_stop_signals()
    if count <= 1:
        first(cfg).serve_forever(grace_ms, seen)
        return
    check_free(address)  # a stale server would share a port bound with SO_REUSEPORT
    if not multiprocess_metrics.active():
        log.warning("prometheus-client was imported before %s was set: the metrics endpoint serves "
                    "worker 0's metrics alone (tandem serve sets it)", multiprocess_metrics.ENV)
    service = first(cfg, place=WorkerPlace(0, count))
    workers = Workers(run_worker, (start, cfg, WorkerPlace(0, count, service.port), grace_ms), count - 1)
    died = []

    def on_death(index: int, code: int | None, delay_s: float | None) -> None:
        if delay_s is not None:
            log.error("worker %d ended (exit code %s): started again in %.1f s; the other workers serve on",
                      index, code, delay_s)
            return
        log.error("worker %d ended (exit code %s), %d times in a row: the server stops", index, code, MAX_IN_A_ROW)
        died.append(index)
        os.kill(os.getpid(), signal.SIGTERM)

    workers.start(stop=lambda: bool(seen))
    workers.watch(on_death)
    try:
        service.serve_forever(grace_ms, seen)
    finally:
        workers.stop(grace_ms / 1000.0 + 5.0)
    if died:
        raise SystemExit(1)


def run_worker(start: str, cfg: TandemConfig, first: WorkerPlace, grace_ms: float, index: int, parent: int, ready) -> None:
    """Worker ``index`` (1..) of :func:`serve`, in a process of its own: the
    server on ``first``'s port until SIGTERM or its parent's death; ``ready``
    set once it serves."""
    die_with(parent)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [worker {index}] %(name)s: %(message)s")
    service = _start_function(start)(cfg, place=WorkerPlace(index, first.count, first.port))
    ready.set()
    service.serve_forever(grace_ms)


def _start_function(start: str) -> Callable[..., Any]:
    module, _, function = start.partition(":")
    return getattr(importlib.import_module(module), function)
