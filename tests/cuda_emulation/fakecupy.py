"""The part of CuPy tandem's CUDA code uses, on the CPU (README.md here):
device arrays are NumPy arrays, and a ``RawModule``'s (or ``RawKernel``'s)
kernels are its CUDA source compiled by g++ against ``cuda_emu.h`` into a
shared library, each ``extern "C"`` kernel behind a launcher that takes
CuPy's argument tuple. Every call is synchronous: a stream's work is done
when the call that queues it returns, so events and synchronisations are
bookkeeping only.

What it checks that CuPy or the GPU would get wrong silently, or fault on:

* a launch: the argument count, and each argument's type against the
  kernel's parameter (a NumPy scalar of the parameter's exact type; for a
  pointer a device array, or an integer address inside a live device
  allocation or pinned/registered host memory -- ``np.uint64(0)`` is null;
  a NumPy array is refused, as CuPy refuses it), dynamic shared memory over
  48 KiB without ``max_dynamic_shared_size_bytes`` or over the H100's 227 KiB;
* a ``memcpyAsync``: the kind against the pointers (a device side must lie,
  with its whole length, in one live device allocation; a host side that
  lies in pinned memory, in it) and the stream;
* device arrays: ``cupy.empty`` and ``cupyx.empty_pinned`` give garbage, not
  zeros; an operation that mixes a device array with a NumPy array (other
  than a 0-d one) raises TypeError, as CuPy's does; ``get`` gives a NumPy
  array, ``set`` wants one of the same shape and dtype;
* events: ``get_elapsed_time`` of an event made with ``disable_timing`` (or
  never recorded) raises ``CUDARuntimeError``, as the runtime does.
"""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import types
import weakref

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(tempfile.gettempdir(), "tandem-cuda-emulation")  # compiled modules, by source hash
STATIC_SMEM = 48 * 1024  # dynamic shared memory a launch may use without opting in
MAX_SMEM = 227 * 1024  # an H100's most per block
GARBAGE = 0xAB  # what cupy.empty's and empty_pinned's bytes hold


# -- the address space: device allocations, pinned and registered host memory ---------------------
_lock = threading.Lock()
_regions: dict[int, tuple[int, int, str]] = {}  # key -> (start, end, kind: "device" | "pinned" | "registered")
_keys = itertools.count()


def _register(root: np.ndarray, kind: str) -> None:
    """Records ``root``'s memory as ``kind`` for as long as ``root`` lives."""
    start = root.__array_interface__["data"][0]
    key = next(_keys)
    with _lock:
        _regions[key] = (start, start + root.nbytes, kind)

    def forget(k=key):
        with _lock:
            _regions.pop(k, None)

    weakref.finalize(root, forget)


def _region(addr: int, size: int = 1) -> tuple[int, int, str] | None:
    """The live region holding ``addr`` (None: none), checked to hold ``size`` bytes from there."""
    with _lock:
        hits = [r for r in _regions.values() if r[0] <= addr < r[1] or (size == 0 and addr == r[1])]
    if not hits:
        return None
    start, end, kind = max(hits, key=lambda r: r[0])
    if addr + size > end:
        raise ValueError(f"{size} bytes at {addr:#x} run {addr + size - end} bytes past the end of a {kind} "
                         f"region of {end - start} bytes")
    return start, end, kind


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int, what: str = ""):
        self.status = status
        super().__init__(f"cudaError {status}: {what}")


class CUDADriverError(RuntimeError):
    pass


class OutOfMemoryError(MemoryError):
    pass


class MemoryPointer:
    """``ndarray.data``: its address (``ptr``)."""

    def __init__(self, ptr: int, owner):
        self.ptr, self.mem, self.device_id = ptr, owner, 0

    def __int__(self):
        return self.ptr

    def __add__(self, offset: int) -> "MemoryPointer":
        return MemoryPointer(self.ptr + offset, self.mem)


def _refuse_host(args, what: str) -> None:
    for a in args:
        if isinstance(a, (list, tuple)):
            _refuse_host(a, what)
        elif type(a) is np.ndarray and a.ndim > 0:
            raise TypeError(f"{what}: a NumPy array beside a device array (CuPy refuses implicit conversion)")


