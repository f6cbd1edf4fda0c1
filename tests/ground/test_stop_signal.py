"""A server's main thread waits for SIGINT/SIGTERM with a handler that takes
no lock (tandem.server.wait_for_stop_signal): signals that come in a burst,
as a supervisor's death brings them (the parent-death signal, then the
parent watch's), all land, and the wait returns the first. A handler that
took a lock (``Event.set``) once left a search server blocked in nested
handlers for good (tests/stack/test_stack.py, killed supervisor)."""
from __future__ import annotations

import signal
import subprocess
import sys

SCRIPT = """
import os, signal, threading, time
from tandem.server import wait_for_stop_signal

def burst():
    time.sleep(0.3)
    for _ in range(200):
        os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=burst, daemon=True).start()
print(wait_for_stop_signal(), flush=True)
"""


def test_a_burst_of_sigterms_ends_the_wait_with_the_first():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(int(signal.SIGTERM))]

