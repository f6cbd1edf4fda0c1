"""Fixed GPU memory pools (docs/design.md, "Scheduling"): each service's pool is
set once, at start, and a request that would exceed it fails cleanly with
RESOURCE_EXHAUSTED instead of taking memory from the other service.

* search service: CuPy's default memory pool, ``MemoryPool.set_limit``
  (:func:`limit_cupy_pool`);
* reward service: ONNX Runtime's CUDA arena, ``gpu_mem_limit``
  (reward_service/session.py);
* every MPS client: ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (:func:`mps_memory_env`).

:func:`is_out_of_memory` recognises the allocation failures of all of them,
so the servers can map them onto RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# How ONNX Runtime words an allocation beyond gpu_mem_limit (BFC arena) or a failed cudaMalloc.
_ORT_OOM_MARKERS = ("Failed to allocate memory", "BFCArena", "out of memory", "CUDA failure 2:")


def limit_cupy_pool(cupy, limit_bytes: int) -> str:
    """Caps CuPy's default device memory pool at ``limit_bytes`` (0 = no cap).

    ``cupy`` is the CuPy module (see :func:`tandem.gpu.cupy_module`)
    or None on a CPU host. Returns one sentence for the log.
    """
    if cupy is None:
        return "no GPU: no device memory pool to limit"
    cupy.get_default_memory_pool().set_limit(size=int(limit_bytes))
    return f"CuPy memory pool limited to {limit_bytes} bytes" if limit_bytes else "CuPy memory pool unlimited"


def cupy_pool_use(cupy) -> tuple[int, int]:
    """(used, limit) bytes of CuPy's default pool; (0, 0) on a CPU host (limit 0 = none)."""
    if cupy is None:
        return 0, 0
    pool = cupy.get_default_memory_pool()
    return int(pool.used_bytes()), int(pool.get_limit())


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure of a fixed pool (CuPy, ONNX Runtime, host)."""
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # cupy.cuda.memory.OutOfMemoryError (CuPy may be absent)
        return True
    text = str(exc)
    return any(marker in text for marker in _ORT_OOM_MARKERS)


def mps_memory_env(limit_bytes: int, device: int = 0) -> dict[str, str]:
    """Environment for an MPS client capped at ``limit_bytes`` of device memory
    (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, whole MiB, at least 1); {} for 0 (no cap).

    Must be in the client's environment before it creates its CUDA context.
    """
    if limit_bytes <= 0:
        return {}
    mib = max(int(limit_bytes) // (1 << 20), 1)
    return {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{device}={mib}M"}
