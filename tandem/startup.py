"""Where a server's start-up goes: one log line as each phase begins and one
as it ends, with its seconds and the seconds since the process started.

Why: a starting server's last log line is what ``tandem up`` and ``tandem
status`` show while it is not yet SERVING (stack/supervisor.py), so the line
says what it is doing now ("start-up: model connect4_value: sessions ..."),
and the ends say where the time went (seconds, wall clock).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Iterator

PREFIX = "start-up: "  # every line of this module starts so (the supervisor and status look for it)


def process_started() -> float:
    """``time.monotonic()`` of this process's start (its imports count too):
    /proc/self/stat's start time (clock ticks since boot, proc(5)) against
    CLOCK_BOOTTIME; now where /proc cannot say."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.monotonic() - max(age, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


class Phases:
    """The phases of one server's start-up, logged to ``log`` (INFO).

    Args:
        log: the server's logger.
        since: ``time.monotonic()`` the seconds "since the start" count from
            (default: the process's start, :func:`process_started`).
    """

    def __init__(self, log: logging.Logger, since: float | None = None):
        self._log = log
        self._since = process_started() if since is None else since

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Logs ``what`` as it begins and, with its seconds, as it ends (also
        when it raises: a failed start says how far it got)."""
        began = time.monotonic()
        self._log.info("%s%s ...", PREFIX, what)
        ok = False
        try:
            yield
            ok = True
        finally:
            end = time.monotonic()
            self._log.info("%s%s: %s in %.2f s (%.2f s since the start)", PREFIX, what,
                           "done" if ok else "FAILED", end - began, end - self._since)