class ndarray(np.ndarray):
    """A device array: a NumPy array in device memory (a registered region),
    with CuPy's ``data.ptr``, ``set``, ``get`` and ``device``."""

    def __array_finalize__(self, obj):
        if self.base is None:  # new memory (a copy, a ufunc's result): a device allocation
            _register(self, "device")

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        _refuse_host(inputs, f"cupy.{ufunc.__name__}")
        if out is not None:
            _refuse_host(out, f"cupy.{ufunc.__name__} out=")
        args = [x.view(np.ndarray) if isinstance(x, ndarray) else x for x in inputs]
        if out is not None:
            kw["out"] = tuple(x.view(np.ndarray) if isinstance(x, ndarray) else x for x in out)
        result = getattr(ufunc, method)(*args, **kw)
        if out is not None:
            return out[0] if len(out) == 1 else out
        if isinstance(result, tuple):
            return tuple(_device(r) for r in result)
        return _device(result)

    def __setitem__(self, key, value):
        if type(value) is np.ndarray and value.ndim > 0:
            raise ValueError("a NumPy array assigned into a device array (CuPy's fill refuses a non-scalar "
                             "numpy.ndarray: use set() or cupy.asarray)")
        super().__setitem__(key, value)

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self.__array_interface__["data"][0], self)

    @property
    def device(self):
        return Device(0)

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray) or isinstance(arr, ndarray):  # CuPy's checks, in its order
            raise TypeError("set: only a numpy.ndarray can be set to a cupy.ndarray")
        if not self.flags.c_contiguous:
            raise RuntimeError("set: cannot set to a non-contiguous array")
        if arr.dtype != self.dtype:
            raise TypeError(f"set: a {arr.dtype} array cannot be set to a {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"set: shape mismatch, {arr.shape} into {self.shape}")
        np.copyto(self.view(np.ndarray), arr)

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is not None:
            if isinstance(out, ndarray) or out.shape != self.shape or out.dtype != self.dtype:
                raise ValueError("get: out= must be a NumPy array of the same shape and dtype")
            np.copyto(out, self.view(np.ndarray))
            return out
        return np.array(self.view(np.ndarray), copy=True, order=order)

    def __array_function__(self, func, types_, args, kwargs):
        _refuse_host(args, f"cupy.{func.__name__}")
        plain = [np.ndarray if t is ndarray else t for t in types_]
        result = super().__array_function__(func, plain, _plain(args), _plain(kwargs))
        return _device(result) if isinstance(result, np.ndarray) else result

    def item(self, *args):
        return self.view(np.ndarray).item(*args)

    def tolist(self):
        return self.view(np.ndarray).tolist()


def _plain(x):
    if isinstance(x, ndarray):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(y) for y in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _device(a):
    """``a`` (a NumPy result) as a device array: its memory a device allocation
    unless it is a view of one already."""
    if not isinstance(a, np.ndarray):
        return a
    if isinstance(a, ndarray):
        return a
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root, ndarray):
        base_addr = root.__array_interface__["data"][0]
        hit = _region(base_addr)
        if hit is None or hit[2] != "device":
            _register(root, "device")
    return a.view(ndarray)


def _new(a: np.ndarray) -> ndarray:
    """A fresh device allocation holding ``a``'s contents (``a`` is copied unless it is new)."""
    _register(a, "device")
    return a.view(ndarray)


int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
float16, float32, float64 = np.float16, np.float32, np.float64
bool_, intp, uint, int_ = np.bool_, np.intp, np.uint, np.int_
newaxis = None


def empty(shape, dtype=np.float64, order="C"):
    a = np.empty(shape, dtype, order)
    a.reshape(-1).view(np.uint8)[:] = GARBAGE  # garbage, not zeros, like a GPU's
    return _new(a)


def empty_like(a, dtype=None):
    return empty(a.shape, a.dtype if dtype is None else dtype)


def zeros(shape, dtype=np.float64, order="C"):
    return _new(np.zeros(shape, dtype, order))


def zeros_like(a, dtype=None):
    return zeros(a.shape, a.dtype if dtype is None else dtype)


