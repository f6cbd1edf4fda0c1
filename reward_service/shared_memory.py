"""Shared-memory tensors: regions a client registers once, which ``Evaluate``'s
inputs and outputs then name (region, offset, byte size) instead of carrying
their bytes through gRPC.

The design is Triton Inference Server's shared-memory extension (system and
CUDA shared memory: register, unregister and status calls, then inputs and
outputs that point into a registered region), with what Triton leaves to the
deployment added here: regions belong to a client, are limited per client,
and are leased, so a client that goes away without unregistering does not
leave them mapped for ever. Why at all: under a trainer's bulk load the cost
of a 9.6 MB batch is the Python gRPC server taking the message in, not the
model (docs/design.md, "Measured physics", consequence 6).

Two kinds of region:

* **system**: a POSIX shared-memory object on this host (``shm_open``, as
  Python's ``multiprocessing.shared_memory`` makes them), mapped once at registration.
  Inputs are NumPy arrays straight over the mapping (``np.frombuffer``, no
  copy: on the CPU a lone request's arrays reach ONNX Runtime as they are),
  outputs are copied into it.
* **cuda**: a CUDA allocation of another process on this server's device,
  opened from its IPC handle with CuPy (``cudaIpcOpenMemHandle``). Inputs are
  copied device to host, because the batcher and the sessions take NumPy
  arrays; outputs host to device.

The region table's invariants:

* ``RegionTable._lock`` guards ``_regions`` (name -> :class:`Region`), every
  Region's ``uses``, ``unregistered`` and ``expires``, and ``_deferred``. It is
  never held while a mapping is opened or closed, nor while bytes are read or
  written, so one slow client cannot stall the others' calls.
* A region belongs to the ``client_id`` that registered it: only that client
  may name it in ``Evaluate``, renew it or unregister it. Names are unique on
  the server.
* ``uses`` counts the requests holding the region (a :class:`Lease`). A region
  leaves the table when it is unregistered: by its client, by the reaper once
  its lease expired unused, or at shutdown. Its mapping is closed by whoever
  drops the last of the two holds, the table entry and the uses: the
  unregistering call when no request uses it, otherwise the last lease
  released. A mapping is therefore never closed under a request reading or
  writing it; such a request fails with FAILED_PRECONDITION instead of
  writing outputs into memory its client has given up.
* A NumPy array over a system mapping may outlive its request: the batcher's
  worker keeps its last batch until the next one, and a request whose
  deadline passes while its batch runs returns (releasing its lease) before
  the model is done reading. Closing then raises ``BufferError`` and unmaps
  nothing: the mapping waits in ``_deferred`` and the reaper closes it once
  the last array is gone. No array ever points into unmapped memory.
* The lease: every use of a region (acquire and release) and every status
  call of its client renews it to ``lease_ttl_ms`` from now; the reaper thread
  unregisters a region whose lease ran out while no request used it.

Errors are :class:`SharedMemoryError` with the gRPC status the servicer
answers: NOT_FOUND (no region or object of that name), INVALID_ARGUMENT
(bounds, sizes, alignment, malformed or unopenable handles), ALREADY_EXISTS,
FAILED_PRECONDITION (another client's region, a CUDA region on a host without
a GPU or on another device, a region unregistered while in use, an object
shrunk under its registration), RESOURCE_EXHAUSTED (the limits of
``reward.shared_memory``, :class:`tandem.config.SharedMemoryConfig`).
"""
from __future__ import annotations

import _posixshmem  # shm_open, as multiprocessing.shared_memory uses it (see _SystemMemory)
import collections
import contextlib
import ctypes
import logging
import math
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import grpc
import numpy as np
from tandem.v1 import reward_pb2

from tandem import tensors
from tandem.config import SharedMemoryConfig
from tandem.errors import quote
from tandem.gpu import cupy_module

log = logging.getLogger(__name__)

CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
MAX_NAME_CHARS = 256  # client ids and region names
SERVICE_DEVICE = 0  # the reward service's CUDA device: ONNX Runtime's and CuPy's default (CUDA_VISIBLE_DEVICES picks the GPU)


