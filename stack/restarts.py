"""``tandem up``'s restart policy, and the record of restarts that ``tandem status`` prints.

A server that exits while ``tandem up`` runs is started again, after a delay
that doubles with each restart in a row (``first_delay_s`` .. ``max_delay_s``);
the others keep serving. Restarts are *in a row* while each run ends within
``window_s`` of its start; a run that lasts ``window_s`` ends the series (the
next exit waits ``first_delay_s`` again). A server restarted more than
``max_restarts`` times in a row is *crash-looping*: the supervisor says so
(its log, ``tandem status``) and goes on restarting it at the capped delay,
until it runs ``window_s`` or the user stops ``tandem up``; with ``give_up``
(``tandem up --on-crash-loop stop``) it stops all and exits 1 instead.

The supervisor writes each server's pid, restarts, state, last exit status
and, while it is crash-looping or starting again (not yet SERVING), its last
log line (a starting server's says which start-up phase it is in,
tandem/startup.py) to :func:`record_path`
(JSON, replaced atomically on every change, removed when it stops);
``tandem status`` reads it.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.config import TandemConfig


@dataclass(frozen=True)
class RestartPolicy:
    """Seconds are wall seconds; ``max_restarts`` counts restarts in a row."""

    first_delay_s: float = 0.5
    max_delay_s: float = 60.0
    max_restarts: int = 5  # in a row, each run shorter than window_s; then crash-looping
    window_s: float = 60.0
    give_up: bool = False  # crash-looping stops all (tandem up exits 1) instead of restarting on

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"window_s: must be > 0, got {self.window_s}")
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError(f"first_delay_s, max_delay_s: must be 0 < first <= max, got "
                             f"{self.first_delay_s}, {self.max_delay_s}")

    def delay_s(self, in_a_row: int) -> float:
        """Seconds to wait before the restart that follows ``in_a_row`` restarts in a row."""
        return min(self.first_delay_s * 2.0 ** min(in_a_row, 64), self.max_delay_s)


@dataclass
class ChildRecord:
    """One server process's restart history (``time.monotonic()`` seconds)."""

    pid: int
    started: float = 0.0  # when the running (or last) process was started
    restarts: int = 0
    last_exit: int | None = None
    restart_at: float | None = None  # set while it is dead and waiting for its restart
    in_a_row: int = 0  # restarts since a run last lasted window_s
    crash_looping: bool = False
    last_line: str = ""  # its last log line: as of its last exit; while it starts, as of the last look
    serving: bool = True  # False from a restart until its health service says SERVING
    next_look: float = 0.0  # while it starts: when the supervisor next reads its health and last line

    def exited(self, code: int, now: float, policy: RestartPolicy) -> float | None:
        """Records an exit; returns when to restart it, or None where it is
        crash-looping and ``policy.give_up``."""
        self.last_exit = code
        if now - self.started >= policy.window_s:
            self.in_a_row = 0  # it ran long enough: this exit starts a new series
        self.crash_looping = self.in_a_row >= policy.max_restarts
        if self.crash_looping and policy.give_up:
            return None
        self.restart_at = now + policy.delay_s(self.in_a_row)
        return self.restart_at

    def restarted(self, pid: int, now: float) -> None:
        self.pid, self.started, self.restart_at, self.serving = pid, now, None, False
        self.restarts += 1
        self.in_a_row += 1

    def settled(self, now: float, policy: RestartPolicy) -> bool:
        """Ends a crash loop once the server has run ``policy.window_s``; True if it did."""
        if not self.crash_looping or self.restart_at is not None or now - self.started < policy.window_s:
            return False
        self.crash_looping, self.in_a_row, self.last_line = False, 0, ""
        return True

    def as_json(self, now: float) -> dict:
        state = "running" if self.restart_at is None else f"restarting in {max(self.restart_at - now, 0):.1f} s"
        if self.restart_at is None and not self.serving:
            state = f"starting for {now - self.started:.1f} s"
        if self.crash_looping:
            state = f"CRASH-LOOPING ({self.in_a_row} restarts in a row), {state}"
        return {"pid": self.pid, "restarts": self.restarts, "last_exit": self.last_exit, "state": state,
                "crash_looping": self.crash_looping, "starting": self.restart_at is None and not self.serving,
                "last_line": self.last_line}


def record_path(cfg: TandemConfig) -> Path:
    """Where the ``tandem up`` of this config (told apart by its scheduler address) keeps its record."""
    slug = "".join(c if c.isalnum() else "_" for c in cfg.scheduler.address)
    return Path(tempfile.gettempdir()) / f"tandem-{os.getuid()}" / f"up-{slug}.json"


def write_record(path: Path, children: dict[str, ChildRecord]) -> None:
    """Replaces the record at ``path`` (atomically: a reader never sees half of it)."""
    now = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"supervisor_pid": os.getpid(),
                               "servers": {n: c.as_json(now) for n, c in children.items()}}))
    os.replace(tmp, path)


def read_record(cfg: TandemConfig) -> dict | None:
    """The record of a running ``tandem up`` of this config, or None (none running, or unreadable)."""
    try:
        record = json.loads(record_path(cfg).read_text())
        os.kill(int(record["supervisor_pid"]), 0)  # still running?
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record