def ones(shape, dtype=np.float64):
    return _new(np.ones(shape, dtype))


def full(shape, fill_value, dtype=None):
    return _new(np.full(shape, fill_value, dtype))


def arange(*args, **kw):
    return _new(np.arange(*args, **kw))


def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _new(np.array(_plain(a), dtype, copy=True, order="C" if order is None else order))


def array(a, dtype=None, copy=True, order="K"):
    return _new(np.array(_plain(a), dtype, copy=True, order=order))


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError("ascontiguousarray: not a device array")
    return _device(np.ascontiguousarray(a.view(np.ndarray), dtype))


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(out=out, order=order)
    return np.asarray(a, order=order)


def concatenate(arrays, axis=0, out=None, dtype=None):
    for a in arrays:
        if not isinstance(a, ndarray):
            raise TypeError(f"cupy.concatenate: {type(a).__name__}, not a device array")
    return _new(np.concatenate([a.view(np.ndarray) for a in arrays], axis=axis, dtype=dtype))


def stack(arrays, axis=0):
    for a in arrays:
        if not isinstance(a, ndarray):
            raise TypeError(f"cupy.stack: {type(a).__name__}, not a device array")
    return _new(np.stack([a.view(np.ndarray) for a in arrays], axis=axis))


def get_array_module(*args):
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


class _Pool:
    def free_all_blocks(self):
        pass

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0


_POOL = _Pool()


def get_default_memory_pool():
    return _POOL


def get_default_pinned_memory_pool():
    return _POOL


# -- cupyx ------------------------------------------------------------------------------------
def empty_pinned(shape, dtype=np.float64, order="C"):
    """A NumPy array in page-locked (pinned) host memory: mapped for the device, as CUDA's are under UVA."""
    a = np.empty(shape, dtype, order)
    a.reshape(-1).view(np.uint8)[:] = GARBAGE
    _register(a, "pinned")
    return a


def zeros_pinned(shape, dtype=np.float64, order="C"):
    a = np.zeros(shape, dtype, order)
    _register(a, "pinned")
    return a


cupyx = types.ModuleType("cupyx")
cupyx.empty_pinned, cupyx.zeros_pinned = empty_pinned, zeros_pinned


# -- devices, streams, events -----------------------------------------------------------------
class Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        if self.id != 0:
            raise CUDARuntimeError(101, "invalid device ordinal (the emulation has one device)")
        self.compute_capability = "90"

    def use(self):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return self.id


_stream_ptrs = itertools.count(0x5000)
_live_streams: dict[int, "Stream"] = {}
_tls = threading.local()


class Stream:
    """A stream: work on it is done when queued (synchronous), so it only has to be valid."""

    def __init__(self, null=False, non_blocking=False, ptds=False, _ptr=None):
        self.ptr = 0 if null else (_ptr if _ptr is not None else next(_stream_ptrs))
        _live_streams[self.ptr] = self
        self.device_id = 0

    def synchronize(self):
        pass

    @property
    def done(self):
        return True

    def query(self):
        return True

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event):
        if not isinstance(event, Event):
            raise TypeError("wait_event: not an Event")

    def use(self):
        _tls.stack = [self]
        return self

    def __enter__(self):
        if not hasattr(_tls, "stack"):
            _tls.stack = []
        _tls.stack.append(self)
        return self

    def __exit__(self, *exc):
        _tls.stack.pop()
        return False


class ExternalStream(Stream):
    def __init__(self, ptr, device_id=-1):
        if int(ptr) not in _live_streams:
            raise CUDARuntimeError(400, f"invalid resource handle: no stream at {int(ptr):#x}")
        super().__init__(_ptr=int(ptr))


Stream.null = Stream(null=True)


def get_current_stream(device_id=-1):
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else Stream.null


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        if interprocess and not disable_timing:
            raise CUDARuntimeError(1, "an interprocess event needs disable_timing")
        self.block, self.disable_timing = block, disable_timing
        self.at: float | None = None
        self.ptr = next(_stream_ptrs)

    def record(self, stream=None):
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError("record: not a Stream")
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return True

    @property
    def done(self):
        return True


