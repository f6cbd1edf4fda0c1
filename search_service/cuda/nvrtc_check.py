"""Compiling the kernels to PTX without a GPU: NVRTC through ctypes.

CI and a machine without a GPU use this to see that every module
(Connect Four's and each game folder's, :mod:`search_service.cuda.module`)
compiles: NVRTC needs no CUDA context and no driver, only ``libnvrtc``
(pip's ``nvidia-cuda-nvrtc-cu12``, part of the ``gpu`` extra's CuPy
install, or any CUDA toolkit's). Used by ``tests/search/test_cuda_compile.py``;
:func:`canonical_ptx` compares two builds of a module.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
from pathlib import Path

ARCH = "compute_90"  # the H200's virtual architecture
ENV = "TANDEM_NVRTC"  # a path to libnvrtc.so, which wins over the search below


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message holds its log."""


def find_nvrtc() -> str | None:
    """The path of a loadable ``libnvrtc``, or None: ``$TANDEM_NVRTC``, pip's
    ``nvidia.cuda_nvrtc`` package, then the system's library search."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(glob.glob(str(Path(root) / "cuda_nvrtc" / "lib" / "libnvrtc.so*")))
        found = [f for f in found if "builtins" not in f and ".alt." not in f]
        if found:
            return found[0]
    return ctypes.util.find_library("nvrtc")


def _lib(path: str | None = None) -> ctypes.CDLL:
    path = path or find_nvrtc()
    if path is None:
        raise FileNotFoundError("no libnvrtc found (pip install nvidia-cuda-nvrtc-cu12, or set TANDEM_NVRTC)")
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def compile_ptx(source: str, name: str = "tandem.cu", options: tuple[str, ...] = (), arch: str = ARCH,
                lib_path: str | None = None) -> str:
    """PTX text of ``source`` compiled by NVRTC with ``options`` plus
    ``--gpu-architecture=arch``.

    Raises:
        CompileError: the source does not compile (the message is NVRTC's log).
        FileNotFoundError: no libnvrtc.
    """
    lib = _lib(lib_path)
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None))
    try:
        opts = [o.encode() for o in (*options, f"--gpu-architecture={arch}")]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)))
        log = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetProgramLog(prog, log))
        if rc != 0:
            raise CompileError(f"{name}: {lib.nvrtcGetErrorString(rc).decode()}\n{log.value.decode(errors='replace')}")
        _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)))
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(prog, ptx))
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(lib: ctypes.CDLL, rc: int) -> None:
    if rc != 0:
        raise CompileError(lib.nvrtcGetErrorString(rc).decode())


def nvrtc_version(lib_path: str | None = None) -> str:
    """NVRTC's version, ``"12.9"``."""
    lib = _lib(lib_path)
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
    return f"{major.value}.{minor.value}"


def canonical_ptx(ptx: str) -> str:
    """``ptx`` with comments and debug lines dropped and each function's
    virtual registers renamed in order of first appearance: two sources that
    compile to the same instructions give the same text, whatever names the
    compiler drew for its registers (what shows that a refactoring left a
    module's code unchanged)."""
    import re

    out, names = [], {}
    reg = re.compile(r"%(r|rd|f|fd|p|rs|h|hh)(\d+)\b")
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].rstrip()
        if not line or line.lstrip().startswith((".loc", ".file")):
            continue
        if line.startswith((".entry", ".func", ".visible", ".weak")):
            names = {}

        def rename(m: re.Match) -> str:
            key = m.group(0)
            if key not in names:
                names[key] = f"%{m.group(1)}_{sum(1 for k in names if k.startswith('%' + m.group(1)) and k[len(m.group(1)) + 1:].isdigit())}"
            return names[key]

        out.append(reg.sub(rename, line))
    return "\n".join(out) + "\n"
