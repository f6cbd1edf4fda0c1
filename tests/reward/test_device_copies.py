"""The bound runner's device copies by address (reward_service/session.py
``_CupyDevice``: ``copy_device``, ``copy_out``, ``zero``), checked on the
CPU: a stand-in for CuPy whose arrays are NumPy arrays at their real
addresses and whose runtime's memcpyAsync / memsetAsync are ctypes' memmove
/ memset, so the pointer arithmetic runs as it does on the device. (On the
GPU the leaf channel's tests cover the same path end to end.)"""
from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from reward_service.session import _CupyDevice


class _Array:
    """What _CupyDevice asks of a CuPy array, over a NumPy one."""

    def __init__(self, a: np.ndarray):
        self.a = a

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    flags = property(lambda self: types.SimpleNamespace(c_contiguous=self.a.flags.c_contiguous))
    data = property(lambda self: types.SimpleNamespace(ptr=self.a.ctypes.data))

    def __len__(self):
        return len(self.a)


def _device() -> _CupyDevice:
    runtime = types.SimpleNamespace(
        memcpyDeviceToDevice=3,
        memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n),
        memsetAsync=lambda ptr, value, n, stream: ctypes.memset(ptr, value, n),
    )
    dev = _CupyDevice.__new__(_CupyDevice)  # no CUDA stream here: the copies never look at it
    dev._cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    dev.stream = types.SimpleNamespace(ptr=0)
    return dev


def test_copies_and_padding_land_on_the_rows_asked_for():
    dev = _device()
    guarded = np.full((10, 2, 3), -1, np.float32)  # a bound buffer of 8 rows, a guard row either side
    bound = guarded[1:9]
    bound[:] = 0
    feed = np.arange(18, dtype=np.float32).reshape(3, 2, 3) + 1
    dev.copy_device(_Array(bound), 4, _Array(feed))
    assert (bound[4:7] == feed).all() and (bound[:4] == 0).all() and (bound[7:] == 0).all()
    out = np.zeros((2, 2, 3), np.float32)
    dev.copy_out(_Array(out), _Array(bound), 5)
    assert (out == feed[1:]).all()
    dev.zero(_Array(bound), 5, 8)
    assert (bound[5:] == 0).all() and (bound[4] == feed[0]).all()
    assert (guarded[0] == -1).all() and (guarded[9] == -1).all()
    with pytest.raises(ValueError, match="3 rows"):
        dev.copy_device(_Array(bound), 6, _Array(feed))  # rows 6..8 of 8: refused, nothing written
    with pytest.raises(ValueError):
        dev.copy_out(_Array(out), _Array(bound), 7)


def test_a_one_row_target_gets_one_row_whatever_its_stride():
    """A one-row array is C-contiguous whatever its row stride: the copy's
    size comes from the row's shape, not from that stride."""
    dev = _device()
    backing = np.full((4, 3), -1, np.float32)
    target = backing[::2][:1]  # shape (1, 3), row stride 24 bytes
    assert target.flags.c_contiguous and target.strides[0] == 24
    bound = np.array([[0, 1, 2], [99, 99, 99]], np.float32)
    dev.copy_out(_Array(target), _Array(bound), 0)
    assert (backing[0] == [0, 1, 2]).all() and (backing[1:] == -1).all()
    dev.zero(_Array(target), 0, 1)
    assert (backing[0] == 0).all() and (backing[1:] == -1).all()
