"""The part of CuPy tandem's CUDA code uses, on the CPU (README.md here):
device arrays are NumPy arrays, and a ``RawModule``'s kernels are its CUDA
source compiled by g++ against ``cuda_emu.h`` into a shared library, each
``extern "C"`` kernel behind a launcher that takes CuPy's argument tuple.

A launch checks what CuPy would get wrong silently or the GPU would fault
on: the argument count and each argument's type against the kernel's
parameter (a NumPy scalar of the parameter's width, a device array or a
null ``np.uint64(0)`` for a pointer), dynamic shared memory over 48 KiB
without ``max_dynamic_shared_size_bytes`` or over the H100's 227 KiB.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(tempfile.gettempdir(), "tandem-cuda-emulation")  # compiled modules, by source hash
STATIC_SMEM = 48 * 1024  # dynamic shared memory a launch may use without opting in
MAX_SMEM = 227 * 1024  # an H100's most per block


class ndarray(np.ndarray):
    """A device array: a NumPy array with CuPy's ``set`` and ``get``."""

    def set(self, host):
        host = np.asarray(host)
        if host.shape != self.shape or host.dtype != self.dtype:
            raise ValueError(f"set: {host.dtype} {host.shape} into {self.dtype} {self.shape}")
        self[...] = host

    def get(self):
        return np.array(self, copy=True).view(np.ndarray)


def empty(shape, dtype=np.float64):
    a = np.empty(shape, dtype).view(ndarray)
    a.view(np.uint8).reshape(-1)[:] = 0xAB  # garbage, not zeros, like a GPU's
    return a


def zeros(shape, dtype=np.float64):
    return np.zeros(shape, dtype).view(ndarray)


def full(shape, value, dtype=None):
    return np.full(shape, value, dtype).view(ndarray)


def asarray(x, dtype=None):
    return np.ascontiguousarray(np.asarray(x, dtype)).view(ndarray)


class _Device:
    def __init__(self, i: int = 0):
        self.id = i

    def synchronize(self):
        pass


class _Stream:
    def synchronize(self):
        pass


class CompileException(Exception):
    pass


cuda = types.SimpleNamespace(Device=_Device, get_current_stream=lambda: _Stream(),
                             compiler=types.SimpleNamespace(CompileException=CompileException))

_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\)', re.S)
_SCALARS = {"int": np.int32, "long long": np.int64, "double": np.float64, "u32": np.uint32, "float": np.float32}
_CTYPES = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.float64: ctypes.c_double,
           np.uint32: ctypes.c_uint32, np.float32: ctypes.c_float}
launches: list[tuple] = []  # (kernel, grid, block, shared_mem) of every launch, for tests to read


def _param_types(text: str) -> list[str]:
    return [" ".join(p.split()).rsplit(" ", 1)[0].replace("const ", "") for p in text.split(",")]


def _emulated_source(code: str) -> tuple[str, dict[str, list[str]]]:
    """The C++ the emulation compiles for CUDA ``code``, and its kernels'
    parameter types (of the kernels the preprocessor keeps)."""
    code = code.replace('asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));',
                        "t = (u64)std::chrono::steady_clock::now().time_since_epoch().count();")
    code = code.replace("extern __shared__ __align__(16) unsigned char smem[];", "unsigned char* smem = emu::tl_smem;")
    kept = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-"], input=code, capture_output=True, text=True).stdout
    kernels = {m.group(1): _param_types(m.group(2)) for m in _KERNEL.finditer(kept)}
    launchers = [
        f'extern "C" int emu_launch_{name}(unsigned gx, unsigned bx, unsigned long long smem, void** a, int n) {{\n'
        f"  if (n != {len(params)}) return -1;\n"
        f"  emu::run_grid(dim3e{{gx, 1, 1}}, dim3e{{bx, 1, 1}}, smem, [&] {{ "
        f"{name}({', '.join(f'*({t}*)a[{i}]' for i, t in enumerate(params))}); }});\n"
        f"  return 0;\n}}\n"
        for name, params in kernels.items()]
    return '#include "cuda_emu.h"\n#include <chrono>\n' + code + "\n" + "".join(launchers), kernels


class RawKernel:
    def __init__(self, lib, name: str, params: list[str]):
        self.lib, self.name, self.params = lib, name, params
        self.max_dynamic_shared_size_bytes = STATIC_SMEM

    def __call__(self, grid, block, args, shared_mem=0):
        if len(grid) != 1 or len(block) != 1 or block[0] > 1024:
            raise ValueError(f"{self.name}: grid {grid}, block {block}")
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        if shared_mem > min(max(STATIC_SMEM, self.max_dynamic_shared_size_bytes), MAX_SMEM):
            raise ValueError(f"{self.name}: {shared_mem} bytes of dynamic shared memory "
                             f"(opted in: {self.max_dynamic_shared_size_bytes})")
        values = []
        for i, (a, t) in enumerate(zip(args, self.params)):
            if t.endswith("*"):
                if isinstance(a, ndarray):
                    values.append(ctypes.c_void_p(a.ctypes.data))
                elif isinstance(a, np.uint64) and int(a) == 0:
                    values.append(ctypes.c_void_p(0))
                else:
                    raise TypeError(f"{self.name} argument {i} ({t}): {type(a).__name__}")
            else:
                want = _SCALARS[t]
                if not (isinstance(a, np.generic) and a.dtype == want):
                    raise TypeError(f"{self.name} argument {i} ({t}): {type(a).__name__}, not {want.__name__}")
                values.append(_CTYPES[want](a.item()))
        ptrs = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p).value
                                                 for v in values])
        launches.append((self.name, grid[0], block[0], shared_mem))
        launch = getattr(self.lib, f"emu_launch_{self.name}")
        if launch(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), ctypes.c_ulonglong(shared_mem), ptrs,
                  len(values)) != 0:
            raise RuntimeError(f"{self.name}: the launcher refused the arguments")


class RawModule:
    def __init__(self, code: str, options=()):
        self.code, self.options, self.lib, self.kernels = code, options, None, {}

    def compile(self):
        if self.lib is not None:
            return
        src, self.kernels = _emulated_source(self.code)
        support = "".join(open(os.path.join(HERE, f)).read() for f in ("cuda_emu.h", "cuda_emu.cpp"))
        key = hashlib.sha256((src + support).encode()).hexdigest()[:16]
        os.makedirs(BUILD, exist_ok=True)
        so = os.path.join(BUILD, f"module_{key}.so")
        if not os.path.exists(so):
            cpp = os.path.join(BUILD, f"module_{key}.cpp")
            with open(cpp, "w") as f:
                f.write(src)
            done = subprocess.run(["g++", "-std=c++17", "-O1", "-g", "-ffp-contract=off", "-fPIC", "-shared",
                                   "-pthread", "-w", f"-I{HERE}", cpp, os.path.join(HERE, "cuda_emu.cpp"),
                                   "-o", so + ".tmp"], capture_output=True, text=True)
            if done.returncode:
                raise CompileException(done.stderr[-5000:])
            os.replace(so + ".tmp", so)
        self.lib = ctypes.CDLL(so)

    def get_function(self, name: str) -> RawKernel:
        self.compile()
        return RawKernel(self.lib, name, self.kernels[name])


def install() -> None:
    """This module as ``cupy`` for every later import."""
    sys.modules["cupy"] = sys.modules[__name__]
