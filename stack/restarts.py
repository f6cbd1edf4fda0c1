"""``tandem up``'s restart policy, and the record of restarts that ``tandem status`` prints.

A server that exits while ``tandem up`` runs is started again after a delay
that doubles with each restart in the window (``first_delay_s`` .. ``max_delay_s``);
the others keep serving. A server that exits more than ``max_restarts`` times
within ``window_s`` is not restarted: ``tandem up`` stops all and exits 1.

The supervisor writes each server's pid, restarts and last exit status to
:func:`record_path` (JSON, replaced atomically on every change, removed when it
stops); ``tandem status`` reads it.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tandem.config import TandemConfig


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    max_restarts: int = 5  # within window_s; 0: never restart (a dead server stops all)
    window_s: float = 60.0

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"window_s: must be > 0, got {self.window_s}")

    def delay_s(self, recent: int) -> float:
        """Seconds to wait before the restart that follows ``recent`` restarts in the window."""
        return min(self.first_delay_s * 2.0 ** recent, self.max_delay_s)


@dataclass
class ChildRecord:
    """One server process's restart history (monotonic seconds)."""

    pid: int
    restarts: int = 0
    last_exit: int | None = None
    restart_at: float | None = None  # set while it is dead and waiting for its restart
    _recent: deque = field(default_factory=deque, repr=False)  # times of restarts within the window

    def exited(self, code: int, now: float, policy: RestartPolicy) -> float | None:
        """Records an exit; returns when to restart it, or None when the budget is spent."""
        self.last_exit = code
        while self._recent and now - self._recent[0] > policy.window_s:
            self._recent.popleft()
        if len(self._recent) >= policy.max_restarts:
            return None
        self.restart_at = now + policy.delay_s(len(self._recent))
        return self.restart_at

    def restarted(self, pid: int, now: float) -> None:
        self.pid, self.restart_at = pid, None
        self.restarts += 1
        self._recent.append(now)

    def recent(self) -> int:
        """Restarts counted against the budget (those within the window, as of the last exit)."""
        return len(self._recent)

    def as_json(self, now: float) -> dict:
        state = "running" if self.restart_at is None else f"restarting in {max(self.restart_at - now, 0):.1f} s"
        return {"pid": self.pid, "restarts": self.restarts, "last_exit": self.last_exit, "state": state}


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
