"""Ctrl-C for the command line: the first one raises ``KeyboardInterrupt`` (the
command stops its servers, closes its channels and exits 130) and makes sure
the process is gone ``deadline_s`` later even if a library thread holds its
exit up; a second one exits at once."""
from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
DEADLINE_S = 20.0  # > a demo's drain of its servers (Stack.stop: 10 s grace, then SIGKILL)

_interrupted = threading.Event()


def _exit_later(deadline_s: float) -> None:
    time.sleep(deadline_s)
    os.write(2, f"tandem: not stopped {deadline_s:g} s after Ctrl-C: exiting; where each thread was:\n".encode())
    faulthandler.dump_traceback(file=2, all_threads=True)  # what held the exit up, for the bug report
    os._exit(EXIT_INTERRUPTED)


def _on_sigint(deadline_s: float):
    def handler(_signum, _frame):
        if _interrupted.is_set():
            os.write(2, b"tandem: interrupted again: exiting now\n")
            os._exit(EXIT_INTERRUPTED)
        _interrupted.set()
        threading.Thread(target=_exit_later, args=(deadline_s,), name="exit-deadline", daemon=True).start()
        raise KeyboardInterrupt

    return handler


def raise_if_interrupted() -> None:
    """Raises KeyboardInterrupt once Ctrl-C was pressed, for loops that must
    stop even when the signal's exception was lost: the handler raises in
    whatever the main thread runs, and gRPC's C core, running a Python
    callback there, only prints it (a demo then played on against its stopped
    servers until the exit deadline)."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


def install(deadline_s: float = DEADLINE_S) -> None:
    """Installs the SIGINT handler (in the main thread; commands that serve
    install their own, which replaces it)."""
    signal.signal(signal.SIGINT, _on_sigint(deadline_s))
