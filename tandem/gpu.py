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


# CUDA's scheduling flags for a context (cuda.h CUctx_flags): how a host thread waits for the GPU
# in a synchronising call (a stream or event synchronize, a copy back).
HOST_WAIT_FLAGS = {
    "auto": 0x0,  # CU_CTX_SCHED_AUTO: spin while the process has fewer active contexts than cores, else yield
    "spin": 0x1,  # CU_CTX_SCHED_SPIN: busy-wait, the lowest latency, a core per waiting thread
    "yield": 0x2,  # CU_CTX_SCHED_YIELD: poll, yielding the core between polls
    "block": 0x4,  # CU_CTX_SCHED_BLOCKING_SYNC: sleep on an OS primitive until the GPU signals
}


_host_wait = "auto"  # this process's mode (set_host_wait)


def spins() -> bool:
    """Whether this process's own polling loops (a copy's word, the leaf
    channel's reply, a CUDA event) spin a while before they sleep: with
    host_wait ``auto`` or ``spin``; ``yield`` and ``block`` sleep from the
    first poll, so no thread burns a core while it waits for the GPU."""
    return _host_wait in ("auto", "spin")


def set_host_wait(mode: str, device: int = 0) -> bool:
    """Sets how this process's threads wait for GPU ``device`` in synchronising
    CUDA calls (:data:`HOST_WAIT_FLAGS`), on the device's primary context,
    which CuPy and ONNX Runtime's CUDA provider share; call it before either
    creates the context (at the service's start). ``auto`` leaves CUDA's
    default. The process's own polling loops follow the mode (:func:`spins`).
    Returns whether the context's flag was set: False on a host without a
    GPU, or where the driver refuses it (logged).

    Raises:
        ValueError: ``mode`` is not one of :data:`HOST_WAIT_FLAGS`.
    """
    if mode not in HOST_WAIT_FLAGS:
        raise ValueError(f"host wait {mode!r}: choose one of {', '.join(HOST_WAIT_FLAGS)}")
    global _host_wait
    _host_wait = mode
    if mode == "auto" or cuda_device_count() == 0:
        return False
    lib = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_int(0)
    status = lib.cuDeviceGet(ctypes.byref(handle), device)
    if status == 0:
        status = lib.cuDevicePrimaryCtxSetFlags(handle, HOST_WAIT_FLAGS[mode])
    if status != 0:
        log.warning("GPU %d: CUDA refused host wait %r (CUresult %d); its default stays", device, mode, status)
        return False
    log.info("GPU %d: host threads %s while they wait for the GPU (host_wait %s)", device,
             {"spin": "spin", "yield": "yield their core", "block": "sleep"}[mode], mode)
    return True