def get_elapsed_time(start: Event, end: Event) -> float:
    for e in (start, end):
        if e.disable_timing:
            raise CUDARuntimeError(400, "cudaEventElapsedTime of an event made with disable_timing")
        if e.at is None:
            raise CUDARuntimeError(600, "cudaEventElapsedTime of an event never recorded")
    return (end.at - start.at) * 1e3


class _PointerAttributes:
    def __init__(self, device: int, host: int, kind: int):
        self.devicePointer, self.hostPointer, self.type, self.device = device, host, kind, 0


def _check_stream(stream) -> None:
    if int(stream) not in _live_streams:
        raise CUDARuntimeError(400, f"invalid resource handle: no stream at {int(stream):#x}")


def _side(addr: int, size: int, device: bool, what: str) -> None:
    hit = _region(addr, size)
    if device and (hit is None or hit[2] != "device"):
        raise CUDARuntimeError(1, f"{what}: {addr:#x} is not device memory"
                               + ("" if hit is None else f" (it is {hit[2]} host memory)"))
    if not device and hit is not None and hit[2] == "device":
        raise CUDARuntimeError(1, f"{what}: {addr:#x} is device memory, not host memory")


def _memcpy(dst: int, src: int, size: int, kind: int, what: str) -> None:
    dst, src, size = int(dst), int(src), int(size)
    if size < 0:
        raise CUDARuntimeError(1, f"{what}: {size} bytes")
    if kind in (0, 1, 2, 3):
        _side(src, size, kind in (2, 3), f"{what} source")
        _side(dst, size, kind in (1, 3), f"{what} destination")
    elif kind == 4:
        for a in (src, dst):
            _region(a, size)
    else:
        raise CUDARuntimeError(21, f"{what}: kind {kind}")
    if size:
        ctypes.memmove(dst, src, size)


def _memcpy_async(dst, src, size, kind, stream):
    _check_stream(stream)
    _memcpy(dst, src, size, kind, "memcpyAsync")


def _memcpy_sync(dst, src, size, kind):
    _memcpy(dst, src, size, kind, "memcpy")


def _pointer_attributes(ptr):
    hit = _region(int(ptr))
    if hit is None:  # pageable host memory: no device address
        return _PointerAttributes(0, int(ptr), 0)
    kind = {"device": 2, "pinned": 1, "registered": 1}[hit[2]]
    return _PointerAttributes(int(ptr), 0 if kind == 2 else int(ptr), kind)


_registered: dict[int, object] = {}


def _host_register(ptr, size, flags):
    ptr, size = int(ptr), int(size)
    if ptr in _registered or _region(ptr) is not None:
        raise CUDARuntimeError(712, f"cudaHostRegister: {ptr:#x} is registered (or device memory) already")
    holder = np.empty(0)  # the region's lifetime: until hostUnregister
    key = next(_keys)
    with _lock:
        _regions[key] = (ptr, ptr + size, "registered")
    _registered[ptr] = (key, holder)


def _host_unregister(ptr):
    entry = _registered.pop(int(ptr), None)
    if entry is None:
        raise CUDARuntimeError(713, f"cudaHostUnregister: {int(ptr):#x} is not registered")
    with _lock:
        _regions.pop(entry[0], None)


def _ipc_get_mem_handle(ptr):
    raise CUDARuntimeError(801, "cudaIpcGetMemHandle: not supported by the emulation")


runtime = types.SimpleNamespace(
    CUDARuntimeError=CUDARuntimeError,
    memcpyHostToHost=0, memcpyHostToDevice=1, memcpyDeviceToHost=2, memcpyDeviceToDevice=3, memcpyDefault=4,
    memcpyAsync=_memcpy_async, memcpy=_memcpy_sync, pointerGetAttributes=_pointer_attributes,
    hostRegister=_host_register, hostUnregister=_host_unregister, ipcGetMemHandle=_ipc_get_mem_handle,
    getDeviceCount=lambda: 1, getDevice=lambda: 0, deviceSynchronize=lambda: None,
    runtimeGetVersion=lambda: 12040, driverGetVersion=lambda: 12040,
    getDeviceProperties=lambda i: {"name": b"CUDA emulation (CPU)", "major": 9, "minor": 0,
                                   "multiProcessorCount": 132, "sharedMemPerBlockOptin": MAX_SMEM,
                                   "totalGlobalMem": 80 << 30},
)


