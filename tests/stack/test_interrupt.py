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


def test_a_process_held_up_past_the_exit_deadline_exits_130_and_says_where_it_was():
    """The exit deadline's last word names the code that held the exit up (a
    thread dump), so a hang after Ctrl-C can be reported, not only seen."""
    import subprocess
    import sys
    import time

    script = (
        "import threading, time\n"
        "from stack import interrupt\n"
        "interrupt.install(deadline_s=0.5)\n"
        "def held_up_in_a_library():\n"
        "    threading.Event().wait()\n"
        "print('ready', flush=True)\n"
        "try:\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    held_up_in_a_library()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)  # inside the sleep
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == interrupt.EXIT_INTERRUPTED
    assert "tandem: not stopped 0.5 s after Ctrl-C: exiting; where each thread was:" in err
    assert "held_up_in_a_library" in err, err


def test_a_channel_whose_close_is_stuck_holds_the_client_s_close_up_only_for_its_bound():
    """After a Ctrl-C inside gRPC's code a channel's close can wait for ever
    (seen: `tandem play` in grpc's Channel.close until the exit deadline); the
    frame client's close gives each channel a bounded wait and still closes
    the other one."""
    import time

    from tandem.v1 import reward_pb2

    from stack.frame_loop import FrameClient

    client = FrameClient("127.0.0.1:1", "127.0.0.1:2")  # channels connect lazily: nothing is dialled
    stuck = threading.Event()
    client._search_ch.close = stuck.wait  # a close that never returns
    t = time.monotonic()
    client.close(timeout_s=0.3)
    assert time.monotonic() - t < 5.0
    with pytest.raises(ValueError, match="closed channel"):  # the reward channel was closed all the same
        client._reward.ModelMetadata(reward_pb2.ModelMetadataRequest(model="m"), timeout=1)
    stuck.set()
