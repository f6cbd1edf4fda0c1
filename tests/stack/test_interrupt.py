"""Ctrl-C's flag (stack/interrupt.py): a loop that checks it stops even when
the signal's KeyboardInterrupt was lost in a library's callback."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from stack import interrupt
from stack.frame_loop import Record, SentFrame, Tick


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


class _DoneCall:
    """A call already done when its callback is added, as gRPC then runs the
    callback at once on the adding thread; its result raises what a Ctrl-C
    raised in the main thread meanwhile."""

    def result(self):
        raise KeyboardInterrupt

    def add_done_callback(self, fn):
        try:
            fn(self)
        except BaseException:  # noqa: BLE001 - gRPC logs and drops what a callback raises
            pass


def test_a_frame_whose_answer_was_interrupted_still_ends_its_wait():
    """A Ctrl-C landing in a frame's answer callback finished no record, and the
    frame's wait (no timeout) never returned: the demo hung until its exit
    deadline (seen in CI, 2026-12-01)."""
    frame = SentFrame(Tick(0, 0, 0.0), expected=1)
    frame._track(Record("search", 0, 0, 0.0, 0.0), _DoneCall)
    assert frame.wait(5.0) and frame.failure() == "INTERRUPTED"