class CompileException(Exception):
    pass


def _nvtx_push(*a, **k):
    pass


cuda = types.SimpleNamespace(
    Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event, get_elapsed_time=get_elapsed_time,
    get_current_stream=get_current_stream, runtime=runtime, MemoryPointer=MemoryPointer,
    driver=types.SimpleNamespace(CUDADriverError=CUDADriverError),
    memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError, MemoryPointer=MemoryPointer),
    compiler=types.SimpleNamespace(CompileException=CompileException),
    nvtx=types.SimpleNamespace(RangePush=_nvtx_push, RangePop=lambda: None, Mark=_nvtx_push),
    is_available=lambda: True,
)


# -- kernels ------------------------------------------------------------------------------------
_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\)', re.S)
# A __shared__ declaration: `__shared__ [__align__(n)] type name[dims]...;` (one name, no initialiser).
_SHARED = re.compile(r"__shared__\s+(?:__align__\(\s*(\d+)\s*\)\s+)?((?:\w+\s+)*?\w+)\s+(\w+)\s*((?:\[[^\]]+\]\s*)*);")
_SCALARS = {"int": np.int32, "long long": np.int64, "double": np.float64, "u32": np.uint32, "float": np.float32,
            "unsigned": np.uint32, "unsigned int": np.uint32, "unsigned long long": np.uint64, "u64": np.uint64,
            "long long int": np.int64, "short": np.int16, "unsigned char": np.uint8, "bool": np.bool_}
_CTYPES = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.float64: ctypes.c_double,
           np.uint32: ctypes.c_uint32, np.float32: ctypes.c_float, np.uint64: ctypes.c_uint64,
           np.int16: ctypes.c_int16, np.uint8: ctypes.c_uint8, np.bool_: ctypes.c_bool}
launches: list[tuple] = []  # (kernel, grid, block, shared_mem) of every launch, for tests to read


def _param_types(text: str) -> list[str]:
    if not text.strip():
        return []
    return [" ".join(p.replace("__restrict__", "").replace("const ", "").split()).rsplit(" ", 1)[0]
            .replace(" *", "*") for p in text.split(",")]


def _emulated_source(code: str) -> tuple[str, dict[str, list[str]]]:
    """The C++ the emulation compiles for CUDA ``code``, and its kernels'
    parameter types (of the kernels the preprocessor keeps)."""
    code = re.sub(r'asm volatile\("mov\.u64 %0, %%globaltimer;" : "=l"\((\w+)\)\);', r"\1 = emu::global_timer_ns();", code)
    code = code.replace("extern __shared__ __align__(16) unsigned char smem[];", "unsigned char* smem = emu::tl_smem;")
    ids = itertools.count()
    # Per block, as on a GPU (garbage at the block's start): emu::block_shared's arena of the running block.
    code = _SHARED.sub(lambda m: f"auto& {m.group(3)} = emu::block_shared<{m.group(2)}{m.group(4)}>({next(ids)});",
                       code)
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


def _pointer(a, name: str, i: int, t: str):
    """A pointer argument's address, checked as the GPU would need it."""
    if isinstance(a, ndarray):
        return a.__array_interface__["data"][0]
    if isinstance(a, MemoryPointer):
        addr = a.ptr
    elif isinstance(a, (np.uint64, np.int64)) or (type(a) is int):
        addr = int(a)
    elif isinstance(a, np.ndarray):
        raise TypeError(f"{name} argument {i} ({t}): a NumPy array (host memory; CuPy refuses it)")
    else:
        raise TypeError(f"{name} argument {i} ({t}): {type(a).__name__}")
    if addr == 0:
        return 0
    if _region(addr, 0) is None:
        raise TypeError(f"{name} argument {i} ({t}): {addr:#x} is neither device memory nor pinned "
                        "or registered host memory")
    return addr


