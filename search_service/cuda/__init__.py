"""The CUDA search backend: MCTS in CuPy CUDA kernels (see :mod:`.backend`).

``CudaBackend`` is what :func:`search_service.backends.make_backend` builds on
a GPU host; ``CudaTree`` is the device-resident tree it returns and re-roots.
They import CuPy, on first use: the package itself, and :mod:`.abi` (the
host-kernel table) and :func:`.module.source`, import without it, so CPU
tests can check them. Nothing is compiled until the first search.
"""
from search_service.cuda.abi import NODE_BYTES

__all__ = ["BACKUPS", "CudaBackend", "CudaTree", "NODE_BYTES"]


def __getattr__(name: str):
    if name in ("BACKUPS", "CudaBackend"):
        from search_service.cuda import backend

        return getattr(backend, name)
    if name == "CudaTree":
        from search_service.cuda import pool

        return pool.CudaTree
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