class SharedMemoryError(Exception):
    """A shared-memory call or reference that cannot be served; ``code`` is the
    gRPC status to answer with, the message names what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _error(code: grpc.StatusCode, message: str) -> SharedMemoryError:
    return SharedMemoryError(code, message)


# -- the memory behind a region ------------------------------------------------


def _open_object(key: str) -> int:
    """A read-write descriptor of the existing POSIX shared-memory object ``key``.

    Raises:
        SharedMemoryError: NOT_FOUND (no such object), PERMISSION_DENIED,
            INVALID_ARGUMENT (a malformed key).
    """
    name = key.lstrip("/")
    if not name or "/" in name or "\0" in name:
        raise _error(grpc.StatusCode.INVALID_ARGUMENT, f"system.key: {quote(key)} is not a POSIX shared-memory name")
    try:
        return _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise _error(grpc.StatusCode.NOT_FOUND, f"system.key: no shared-memory object {quote(key)} on the server's host") from None
    except PermissionError:
        raise _error(grpc.StatusCode.PERMISSION_DENIED, f"system.key: the server may not open {quote(key)} read-write") from None
    except OSError as exc:
        raise _error(grpc.StatusCode.INVALID_ARGUMENT, f"system.key: cannot open {quote(key)}: {exc.strerror}") from None


class _SystemMemory:
    """A window [offset, offset + byte_size) of a POSIX shared-memory object, mapped.

    ``multiprocessing.shared_memory.SharedMemory`` makes the same two calls
    (``shm_open``, ``mmap``), but before Python 3.13 (no ``track=False``) attaching
    registers the object with this process's resource tracker, which unlinks
    it when the server exits, and a failed ``mmap`` unlinks it at once: the
    client's object, not the server's to remove. So they are made here,
    through the module SharedMemory itself uses, and nothing is ever unlinked.
    """

    kind = "system"

    def __init__(self, key: str, offset: int, byte_size: int):
        self.key, self.offset, self.byte_size = key, offset, byte_size
        self._fd = _open_object(key)  # kept open: check() asks it the object's size
        try:
            size = os.fstat(self._fd).st_size
            if offset + byte_size > size:
                raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                             f"system: offset {offset} + byte_size {byte_size} exceeds the object {quote(key)} ({size} bytes)")
            self._mmap = mmap.mmap(self._fd, offset + byte_size)
        except BaseException:
            os.close(self._fd)
            raise

    def check(self, region: str) -> None:
        """Refuses a region whose object its owner shrank below the window:
        touching pages past an object's end raises SIGBUS, which would kill the server."""
        size = os.fstat(self._fd).st_size
        if size < self.offset + self.byte_size:
            raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                         f"region {quote(region)}: its object {quote(self.key)} shrank to {size} bytes, below the "
                         f"registered offset {self.offset} + byte_size {self.byte_size}; register it again")

    def _window(self, offset: int, nbytes: int) -> memoryview:
        # Arrays over this view hold the mapping: mmap.close() raises BufferError while they live.
        start = self.offset + offset
        return memoryview(self._mmap)[start : start + nbytes]

    def read(self, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` bytes at ``offset`` of the region, read-only, not copied."""
        return self._window(offset, nbytes).toreadonly()

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A read-only NumPy array over the region's bytes from ``offset``, not copied."""
        # math.prod, not np.prod: a shape's product in Python ints, without NumPy's per-call overhead
        return np.ndarray(shape, dtype, self.read(offset, math.prod(shape) * dtype.itemsize))

    def write(self, offset: int, array: np.ndarray) -> None:
        np.copyto(np.ndarray(array.shape, array.dtype, self._window(offset, array.nbytes)), array)

    def close(self) -> None:
        """Unmaps and closes the descriptor; raises BufferError (and unmaps
        nothing) while arrays over the mapping live. Idempotent."""
        if self._fd < 0:
            return
        self._mmap.close()
        os.close(self._fd)
        self._fd = -1

    def describe(self) -> dict:
        return {"key": self.key, "offset": self.offset}


def _allocation_bytes(ptr: int) -> int | None:
    """Size of the CUDA allocation that starts at ``ptr`` (cuMemGetAddressRange),
    or None where the driver cannot say."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    if lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return size.value - (ptr - base.value)


_VIEWS_KEPT = 64  # per CUDA region, the most recently used: a leaf channel's, one per output and wave size


class _CudaMemory:
    """A CUDA allocation of another process, opened from its IPC handle."""

    kind = "cuda"

    def __init__(self, handle: bytes, device_id: int, byte_size: int):
        cupy = cupy_module()
        if cupy is None:
            raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                         "cuda: this server has no GPU that CuPy can use; register system shared memory instead")
        if len(handle) != CUDA_IPC_HANDLE_BYTES:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"cuda.raw_handle: {len(handle)} bytes; a cudaIpcMemHandle_t has {CUDA_IPC_HANDLE_BYTES}")
        if device_id != SERVICE_DEVICE:
            raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                         f"cuda.device_id: {device_id}, but this server runs on device {SERVICE_DEVICE}")
        self._cp, self.device_id, self.byte_size = cupy, device_id, byte_size
        # (offset, dtype, shape) -> the view array() made, least recently used first: a leaf
        # channel asks for the same few views wave after wave, and a CuPy array over foreign
        # memory costs ~10 µs to make (slicing one, ~5).
        self._views: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(device_id):
            try:
                self._ptr = runtime.ipcOpenMemHandle(handle)
            except runtime.CUDARuntimeError as exc:
                raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                             f"cuda.raw_handle: cannot be opened ({exc}): stale (its allocation was freed or its "
                             f"process ended), exported by this server's own process, or not a CUDA IPC handle") from None
            try:
                self._check_allocation(runtime)
            except BaseException:
                runtime.ipcCloseMemHandle(self._ptr)
                raise

    def _check_allocation(self, runtime) -> None:
        device = runtime.pointerGetAttributes(self._ptr).device
        if device != self.device_id:  # opened through peer access: another GPU's memory
            raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                         f"cuda: the allocation is on device {device}, this server runs on device {self.device_id}")
        size = _allocation_bytes(self._ptr)
        if size is None:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT, "cuda: the driver cannot tell the allocation's size")
        if self.byte_size > size:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"cuda: byte_size {self.byte_size} exceeds the allocation ({size} bytes)")

    def check(self, region: str) -> None:
        pass  # a CUDA allocation cannot shrink; freeing it is its process's business (the mapping stays valid)

    def _on_device(self):
        """This allocation's device as the current one: a no-op context when
        the calling thread is on it already (a lane's worker, a leaf channel's
        thread: all on the service's device), else ``cupy.cuda.Device``'s, which
        switches and switches back."""
        if self._cp.cuda.runtime.getDevice() == self.device_id:
            return contextlib.nullcontext()
        return self._cp.cuda.Device(self.device_id)

    def _view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
        cp = self._cp
        nbytes = math.prod(shape) * dtype.itemsize
        memory = cp.cuda.UnownedMemory(self._ptr + offset, nbytes, self, device_id=self.device_id)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0))

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
        """A CuPy array over the allocation's bytes from ``offset``, not copied
        (the same array for the same arguments while it stays among the
        ``_VIEWS_KEPT`` most recently asked for)."""
        key = (offset, dtype, tuple(shape))
        view = self._views.get(key)
        if view is None:
            with self._on_device():
                view = self._view(offset, dtype, shape)
            self._views[key] = view
            if len(self._views) > _VIEWS_KEPT:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(key)
        return view

    def read(self, offset: int, nbytes: int) -> memoryview:
        """A host copy of ``nbytes`` bytes at ``offset`` (waits for the copy).

        The batcher takes host arrays, so this copies device to host; IO binding
        the sessions' inputs straight to this device buffer (reward_service/session.py's
        bound runner) would save the copy and the round trip."""
        with self._on_device():
            return memoryview(self._view(offset, np.dtype(np.uint8), (nbytes,)).get())

    def write(self, offset: int, array: np.ndarray) -> None:
        with self._on_device():
            self._view(offset, array.dtype, array.shape).set(np.ascontiguousarray(array))
            self._cp.cuda.Stream.null.synchronize()  # in place before the reply tells the client

    def close(self) -> None:
        self._views.clear()
        with self._cp.cuda.Device(self.device_id):
            # A request that gave up at its deadline may have left a copy from this memory
            # queued on a lane's stream; the mapping goes only once nothing can touch it.
            self._cp.cuda.runtime.deviceSynchronize()
            self._cp.cuda.runtime.ipcCloseMemHandle(self._ptr)

    def describe(self) -> dict:
        return {"device_id": self.device_id}


# -- the table -------------------------------------------------------------------


@dataclass(eq=False)
class Region:
    """A registered region: ``byte_size`` bytes of ``memory``, owned by ``client_id``.
    ``uses``, ``unregistered`` and ``expires`` (time.monotonic s) are guarded by
    the table's lock."""

    name: str
    client_id: str
    byte_size: int
    memory: _SystemMemory | _CudaMemory
    expires: float
    uses: int = 0
    unregistered: bool = False


@dataclass(frozen=True)
class RegionStatus:
    """What SharedMemoryStatus reports of one region (expires_in_ms: lease left, ms)."""

    name: str
    kind: str  # "system" | "cuda"
    byte_size: int
    memory: dict  # system: key, offset; cuda: device_id
    in_flight: int
    expires_in_ms: float


@dataclass(frozen=True)
class TensorView:
    """A request's input tensor with its bytes in a region: the fields of
    ``reward_pb2.Tensor`` that ``ModelSession.decode`` reads, ``data`` a
    bytes-like view (over the mapping itself for system regions)."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    data: memoryview | bytes


def _check_name(field: str, value: str) -> None:
    if not value:
        raise _error(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: must not be empty")
    if len(value) > MAX_NAME_CHARS:
        raise _error(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {len(value)} characters, at most {MAX_NAME_CHARS}")


class RegionTable:
    """Every registered region of one reward service (the invariants: module docstring).

    Args:
        cfg: limits and the lease (``reward.shared_memory``).
        clock: monotonic seconds (tests pass a fake one and call :meth:`reap`).
    """

    def __init__(self, cfg: SharedMemoryConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self._ttl_s = cfg.lease_ttl_ms / 1e3
        self._clock = clock
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}  # guarded by _lock
        self._deferred: list = []  # guarded by _lock: unregistered memory whose close met live arrays
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # -- registration ------------------------------------------------------------

    def register_system(self, client_id: str, name: str, byte_size: int, key: str, offset: int) -> None:
        """Maps ``byte_size`` bytes at ``offset`` of the POSIX shared-memory
        object ``key`` as region ``name`` of ``client_id``.

        Raises:
            SharedMemoryError: see the module docstring (and :func:`_attach`).
        """
        self._register(client_id, name, byte_size, lambda: _SystemMemory(key, offset, byte_size))

    def register_cuda(self, client_id: str, name: str, byte_size: int, raw_handle: bytes, device_id: int) -> None:
        """Opens the CUDA IPC handle ``raw_handle`` (an allocation of at least
        ``byte_size`` bytes on ``device_id``) as region ``name`` of ``client_id``.

        Raises:
            SharedMemoryError: FAILED_PRECONDITION without a usable GPU or on
                another device; INVALID_ARGUMENT for a malformed, stale or
                foreign handle or a byte_size beyond the allocation; as
                :meth:`register_system` otherwise.
        """
        self._register(client_id, name, byte_size, lambda: _CudaMemory(raw_handle, device_id, byte_size))

    def _register(self, client_id: str, name: str, byte_size: int, open_memory: Callable) -> None:
        _check_name("client_id", client_id)
        _check_name("name", name)
        if byte_size <= 0:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT, "byte_size: must be > 0")
        with self._lock:
            self._admit_locked(client_id, name, byte_size)  # refuse early, before mapping anything
        memory = open_memory()  # outside the lock: system calls, maybe the CUDA driver
        try:
            with self._lock:  # again: another call may have taken the name or the room meanwhile
                self._admit_locked(client_id, name, byte_size)
                self._regions[name] = Region(name, client_id, byte_size, memory, self._clock() + self._ttl_s)
        except SharedMemoryError:
            self._close(memory)
            raise

    def _admit_locked(self, client_id: str, name: str, byte_size: int) -> None:
        if name in self._regions:
            raise _error(grpc.StatusCode.ALREADY_EXISTS, f"name: a region {quote(name)} is already registered")
        cfg = self.cfg
        mine = [r for r in self._regions.values() if r.client_id == client_id]
        if len(mine) >= cfg.max_regions_per_client:
            raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"client {quote(client_id)} holds {len(mine)} regions, the most "
                         f"reward.shared_memory.max_regions_per_client allows")
        held = sum(r.byte_size for r in mine)
        if held + byte_size > cfg.max_bytes_per_client:
            raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"byte_size: client {quote(client_id)} holds {held} bytes; {byte_size} more passes "
                         f"reward.shared_memory.max_bytes_per_client ({cfg.max_bytes_per_client})")
        if len(self._regions) >= cfg.max_regions:
            raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the server holds {len(self._regions)} regions, reward.shared_memory.max_regions")

    def _owned_locked(self, client_id: str, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise _error(grpc.StatusCode.NOT_FOUND, f"region {quote(name)}: not registered")
        if region.client_id != client_id:
            raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                         f"region {quote(name)}: registered by another client, not by client_id {quote(client_id)}")
        return region

    def unregister(self, client_id: str, name: str = "") -> list[str]:
        """Unregisters region ``name`` of ``client_id`` (empty: all of its
        regions) and returns the names. A region a request is using is closed
        when that request releases it.

        Raises:
            SharedMemoryError: INVALID_ARGUMENT (empty client_id), NOT_FOUND,
                FAILED_PRECONDITION (another client's region).
        """
        _check_name("client_id", client_id)
        with self._lock:
            if name:
                regions = [self._owned_locked(client_id, name)]
            else:
                regions = [r for r in self._regions.values() if r.client_id == client_id]
            idle = [self._drop_locked(r) for r in regions]
        for region, close_now in zip(regions, idle):
            if close_now:
                self._close(region.memory)
        return [r.name for r in regions]

    def _drop_locked(self, region: Region) -> bool:
        """Takes ``region`` out of the table; True when no request holds it
        (the caller closes it), else the last lease released will."""
        del self._regions[region.name]
        region.unregistered = True
        return region.uses == 0

    def status(self, client_id: str, name: str = "") -> list[RegionStatus]:
        """``client_id``'s regions (or region ``name``), each lease renewed
        first: a status call is the client's heartbeat.

        Raises:
            SharedMemoryError: as :meth:`unregister`.
        """
        _check_name("client_id", client_id)
        with self._lock:
            now = self._clock()
            regions = [self._owned_locked(client_id, name)] if name else sorted(
                (r for r in self._regions.values() if r.client_id == client_id), key=lambda r: r.name)
            for r in regions:
                r.expires = now + self._ttl_s
            return [RegionStatus(r.name, r.memory.kind, r.byte_size, r.memory.describe(), r.uses,
                                 min((r.expires - now) * 1e3, self.cfg.lease_ttl_ms)) for r in regions]  # no float overshoot

    # -- use -----------------------------------------------------------------------

    def acquire(self, client_id: str, names: Iterable[str]) -> Lease:
        """Holds the regions ``names`` of ``client_id`` for one request until
        the returned lease is closed (they stay mapped until then).

        Raises:
            SharedMemoryError: INVALID_ARGUMENT (empty client_id), NOT_FOUND,
                FAILED_PRECONDITION (another client's region, or an object
                shrunk below its registration).
        """
        names = sorted(set(names))
        if not names:
            return Lease(self, {})
        if not client_id:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         "client_id: needed when a tensor names a shared-memory region (the region's owner)")
        with self._lock:
            regions = {n: self._owned_locked(client_id, n) for n in names}
            now = self._clock()
            for r in regions.values():
                r.uses += 1
                r.expires = now + self._ttl_s
        lease = Lease(self, regions)
        try:
            for r in regions.values():
                r.memory.check(r.name)
        except BaseException:
            lease.close()
            raise
        return lease

    def _release(self, regions: Iterable[Region]) -> None:
        with self._lock:
            now = self._clock()
            to_close = []
            for r in regions:
                r.uses -= 1
                r.expires = now + self._ttl_s
                if r.unregistered and r.uses == 0:
                    to_close.append(r.memory)
        for memory in to_close:
            self._close(memory)

    def _close(self, memory) -> None:
        try:
            memory.close()
        except BufferError:  # arrays over the mapping still live: unmapped later, by the reaper
            with self._lock:
                self._deferred.append(memory)
        except Exception as exc:  # a CUDA error on close must not fail the call that freed the region
            log.warning("shared memory: closing a %s region failed: %s", memory.kind, exc)

    # -- the lease's end ----------------------------------------------------------

    def reap(self) -> list[str]:
        """Unregisters and closes every region whose lease expired while no
        request used it, retries the deferred closes, and returns the names reaped."""
        with self._lock:
            now = self._clock()
            expired = [r for r in self._regions.values() if r.uses == 0 and r.expires <= now]
            for r in expired:
                self._drop_locked(r)
            retry, self._deferred = self._deferred, []
        for r in expired:
            log.info("shared memory: region %r of client %r expired unused; closed", r.name, r.client_id)
            self._close(r.memory)
        for memory in retry:
            self._close(memory)
        return [r.name for r in expired]

    def start(self) -> None:
        """Starts the reaper thread (every quarter lease, at most 1 s apart)."""
        interval = min(max(self._ttl_s / 4, 0.01), 1.0)

        def loop():
            while not self._stop.wait(interval):
                try:
                    self.reap()
                except Exception:  # the reaper must outlive any one bad close
                    log.exception("shared memory: reaping failed")

        self._reaper = threading.Thread(target=loop, name="shm-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        """Stops the reaper and closes every region (the server has drained its requests)."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(5.0)
        with self._lock:
            regions = list(self._regions.values())
            for r in regions:
                self._drop_locked(r)
            deferred, self._deferred = self._deferred, []
        for memory in [r.memory for r in regions if r.uses == 0] + deferred:
            self._close(memory)

    def stats(self) -> dict:
        """{"regions": registered, "bytes": their byte_size summed, "deferred": closes waiting for arrays to go}."""
        with self._lock:
            return {"regions": len(self._regions), "bytes": sum(r.byte_size for r in self._regions.values()),
                    "deferred": len(self._deferred)}


class Lease:
    """The regions one request holds, from :meth:`RegionTable.acquire` to
    :meth:`close` (or the end of a ``with`` block): it reads the request's
    inputs from them and writes its outputs into them. One request's, one thread's."""

    def __init__(self, table: RegionTable, regions: dict[str, Region]):
        self._table, self._regions = table, regions
        self._closed = False

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed and self._regions:
            self._closed = True
            self._table._release(self._regions.values())  # noqa: SLF001 - the table's own helper

    def _span(self, field: str, ref: reward_pb2.SharedMemoryRef, itemsize: int) -> Region:
        """The region of ``ref``, after checking that its span lies inside it and is aligned."""
        region = self._regions[ref.region]
        if ref.offset + ref.byte_size > region.byte_size:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{field}: offset {ref.offset} + byte_size {ref.byte_size} exceeds region "
                         f"{quote(ref.region)} ({region.byte_size} bytes)")
        if ref.offset % itemsize:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{field}: offset {ref.offset} is not a multiple of the dtype's {itemsize} bytes")
        return region

    def input(self, tensor: reward_pb2.Tensor) -> TensorView:
        """The input ``tensor`` (its ``shared_memory`` set) as a view over its
        region, for ``ModelSession.decode``: no copy for a system region, a host
        copy for a CUDA one. A tensor whose dtype or shape is itself wrong gets
        empty data, which ``decode`` then refuses naming that field.

        Raises:
            SharedMemoryError: INVALID_ARGUMENT: the span leaves the region, is
                misaligned, or byte_size is not prod(shape) * itemsize.
        """
        ref, shape = tensor.shared_memory, tuple(tensor.shape)
        field = f"inputs[{quote(tensor.name)}].shared_memory"
        try:
            dtype = tensors.numpy_dtype(tensor.dtype)
        except ValueError:
            return TensorView(tensor.name, tensor.dtype, shape, b"")
        if any(d < 0 for d in shape):
            return TensorView(tensor.name, tensor.dtype, shape, b"")
        region = self._span(field, ref, dtype.itemsize)
        expected = math.prod(shape) * dtype.itemsize
        if ref.byte_size != expected:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{field}.byte_size: {ref.byte_size}, but shape {list(shape)} of "
                         f"{tensors.dtype_name(tensor.dtype)} needs {expected}")
        return TensorView(tensor.name, tensor.dtype, shape, region.memory.read(ref.offset, expected))

    def check_output(self, name: str, ref: reward_pb2.SharedMemoryRef, dtype: int, nbytes: int | None) -> None:
        """Checks, before the request is queued, that output ``name`` (``nbytes``
        of ``dtype``, None where its shape is known only after the run) fits ``ref``.

        Raises:
            SharedMemoryError: INVALID_ARGUMENT: outside the region, misaligned, or too small.
        """
        field = f"output_shared_memory[{quote(name)}]"
        self._span(field, ref, tensors.numpy_dtype(dtype).itemsize)
        if nbytes is not None and ref.byte_size < nbytes:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{field}.byte_size: {ref.byte_size}, but the output needs {nbytes}")

    def describe(self) -> dict[str, tuple[str, int]]:
        """Region name -> (kind, byte_size) of every region held."""
        return {n: (r.memory.kind, r.byte_size) for n, r in self._regions.items()}

    def system_offset(self, region: str) -> int | None:
        """The held region's offset in its POSIX object (None: a CUDA region)."""
        memory = self._regions[region].memory
        return memory.offset if memory.kind == "system" else None

    def array(self, region: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
        """``shape`` of ``dtype`` at ``offset`` of the held region ``region``, not
        copied: a read-only NumPy array over a system region, a CuPy array over
        a CUDA one. The caller has checked the span against the region's size."""
        return self._regions[region].memory.array(offset, np.dtype(dtype), shape)

    def write(self, region: str, offset: int, array: np.ndarray) -> None:
        """Copies ``array`` to ``offset`` of the held region ``region`` (span checked by the caller)."""
        self._regions[region].memory.write(offset, np.ascontiguousarray(array))

    def check_live(self) -> None:
        """Refuses to go on once any region of the request was unregistered.

        Raises:
            SharedMemoryError: FAILED_PRECONDITION naming the region.
        """
        with self._table._lock:  # noqa: SLF001 - ``unregistered`` is guarded by the table's lock
            gone = [n for n, r in self._regions.items() if r.unregistered]
        if gone:
            raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                         f"region {quote(min(gone))}: unregistered while this request used it; no outputs written")

    def write_output(self, name: str, ref: reward_pb2.SharedMemoryRef, array: np.ndarray, dtype: int) -> reward_pb2.Tensor:
        """Writes output ``name`` into ``ref`` and returns its response tensor
        (the ref with the bytes written, no data).

        Raises:
            SharedMemoryError: INVALID_ARGUMENT when the output is larger than ``ref.byte_size``.
        """
        array = np.ascontiguousarray(array, dtype=tensors.numpy_dtype(dtype))
        if array.nbytes > ref.byte_size:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"output_shared_memory[{quote(name)}].byte_size: {ref.byte_size}, but the output "
                         f"{list(array.shape)} needs {array.nbytes}")
        self._regions[ref.region].memory.write(ref.offset, array)
        written = reward_pb2.SharedMemoryRef(region=ref.region, offset=ref.offset, byte_size=array.nbytes)
        return reward_pb2.Tensor(name=name, dtype=dtype, shape=array.shape, shared_memory=written)