class RawKernel:
    def __init__(self, code_or_lib, name: str, params: list[str] | None = None, options=(), **kw):
        if isinstance(code_or_lib, str):  # cupy.RawKernel(code, name, options)
            module = RawModule(code=code_or_lib, options=options)
            module.compile()
            code_or_lib, params = module.lib, module.kernels[name]
        self.lib, self.name, self.params = code_or_lib, name, params
        self.max_dynamic_shared_size_bytes = STATIC_SMEM

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        if not isinstance(grid, tuple) or not isinstance(block, tuple):
            raise TypeError(f"{self.name}: grid and block must be tuples")
        if len(grid) != 1 or len(block) != 1 or not 0 < block[0] <= 1024 or grid[0] < 1:
            raise ValueError(f"{self.name}: grid {grid}, block {block}")
        if not isinstance(args, tuple):
            raise TypeError(f"{self.name}: args must be a tuple")
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        if shared_mem > min(max(STATIC_SMEM, self.max_dynamic_shared_size_bytes), MAX_SMEM):
            raise ValueError(f"{self.name}: {shared_mem} bytes of dynamic shared memory "
                             f"(opted in: {self.max_dynamic_shared_size_bytes})")
        if stream is not None:
            _check_stream(stream.ptr)
        values = []
        for i, (a, t) in enumerate(zip(args, self.params)):
            if t.endswith("*"):
                values.append(ctypes.c_void_p(_pointer(a, self.name, i, t)))
            else:
                want = _SCALARS[t]
                if type(a) is int and want is np.int64 or type(a) is float and want is np.float64:
                    a = want(a)  # CuPy passes a Python int as int64, a float as double
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
    def __init__(self, code: str, options=(), **kw):
        self.code, self.options, self.lib, self.kernels = code, tuple(options), None, {}
        for o in self.options:  # NVRTC's options that change what the emulation must do
            if o not in ("-std=c++17", "--fmad=false") and not o.startswith(("-D", "--std=", "-arch", "--gpu")):
                raise CompileException(f"an NVRTC option the emulation does not know: {o}")

    def compile(self, *a, **kw):
        if self.lib is not None:
            return
        src, self.kernels = _emulated_source(self.code)
        defines = [o for o in self.options if o.startswith("-D")]
        support = "".join(open(os.path.join(HERE, f)).read() for f in ("cuda_emu.h", "cuda_emu.cpp"))
        key = hashlib.sha256((src + support + " ".join(defines)).encode()).hexdigest()[:16]
        os.makedirs(BUILD, exist_ok=True)
        so = os.path.join(BUILD, f"module_{key}.so")
        if not os.path.exists(so):
            cpp = os.path.join(BUILD, f"module_{key}.cpp")
            with open(cpp, "w") as f:
                f.write(src)
            # -ffp-contract=off: no fused multiply-add, as NVRTC's --fmad=false (the product always passes it)
            done = subprocess.run(["g++", "-std=c++17", "-O1", "-g", "-ffp-contract=off", "-fPIC", "-shared",
                                   "-pthread", "-w", *defines, f"-I{HERE}", cpp, os.path.join(HERE, "cuda_emu.cpp"),
                                   "-o", so + f".{os.getpid()}.tmp"], capture_output=True, text=True)
            if done.returncode:
                raise CompileException(done.stderr[-5000:])
            os.replace(so + f".{os.getpid()}.tmp", so)
        self.lib = ctypes.CDLL(so)

    def get_function(self, name: str) -> RawKernel:
        self.compile()
        if name not in self.kernels:
            raise CUDADriverError(f"CUDA_ERROR_NOT_FOUND: no kernel {name}")
        return RawKernel(self.lib, name, self.kernels[name])


def install() -> None:
    """This module as ``cupy`` (and its ``cupy.cuda...`` submodules, ``cupyx``) for every later import."""
    me = sys.modules[__name__]
    sys.modules["cupy"] = me
    sys.modules["cupyx"] = cupyx
    sys.modules["cupy.cuda"] = cuda
    sys.modules["cupy.cuda.runtime"] = runtime
    sys.modules["cupy.cuda.nvtx"] = cuda.nvtx
