"""Is there a CUDA GPU here? Asked of the driver directly (libcuda), so the
answer needs neither CuPy nor ONNX Runtime's CUDA libraries."""
from __future__ import annotations

import ctypes
import functools


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
