"""Compiling the MCTS kernels: the generated header ``abi.h`` (see
:mod:`.abi`) and the ``kernels/*.cu`` sources, concatenated in dependency
order, built once per process by CuPy's ``RawModule`` (NVRTC, for the
current device's architecture; CuPy caches the binary on disk).

Options: ``-std=c++17`` and ``--fmad=false`` -- the selection scores must be
rounded exactly as the NumPy reference's float64 (a fused multiply-add rounds
once where NumPy rounds twice), which is what makes the GPU search reproduce
the CPU reference simulation for simulation.

CuPy is imported on the first :func:`kernel` call, so :func:`source` (what
NVRTC compiles) can be built and checked on a machine without it.
"""
from __future__ import annotations

import threading
from importlib.resources import files
from typing import TYPE_CHECKING

from search_service.cuda import abi

if TYPE_CHECKING:
    import cupy

KERNEL_DIR = files("search_service.cuda") / "kernels"  # package data
HEADER_NAME = "abi.h"  # the generated header's name in #line directives and compile errors
KERNEL_FILES = (
    "common.cu",  # types, device constants, the node-pool layout
    "philox.cu",  # Philox4x32-10
    "connect4.cu",  # bitboard rules and the random rollout
    "select.cu",  # UCT / PUCT scores and the warp-cooperative descent
    "expand.cu",  # node creation (one atomicAdd per wave)
    "backup.cu",  # global_atomic and warp_aggregated backups
    "search.cu",  # init, search (rollout; value-model halves), results
    "reroot.cu",  # breadth-first compaction for tree reuse
    "playout.cu",  # the conformance kit's random games with the device rules
)
OPTIONS = ("-std=c++17", "--fmad=false")

_lock = threading.Lock()
_module: cupy.RawModule | None = None
_kernels: dict[str, cupy.RawKernel] = {}


def source() -> str:
    """The concatenated CUDA C++ source (what NVRTC compiles): ``abi.h``, then
    the kernel files, each behind a ``#line`` so errors name the right file."""
    return assemble([(HEADER_NAME, abi.header())] + [(name, (KERNEL_DIR / name).read_text()) for name in KERNEL_FILES])


def assemble(parts: list[tuple[str, str]]) -> str:
    """One translation unit of ``(file name, text)`` parts, in order, each
    behind a ``#line`` so that NVRTC's errors name the right file."""
    return "\n".join(f"// ==== {name} ====\n#line 1 \"{name}\"\n{text}" for name, text in parts)


def kernel(name: str) -> cupy.RawKernel:
    """The compiled kernel ``name`` (an ``extern "C"`` function of the sources).

    Raises:
        cupy.cuda.compiler.CompileException: the sources do not compile.
    """
    global _module
    fn = _kernels.get(name)
    if fn is not None:
        return fn
    import cupy

    with _lock:
        if _module is None:
            _module = cupy.RawModule(code=source(), options=OPTIONS)
        fn = _kernels.get(name)
        if fn is None:
            fn = _kernels[name] = _module.get_function(name)
    return fn
