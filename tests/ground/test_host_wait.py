"""How a service's threads wait for the GPU (``reward.host_wait``,
``search.host_wait``; tandem.gpu.set_host_wait)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tandem import gpu


def test_an_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="host wait 'sleep': choose one of auto, spin, yield, block"):
        gpu.set_host_wait("sleep")


def test_auto_leaves_cuda_alone_and_a_cpu_host_has_nothing_to_set():
    assert gpu.set_host_wait("auto") is False
    if gpu.cuda_device_count() == 0:
        assert gpu.set_host_wait("block") is False


@pytest.mark.parametrize("mode, spins", [("auto", True), ("spin", True), ("yield", False), ("block", False)])
def test_the_process_polling_loops_follow_the_mode(monkeypatch, mode, spins):
    monkeypatch.setattr(gpu, "_host_wait", "auto")  # the process's mode is restored after the test
    monkeypatch.setattr(gpu, "cuda_device_count", lambda: 0)  # the mode alone, no context to flag
    gpu.set_host_wait(mode)
    assert gpu.spins() is spins


_PROBE = """
import ctypes, sys
from tandem import gpu
assert gpu.set_host_wait(sys.argv[1])
import cupy
cupy.zeros(1).sum().get()  # the primary context, made now, with the flag
flags = ctypes.c_uint(0)
assert ctypes.CDLL("libcuda.so.1").cuCtxGetFlags(ctypes.byref(flags)) == 0
print(flags.value & 0x7)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["block", "yield", "spin"])
def test_the_context_cupy_makes_carries_the_mode(mode):
    """In a fresh process (the flag belongs to the context, made once)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == gpu.HOST_WAIT_FLAGS[mode]
