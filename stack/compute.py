"""The line ``tandem up`` and ``tandem demo`` print before starting anything: where
the search and the reward models will run on this host, and why (a GPU host
whose install lacks the gpu extra runs both on the CPU: said up front, with the fix).
Nothing here imports CuPy or ONNX Runtime (the servers do that themselves)."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from search_service import backends
from tandem import gpu
from tandem.config import TandemConfig


def _installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def describe(cfg: TandemConfig) -> str:
    """One line, e.g. ``compute: search on the CPU (CuPy is not installed ...);
    reward models on onnxruntime 1.31.1 (CPU build)``."""
    gpus = gpu.cuda_device_count()
    if cfg.search.backend == "cpu":
        search = "search on the CPU (search.backend: cpu)"
    elif not gpus:
        search = "search on the CPU (no CUDA GPU visible)"
    else:
        reason = backends.cuda_available()
        search = "search on the GPU (CUDA kernels)" if reason is None else f"search on the CPU ({reason})"
    gpu_build, cpu_build = _installed("onnxruntime-gpu"), _installed("onnxruntime")
    if gpu_build and cfg.reward.execution_provider != "cpu":
        reward = (f"reward models on onnxruntime-gpu {gpu_build} (CUDA provider; `tandem doctor` checks it loads)"
                  if gpus else f"reward models on the CPU (onnxruntime-gpu {gpu_build}, no CUDA GPU visible)")
    elif gpu_build or cpu_build:
        why = "reward.execution_provider: cpu" if cfg.reward.execution_provider == "cpu" else "CPU build"
        reward = f"reward models on the CPU (onnxruntime{'-gpu' if gpu_build else ''} {gpu_build or cpu_build}, {why})"
    else:
        reward = "no ONNX Runtime installed: pip install 'tandem[cpu]' or 'tandem[gpu]'"
    line = f"compute: {search}; {reward}"
    if gpus and ("on the CPU" in line or "no ONNX Runtime" in line):
        line += f"\n  a CUDA GPU is visible ({gpus}): pip install 'tandem[gpu]' to use it, `tandem doctor` to check"
    return line
