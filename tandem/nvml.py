"""GPU utilisation, memory and clocks through NVML (the ``nvidia-ml-py``
package, module ``pynvml``), where it is installed and a driver answers.

Every function returns None where NVML cannot be asked (no package, no
driver, no GPU), never raises: the metrics built on it are then absent
rather than zero, so a dashboard cannot mistake "unknown" for "idle".
"""
from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _handle(index: int = 0):
    """NVML's handle of GPU ``index``, or None (NVML initialised once per process)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # pynvml.NVMLError: no driver or no such GPU
        log.info("NVML unavailable: %s", exc)
        return None


def name(index: int = 0) -> str | None:
    """GPU ``index``'s name as NVML gives it ("NVIDIA H200"); None where NVML cannot be asked."""
    h = _handle(index)
    if h is None:
        return None
    import pynvml

    try:
        value = pynvml.nvmlDeviceGetName(h)
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception as exc:  # pynvml.NVMLError
        log.info("NVML read failed: %s", exc)
        return None


def sample(index: int = 0) -> dict | None:
    """One reading of GPU ``index``: ``gpu_util_percent`` and ``memory_util_percent``
    (share of the last sample period a kernel / a memory access ran, %),
    ``memory_used_bytes``, ``memory_total_bytes``, ``sm_clock_mhz``,
    ``sm_clock_max_mhz``; None where NVML cannot be asked."""
    h = _handle(index)
    if h is None:
        return None
    import pynvml

    try:
        util = pynvml.nvmlDeviceGetUtilizationRates(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        return {
            "gpu_util_percent": float(util.gpu),
            "memory_util_percent": float(util.memory),
            "memory_used_bytes": int(mem.used),
            "memory_total_bytes": int(mem.total),
            "sm_clock_mhz": int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
            "sm_clock_max_mhz": int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
        }
    except Exception as exc:  # pynvml.NVMLError
        log.info("NVML read failed: %s", exc)
        return None


def process_memory(index: int = 0) -> dict[int, int] | None:
    """Device memory (bytes) held by each compute process on GPU ``index``,
    pid -> bytes; None where NVML cannot be asked. Under MPS the clients are
    listed with their own pids; a process NVML cannot size (no permission)
    is left out."""
    h = _handle(index)
    if h is None:
        return None
    import pynvml

    try:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    except Exception as exc:  # pynvml.NVMLError
        log.info("NVML process list failed: %s", exc)
        return None
    return {int(p.pid): int(p.usedGpuMemory) for p in procs if isinstance(p.usedGpuMemory, int)}


def register_gpu_metrics() -> bool:
    """Adds ``tandem_scheduler_gpu_utilisation_ratio`` (0-1) and
    ``tandem_scheduler_gpu_memory_used_bytes`` (read at each scrape) where NVML
    answers; returns whether they were added (absent elsewhere)."""
    if sample() is None:
        return False
    from prometheus_client import Gauge

    from tandem import multiprocess_metrics

    # The GPU's, whichever process reads it: the greatest (one value) where processes share the files.
    util = Gauge("tandem_scheduler_gpu_utilisation_ratio", "GPU 0 utilisation over NVML's last sample period (0-1).",
                 multiprocess_mode="livemax")
    used = Gauge("tandem_scheduler_gpu_memory_used_bytes", "GPU 0 device memory in use (bytes).",
                 multiprocess_mode="livemax")
    multiprocess_metrics.set_function(util, lambda: (sample() or {}).get("gpu_util_percent", float("nan")) / 100.0)
    multiprocess_metrics.set_function(used, lambda: (sample() or {}).get("memory_used_bytes", float("nan")))
    return True
