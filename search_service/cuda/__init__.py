"""The CUDA search backend: MCTS in CuPy CUDA kernels (see :mod:`.backend`).

``CudaBackend`` is what :func:`search_service.backends.make_backend` builds on
a GPU host; ``CudaTree`` is the device-resident tree it returns and re-roots.
Importing this package needs CuPy; it compiles nothing until the first search.
"""
from search_service.cuda.backend import BACKUPS, CudaBackend
from search_service.cuda.pool import NODE_BYTES, CudaTree

__all__ = ["BACKUPS", "CudaBackend", "CudaTree", "NODE_BYTES"]
