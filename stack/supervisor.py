"""``tandem up``: the servers as separate processes (the scheduler, the
reward service, its bulk server where ``reward.bulk_server.enabled``, the
search service), started in steps (the bulk server and the search service
together, after the reward service), each awaited until its health service
reports SERVING, started again when one
exits (with a growing delay; one that keeps exiting is reported crash-looping
and restarted on, stack/restarts.py) while the others keep serving, and all
stopped together (SIGTERM, drain, then SIGKILL) so that none is left orphaned."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from stack.restarts import ChildRecord, RestartPolicy, record_path, write_record
from tandem import device
from tandem.config import BULK_SERVER, TandemConfig, endpoint_key, endpoints
from tandem.pools import mps_memory_env


def mps_env(cfg: TandemConfig) -> dict[str, str]:
    """``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` shared by all the
    servers (tandem/device.py); {} with ``scheduler.mps: off``."""
    if cfg.scheduler.mps == "off":
        return {}
    return device.mps_client_env(*device.mps_directories(cfg.scheduler))
from tandem.server import can_bind, health_status
from tandem.workers import die_with

log = logging.getLogger(__name__)

SERVICES = ("scheduler", "reward", "search")  # the config sections of servers; search follows the other two
COLOCATED = "co_located"  # the one process of reward + search under co_located: true


PARENT_ENV = "TANDEM_SUPERVISOR_PID"  # set for the servers `tandem up` starts


def die_with_supervisor() -> None:
    """In a server started by ``tandem up``: ask the kernel for SIGTERM when the
    supervisor dies, even by SIGKILL, so that no server is left orphaned.

    Called by ``tandem serve`` itself rather than through ``preexec_fn``:
    forking with a pre-exec hook while gRPC threads run can abort the child.
    """
    parent = os.environ.get(PARENT_ENV)
    if parent:
        # With a watch on the parent: once, under load, a server outlived a SIGKILLed
        # supervisor without ever getting the death signal (tests/stack/test_stack.py).
        die_with(int(parent))


def wait_serving(address: str, cfg: TandemConfig, timeout_s: float, proc: subprocess.Popen | None = None,
                 why: Callable[[], str] | None = None) -> None:
    """Waits until ``address`` reports SERVING.

    Raises:
        RuntimeError: the process exited (with ``why()``, where given: its
            last log line, why it could not start), or ``timeout_s`` passed first.
    """
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            reason = why() if why is not None else ""
            raise RuntimeError(f"server for {address} exited with status {proc.returncode}"
                               + (f": {reason}" if reason else ""))
        if health_status(address, cfg, timeout_s=0.5) == "SERVING":
            return
        time.sleep(0.05)
    raise RuntimeError(f"{address} did not report SERVING within {timeout_s:.0f} s")


LAST_LINE_CHARS = 300  # of a failed server's log, in tandem up's own message


def last_line(path: Path) -> str:
    """The last non-empty line of the log at ``path`` (at most LAST_LINE_CHARS
    characters, from its last 64 KiB), or "" where there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 65536, 0))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:LAST_LINE_CHARS] if lines else ""


class OutputTail:
    """Copies a server's output (a pipe) to this process's stderr, line by line,
    and keeps its last non-empty line: ``tandem up`` without ``--log-dir``
    can still say why a server exited. A thread reads until the pipe closes."""

    def __init__(self, pipe):
        self.last = ""
        self._thread = threading.Thread(target=self._pump, args=(pipe,), name="server-output", daemon=True)
        self._thread.start()

    def _pump(self, pipe) -> None:
        with pipe:
            for line in pipe:
                text = line.decode("utf-8", "replace").strip()
                if text:
                    self.last = text[:LAST_LINE_CHARS]
                try:
                    sys.stderr.buffer.write(line)
                    sys.stderr.buffer.flush()
                except (OSError, ValueError):  # our stderr is gone: keep reading, or the server blocks
                    pass

    def last_line(self, wait_s: float = 2.0) -> str:
        """The last line, once the pipe is read to its end (at most ``wait_s``
        seconds: a process the server started may hold the pipe open)."""
        self._thread.join(wait_s)
        return self.last


@dataclass
class Stack:
    """The server processes of one ``tandem up`` (:meth:`processes`)."""

    cfg: TandemConfig
    config_path: Path | None
    log_dir: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # Extra environment per server name, e.g. {"reward": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}}:
    # what must be set before a process creates its CUDA context.
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    tails: dict[str, OutputTail] = field(default_factory=dict)  # without log_dir: each server's output

    def addresses(self) -> dict[str, str]:
        return {name: address for name, (address, _) in endpoints(self.cfg).items()}

    def processes(self) -> tuple[str, ...]:
        """The processes to start, in order (``tandem serve`` names)."""
        return tuple(name for step in self.start_steps() for name in step)

    def start_steps(self) -> tuple[tuple[str, ...], ...]:
        """The processes to start, in steps: a step's processes start
        together, after the step before serves. The bulk server starts after
        the reward service, not beside it: two processes warming up at once
        would time cuDNN's candidate kernels against each other (with
        ``cudnn_conv_algo_search: EXHAUSTIVE``). The search service, which
        runs no cuDNN, starts beside the bulk server: it needs the reward
        service and the scheduler only."""
        bulk = (BULK_SERVER,) if self.cfg.reward.bulk_server.enabled else ()
        if self.cfg.co_located:
            return ("scheduler",), (COLOCATED,), *((b,) for b in bulk)
        return ("scheduler",), ("reward",), (*bulk, "search")

    def _serves(self, process: str) -> tuple[str, ...]:
        """The servers (:func:`tandem.config.endpoints` names) a process serves."""
        return ("reward", "search") if process == COLOCATED else (process,)

    def start(self, timeout_s: float = 120.0) -> None:
        """Starts the servers in order, each after the last reports SERVING.

        Raises:
            RuntimeError: a server exited or did not become SERVING in time
                (the ones already started are stopped first).
        """
        busy = [f"{name}: {addr}" for name, addr in self._ports() if not can_bind(addr)]
        if busy:
            raise RuntimeError(f"already in use (is another tandem up running?): {', '.join(busy)}; to run beside "
                               f"it, give a config with other addresses and metrics ports (each server's `address` "
                               f"and `metrics_port` keys): --config PATH (make demo CONFIG=PATH)")
        try:
            addresses = self.addresses()
            for step in self.start_steps():
                for name in step:
                    self.spawn(name)
                for name in step:
                    for server in self._serves(name):
                        wait_serving(addresses[server], self.cfg, timeout_s, self.procs[name],
                                     lambda name=name: self.why(name))
        except BaseException:
            self.stop()
            raise

    def spawn(self, name: str) -> subprocess.Popen:
        """Starts (or starts again) process ``name`` without waiting for it to serve.

        It gets a session of its own: a Ctrl-C in the terminal reaches only the
        supervisor, which then stops the servers in order (a server that had
        the SIGINT too would be stopping already when the SIGTERM came).
        Its output goes to ``log_dir/NAME.log``, or without a ``log_dir``
        through this process (:class:`OutputTail`) to its stderr.
        """
        cmd = [sys.executable, "-m", "stack", "serve", name]
        if self.config_path:
            cmd += ["--config", str(self.config_path)]
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")
        else:
            out = subprocess.PIPE
        try:
            self.procs[name] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self._env(name), PARENT_ENV: str(os.getpid())},
            )
        finally:
            if out is not subprocess.PIPE:
                out.close()  # the child has its own copy
        if out is subprocess.PIPE:
            self.tails[name] = OutputTail(self.procs[name].stdout)
        return self.procs[name]

    def last_line(self, name: str) -> str:
        """The last non-empty line server ``name`` wrote (its log, or its
        output through this process), or ""."""
        if self.log_dir:
            return last_line(self.log_dir / f"{name}.log")
        tail = self.tails.get(name)
        return tail.last_line() if tail is not None else ""

    def why(self, name: str, line: str | None = None) -> str:
        """Server ``name``'s last line (``line``, where already read), with
        where its log is: for a message saying why it exited ("" where it wrote nothing)."""
        line = self.last_line(name) if line is None else line
        if line and self.log_dir:
            return f"{line} (log: {self.log_dir / f'{name}.log'})"
        return line

    def _env(self, name: str) -> dict[str, str]:
        """The server's extra environment: the shared MPS directories, its MPS
        device memory cap (from its fixed pool, where it has one), its MPS
        active-thread share under policy ``static`` and ``env[name]``."""
        pools = {"reward": self.cfg.reward.memory_pool_bytes, BULK_SERVER: self.cfg.reward.memory_pool_bytes,
                 "search": self.cfg.search.memory_pool_bytes}
        pool = sum(pools.get(server, 0) for server in self._serves(name))
        return {**mps_env(self.cfg), **mps_memory_env(pool), **self._partition(name), **self.env.get(name, {})}

    def _partition(self, name: str) -> dict[str, str]:
        """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of a service under policy ``static``
        (``scheduler.urgency.static_*_percentage``): MPS reads it when the process
        creates its CUDA context, so it is fixed for the process's life."""
        if self.cfg.scheduler.policy != "static" or name not in ("reward", BULK_SERVER, "search"):
            return {}
        w = self.cfg.scheduler.urgency
        share = w.static_search_percentage if name == "search" else w.static_reward_percentage
        return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)}

    def _ports(self) -> list[tuple[str, str]]:
        out = []
        for name, (address, metrics_port) in endpoints(self.cfg).items():
            key = endpoint_key(name)
            out.append((f"{key}.address", address))
            if metrics_port:
                out.append((f"{key}.metrics_port", f"{address.rpartition(':')[0]}:{metrics_port}"))
        return out

    def failed(self) -> str | None:
        """Name of a server that has exited, if any."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name
        return None

    def stop(self, grace_s: float = 10.0) -> dict[str, int]:
        """SIGTERM to all (in reverse order), wait up to ``grace_s``, then SIGKILL.

        Returns each server's exit status.
        """
        for name in reversed(list(self.procs)):
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killing it", name, grace_s)
                proc.kill()
                codes[name] = proc.wait()
        self.procs.clear()
        return codes

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_until_signalled(stack: Stack, policy: RestartPolicy | None = None) -> int:
    """Supervises the started ``stack`` until SIGINT/SIGTERM: a server that exits
    is started again under ``policy`` (None: the default :class:`RestartPolicy`),
    a crash-looping one too (at the capped delay), while the others keep serving
    (the record ``tandem status`` prints is kept at :func:`~stack.restarts.record_path`).

    Returns the exit status for the CLI: 0 when stopped on request with every
    server stopping cleanly; 1 when a server did not stop cleanly (one that
    was crash-looping, for one), or with ``policy.give_up`` when a server was
    crash-looping (all are stopped).
    """
    policy = policy or RestartPolicy()
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: stopping.append(s))
    now = time.monotonic()
    children = {name: ChildRecord(proc.pid, started=now) for name, proc in stack.procs.items()}
    path = record_path(stack.cfg)
    write_record(path, children)
    try:
        while not stopping:
            if _supervise_once(stack, children, policy, time.monotonic()):
                write_record(path, children)
            time.sleep(0.1)
        print(f"stopping: draining the {len(stack.procs)} server processes", flush=True)
        codes = stack.stop()
        print("stopped: " + ", ".join(f"{n} exit {c}" for n, c in codes.items()), flush=True)
        return int(any(codes.values()))
    except _GaveUp as exc:
        log.error("%s", exc)
        stack.stop()
        return 1
    finally:
        path.unlink(missing_ok=True)


class _GaveUp(Exception):
    """A server is crash-looping and the policy says to stop all (``give_up``)."""


def _supervise_once(stack: Stack, children: dict[str, ChildRecord], policy: RestartPolicy, now: float) -> bool:
    """Notes servers that exited, starts those whose delay has passed and ends
    the crash loops of those that have run ``policy.window_s``; True if anything changed.

    Raises:
        _GaveUp: a server is crash-looping and ``policy.give_up``.
    """
    changed = False
    for name, child in children.items():
        proc = stack.procs[name]
        if child.restart_at is None and proc.poll() is not None:
            child.last_line = stack.last_line(name)
            _note_exit(name, child, child.exited(proc.returncode, now, policy), now, policy,
                       stack.why(name, child.last_line))
            changed = True
        elif child.restart_at is not None and now >= child.restart_at:
            child.restarted(stack.spawn(name).pid, now)
            log.warning("%s started again (pid %d, restart %d)", name, child.pid, child.restarts)
            changed = True
        elif child.settled(now, policy):
            log.warning("%s has run %.0f s since its last restart: no longer crash-looping", name, policy.window_s)
            changed = True
        elif child.restart_at is None and not child.serving and now >= child.next_look:
            changed |= _look_at_start(stack, name, child, now)
    return changed


STARTING_LOOK_S = 0.5  # how often a restarted server's health and last log line are read while it starts


def _look_at_start(stack: Stack, name: str, child: ChildRecord, now: float) -> bool:
    """Reads a restarted server's health and, while it is not SERVING yet, its
    last log line (which start-up phase it is in); True (the record changes)."""
    child.next_look = now + STARTING_LOOK_S
    serving = all(health_status(stack.addresses()[server], stack.cfg, timeout_s=0.2) == "SERVING"
                  for server in stack._serves(name))
    if serving:
        child.serving = True
        log.warning("%s is SERVING again, %.1f s after its restart", name, now - child.started)
    else:
        child.last_line = stack.last_line(name)
    return True


def _note_exit(name: str, child: ChildRecord, restart_at: float | None, now: float, policy: RestartPolicy,
               why: str) -> None:
    """Logs a server's exit and what happens next (its last log line, ``why``, where it wrote one).

    Raises:
        _GaveUp: it is crash-looping and ``policy.give_up`` (``restart_at`` None).
    """
    last = f"; its last log line: {why}" if why else ""
    series = (f"{child.in_a_row} restarts in a row, each run shorter than {policy.window_s:.0f} s")
    if restart_at is None:
        raise _GaveUp(f"{name} exited (status {child.last_exit}) after {series}: crash-looping, "
                      f"giving up (--on-crash-loop stop), stopping the others{last}")
    if child.crash_looping:
        log.error("%s is crash-looping: exited (status %s) after %s; restarting it in %.1f s (at most %.0f s "
                  "apart), the others keep serving%s", name, child.last_exit, series, restart_at - now,
                  policy.max_delay_s, last)
    else:
        log.error("%s exited (status %s): restarting it in %.1f s (restart %d in a row; crash-looping after %d); "
                  "the others keep serving%s", name, child.last_exit, restart_at - now, child.in_a_row + 1,
                  policy.max_restarts, last)
