"""The one GPU probe every process uses: is there a CUDA GPU here, and can
CuPy drive it?

:func:`cuda_device_count` asks the driver directly (libcuda), so the answer
needs neither CuPy nor ONNX Runtime's CUDA libraries; :func:`cupy_module`
adds CuPy on top of it. Both answers are cached for the life of the process.
"""
from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def cuda_device_count() -> int:
    """Number of CUDA devices the driver sees; 0 where there is no driver or GPU."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def host_fact(log: logging.Logger):
    """How ``log`` reports what runs where (a provider, a backend, GPU features
    off): ``log.warning`` on a host with a GPU (a GPU left idle is worth seeing
    at a glance), ``log.info`` on a CPU host, where the CPU paths are what is
    expected."""
    return log.warning if cuda_device_count() else log.info


@functools.cache
def cupy_module():
    """The ``cupy`` module where the driver sees a GPU, CuPy imports and CuPy
    sees a device too; else None (no GPU, CuPy not installed, or a CUDA
    install CuPy cannot load, which is logged)."""
    if cuda_device_count() == 0:
        return None
    try:
        import cupy  # noqa: PLC0415 - optional dependency (the gpu extra)
    except ImportError:
        return None
    except Exception as exc:  # a broken CUDA install raises more than ImportError
        log.warning("CuPy failed to import: %s", exc)
        return None
    try:
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception as exc:  # driver / runtime mismatch
        log.warning("CuPy sees no usable GPU: %s", exc)
        return None
