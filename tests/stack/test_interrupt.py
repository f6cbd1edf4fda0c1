"""Ctrl-C's flag (stack/interrupt.py): a loop that checks it stops even when
the signal's KeyboardInterrupt was lost in a library's callback."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from stack import interrupt


def test_a_ctrl_c_whose_exception_was_swallowed_still_stops_the_loop(monkeypatch):
    monkeypatch.setattr(interrupt, "_interrupted", threading.Event())
    monkeypatch.setattr(interrupt, "_exit_later", lambda deadline_s: None)  # no exit deadline in the test run
    previous = signal.getsignal(signal.SIGINT)
    interrupt.install()
    try:
        interrupt.raise_if_interrupted()  # no Ctrl-C yet: nothing
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        except KeyboardInterrupt:
            pass  # swallowed, as a gRPC callback does
        with pytest.raises(KeyboardInterrupt):
            interrupt.raise_if_interrupted()
    finally:
        signal.signal(signal.SIGINT, previous)
