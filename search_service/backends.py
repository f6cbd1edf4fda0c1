"""Choosing the search backend: the CUDA kernels where CuPy sees a GPU and they
are built in, else the NumPy CPU reference (what CI runs)."""
from __future__ import annotations

import importlib.util
import logging

from tandem.gpu import cuda_device_count

log = logging.getLogger(__name__)

CUDA_MODULE = "search_service.cuda"


def cuda_available() -> str | None:
    """None if the CUDA backend can run here, else the reason it cannot."""
    if importlib.util.find_spec(CUDA_MODULE) is None:
        return "this build has no CUDA search backend"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'tandem[gpu]')"
    if cuda_device_count() == 0:
        return "no CUDA GPU is visible"
    return None


def make_backend(choice: str, rollout_slice_ms: float | None = None, **cuda_options):
    """A SearchBackend for ``choice`` ("auto", "cpu" or "cuda"), its rollout
    waves in a batch of trees sliced by ``rollout_slice_ms`` (None: not); the
    CUDA backend also gets ``cuda_options`` (``CudaBackend``'s arguments; the
    CPU reference takes no others: it runs a tree's wave in order always).

    Raises:
        RuntimeError: "cuda" was asked for and cannot run here (the reason is given).
    """
    if choice in ("auto", "cuda"):
        reason = cuda_available()
        if reason is None:
            return importlib.import_module(CUDA_MODULE).CudaBackend(rollout_slice_ms=rollout_slice_ms, **cuda_options)
        if choice == "cuda":
            raise RuntimeError(f"search.backend is 'cuda' but {reason}")
        log.warning("search backend: CPU reference (%s)", reason)
    from search_service.mcts.cpu_reference import CpuReferenceBackend

    return CpuReferenceBackend(rollout_slice_ms)
