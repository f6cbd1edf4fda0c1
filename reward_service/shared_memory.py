"""Shared-memory tensors: regions a client registers once, which ``Evaluate``'s
inputs and outputs then name (region, offset, byte size) instead of carrying
their bytes through gRPC.

The design is Triton Inference Server's shared-memory extension (system and
CUDA shared memory: register, unregister and status calls, then inputs and
outputs that point into a registered region), with what Triton leaves to the
deployment added here: regions belong to a user and a client, are limited per
client and per user, and are leased, so a client that goes away without
unregistering does not leave them held for ever. Why at all: under a
trainer's bulk load the cost of a 9.6 MB batch is the Python gRPC server
taking the message in, not the model (docs/design.md, "Measured physics",
consequence 6).

Three kinds of region:

* **system**: a POSIX shared-memory object on this host (``shm_open``, as
  Python's ``multiprocessing.shared_memory`` makes them), registered by its
  key over gRPC. It is never mapped: inputs are read with ``preadv`` from the
  object's descriptor into arrays the server owns (one copy of the input
  bytes per request), outputs written with ``pwrite`` after an ``fstat`` size
  check. A client that shrinks its object (``ftruncate``) makes its own
  requests fail FAILED_PRECONDITION (a short read names the region and the
  object's size); nothing it does to the object can raise a signal (SIGBUS)
  in the server. The object must belong to the caller: at registration its
  owner (``fstat().st_uid``) must be the peer's uid (tandem/peer.py), so the
  server never reads or writes memory on behalf of a user who could not open
  it (the confused deputy).
* **memfd**: a sealed memfd a leaf-channel client passed over its Unix
  socket (reward_service/leaf_channel.py, :meth:`RegionTable.register_fd`),
  mapped: the leaf channel's waves read it and its ready word is polled in
  place (no copy). It is sealed against shrinking (``F_SEAL_SHRINK``, checked
  here), so its pages stay backed while mapped; it has no name anywhere
  (nothing in /dev/shm for another client to register).
* **cuda**: a CUDA allocation of another process on this server's device,
  opened from its IPC handle with CuPy (``cudaIpcOpenMemHandle``). Inputs are
  copied device to host, because the batcher and the sessions take NumPy
  arrays; outputs host to device.

The region table's invariants:

* ``RegionTable._lock`` guards ``_regions`` (name -> :class:`Region`) and
  every Region's ``client_id``, ``uses``, ``unregistered`` and ``expires``. It is never held
  while memory is opened or closed, nor while bytes are read or written, so
  one slow client cannot stall the others' calls.
* A region belongs to its owner, the pair (``uid``, ``client_id``): the
  user the server found behind the registering call (its peer's uid; the
  leaf channel's socket peer's) and the id the client chose. Only that owner
  may name it in ``Evaluate``, renew it or unregister it; the same
  ``client_id`` from another uid is another client. Names are unique on the
  server.
* A client id ``open-inference-protocol@<peer>`` (:func:`connection_client`)
  is one connection's: only a call on that connection may name it
  (:func:`check_client`), so the Open Inference Protocol's regions belong to
  the connection that registered them. Once that connection is closed, the
  next connection of the same user that names them (or lists or unregisters
  all of its regions) adopts them (:meth:`RegionTable.adopt`): a client that
  reconnects keeps its regions, as Triton's clients expect.
* ``uses`` counts the requests holding the region (a :class:`Lease`). A region
  leaves the table when it is unregistered: by its client, by the reaper once
  its lease expired unused, or at shutdown. Its memory is closed by whoever
  drops the last of the two holds, the table entry and the uses: the
  unregistering call when no request uses it, otherwise the last lease
  released. Memory is therefore never closed under a request reading or
  writing it; such a request fails with FAILED_PRECONDITION instead of
  writing outputs into memory its client has given up.
* A NumPy array over a memfd mapping may outlive its request (the batcher's
  worker keeps its last batch until the next one). Closing a memfd region
  drops the table's reference to its mapping, which is unmapped when the
  last array over it goes: no array ever points into unmapped memory.
* The lease: every use of a region (acquire and release) and every status
  call of its client renews it to ``lease_ttl_ms`` from now; the reaper thread
  unregisters a region whose lease ran out while no request used it.

Errors are :class:`SharedMemoryError` with the gRPC status the servicer
answers: NOT_FOUND (no region or object of that name), INVALID_ARGUMENT
(bounds, sizes, alignment, malformed or unopenable handles, a descriptor that
is not a memfd sealed against shrinking), ALREADY_EXISTS, PERMISSION_DENIED
(an object not the caller's, or a caller whose uid cannot be told),
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
import fcntl
import logging
import math
import mmap
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable, Collection, Iterable

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


#: Client ids of this form name one connection's regions (the Open Inference
#: Protocol's, which carries no client id): ``connection_client(peer)``.
CONNECTION_CLIENT_PREFIX = "open-inference-protocol@"


def connection_client(peer: str) -> str:
    """The client id of the regions of the connection ``peer`` (``context.peer()``)."""
    return CONNECTION_CLIENT_PREFIX + peer


def check_client(client_id: str, peer: str) -> None:
    """Refuses a client id that names another connection's regions: a caller
    may name :func:`connection_client` of its own connection only.

    Raises:
        SharedMemoryError: PERMISSION_DENIED naming the client id.
    """
    if client_id.startswith(CONNECTION_CLIENT_PREFIX) and client_id != connection_client(peer):
        raise _error(grpc.StatusCode.PERMISSION_DENIED,
                     f"client_id: {quote(client_id)} names the regions of another connection (ids starting "
                     f"{CONNECTION_CLIENT_PREFIX!r} belong to one connection each; this call's is "
                     f"{quote(connection_client(peer))})")


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


def _check_owner(key: str, st: os.stat_result, uid: int) -> None:
    """Refuses an object that is not the caller's: the server opens what its
    own user may, and must not read or write it for a user who could not.

    Raises:
        SharedMemoryError: PERMISSION_DENIED naming both uids; INVALID_ARGUMENT
            for something other than a regular file.
    """
    if st.st_uid != uid:
        raise _error(grpc.StatusCode.PERMISSION_DENIED,
                     f"system.key: the object {quote(key)} belongs to uid {st.st_uid}, not to the caller's uid {uid}; "
                     "the server opens only the caller's own objects")
    if not stat.S_ISREG(st.st_mode):
        raise _error(grpc.StatusCode.INVALID_ARGUMENT, f"system.key: {quote(key)} is not a shared-memory object")


class _SystemMemory:
    """A window [offset, offset + byte_size) of a client's POSIX shared-memory
    object, never mapped: read with ``preadv`` and written with ``pwrite``
    through its descriptor, so the object shrinking is a failed request, never
    a signal (see the module docstring).

    ``multiprocessing.shared_memory.SharedMemory`` would open it too, but
    before Python 3.13 (no ``track=False``) attaching registers the object
    with this process's resource tracker, which unlinks it when the server
    exits: the client's object, not the server's to remove. So it is opened
    here, through the module SharedMemory itself uses, and never unlinked.

    Raises:
        SharedMemoryError: as :func:`_open_object` and :func:`_check_owner`;
            INVALID_ARGUMENT for a window past the object's end.
    """

    kind = "system"

    def __init__(self, region: str, key: str, offset: int, byte_size: int, uid: int):
        self.region, self.key, self.offset, self.byte_size = region, key, offset, byte_size
        self._fd = _open_object(key)  # kept open: every read, write and size check goes through it
        try:
            st = os.fstat(self._fd)
            _check_owner(key, st, uid)
            if offset + byte_size > st.st_size:
                raise _error(grpc.StatusCode.INVALID_ARGUMENT, f"system: offset {offset} + byte_size {byte_size} "
                             f"exceeds the object {quote(key)} ({st.st_size} bytes)")
        except BaseException:
            os.close(self._fd)
            raise

    def _shrunk(self, size: int) -> SharedMemoryError:
        return _error(grpc.StatusCode.FAILED_PRECONDITION,
                      f"region {quote(self.region)}: its object {quote(self.key)} shrank to {size} bytes, below the "
                      f"registered offset {self.offset} + byte_size {self.byte_size}; register it again")

    def check(self, region: str) -> None:
        """Refuses a region whose object its owner shrank below the window (early:
        a read or write would find it out too, as a short read or at its own check)."""
        size = os.fstat(self._fd).st_size
        if size < self.offset + self.byte_size:
            raise self._shrunk(size)

    def _pread(self, out: np.ndarray, offset: int) -> np.ndarray:
        """Fills ``out`` (C-contiguous, server-owned) from ``offset`` of the window.

        Raises:
            SharedMemoryError: FAILED_PRECONDITION: the object ends first (a short read).
        """
        view = memoryview(out).cast("B")
        start, done = self.offset + offset, 0
        while done < len(view):
            try:
                got = os.preadv(self._fd, [view[done:]], start + done)
            except OSError as exc:
                raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"region {quote(self.region)}: reading its object {quote(self.key)}: {exc.strerror}") from None
            if got == 0:  # the object ends before the span: shrunk since the acquire
                raise self._shrunk(os.fstat(self._fd).st_size)
            done += got
        return out

    def read(self, offset: int, nbytes: int) -> memoryview:
        """A copy of ``nbytes`` bytes at ``offset`` of the region, in memory the server owns."""
        return self._pread(np.empty(nbytes, np.uint8), offset).data

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A copy of ``shape`` of ``dtype`` at ``offset`` of the region (a NumPy array the server owns)."""
        return self._pread(np.empty(shape, dtype), offset)

    def write(self, offset: int, array: np.ndarray) -> None:
        """Writes ``array``'s bytes at ``offset`` of the region, once ``fstat`` says
        the object still covers the window (a write past the end would only
        grow the client's object: no signal either way).

        Raises:
            SharedMemoryError: FAILED_PRECONDITION: the object shrank, or the write failed.
        """
        self.check(self.region)
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        start, done = self.offset + offset, 0
        while done < len(data):
            try:
                done += os.pwrite(self._fd, data[done:], start + done)
            except OSError as exc:
                raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"region {quote(self.region)}: writing its object {quote(self.key)}: {exc.strerror}") from None

    def close(self) -> None:
        """Closes the descriptor. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def describe(self) -> dict:
        return {"key": self.key, "offset": self.offset}


_memfd_device: int | None = None  # st_dev of this kernel's memfds (its internal shmem mount)


def _shmem_device() -> int:
    """The device number every ordinary memfd of this kernel has (asked once, of one made here)."""
    global _memfd_device
    if _memfd_device is None:
        fd = os.memfd_create("tandem-probe", os.MFD_CLOEXEC)
        try:
            _memfd_device = os.fstat(fd).st_dev
        finally:
            os.close(fd)
    return _memfd_device


def _memfd_size(fd: int) -> int:
    """The size of the memfd ``fd`` once it is checked to be one the server may
    map: ordinary shmem memory (not hugetlbfs, whose faults may fail) sealed
    against shrinking, so no page of a mapping of it can lose its backing.

    Raises:
        SharedMemoryError: INVALID_ARGUMENT naming what is missing.
    """
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: a file that cannot carry seals
        raise _error(grpc.StatusCode.INVALID_ARGUMENT, "memfd: the descriptor is not a memfd (it has no seals)") from None
    if not stat.S_ISREG(st.st_mode) or st.st_dev != _shmem_device():
        raise _error(grpc.StatusCode.INVALID_ARGUMENT, "memfd: the descriptor is not an ordinary memfd (memfd_create "
                     "without MFD_HUGETLB)")
    if not seals & fcntl.F_SEAL_SHRINK:
        raise _error(grpc.StatusCode.INVALID_ARGUMENT, "memfd: not sealed against shrinking: create it with "
                     "MFD_ALLOW_SEALING and add F_SEAL_SHRINK (fcntl F_ADD_SEALS) before passing it")
    if st.st_size <= 0:
        raise _error(grpc.StatusCode.INVALID_ARGUMENT, "memfd: 0 bytes")
    return st.st_size


class _MemfdMemory:
    """A sealed memfd (checked by :func:`_memfd_size`), mapped read-write: the
    leaf channel's zero-copy memory. The descriptor is the caller's; the
    mapping keeps the memory.

    Raises:
        SharedMemoryError: INVALID_ARGUMENT: it cannot be mapped read-write
            (sealed against writes, or a read-only descriptor).
    """

    kind = "memfd"

    def __init__(self, fd: int, byte_size: int):
        self.byte_size = byte_size
        try:
            self._mmap = mmap.mmap(fd, byte_size)
        except OSError as exc:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"memfd: cannot be mapped read-write ({exc.strerror}): sealed against writes, or a "
                         "read-only descriptor") from None

    def check(self, region: str) -> None:
        pass  # sealed against shrinking: its size is fixed for good

    def _window(self, offset: int, nbytes: int) -> memoryview:
        # Arrays over this view hold the mapping: it is unmapped only once the last of them is gone.
        return memoryview(self._mmap)[offset : offset + nbytes]

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
        """Drops the table's reference to the mapping; it is unmapped with the
        last array over it (never under one). Idempotent."""
        self._mmap = None

    def describe(self) -> dict:
        return {"key": "", "offset": 0}  # no name anywhere: reported as a system region without a key


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
    """A registered region: ``byte_size`` bytes of ``memory``, owned by the
    pair (``uid``, ``client_id``); ``uid`` None: a CUDA region of a caller whose
    uid could not be told. ``client_id`` (changed by :meth:`RegionTable.adopt`),
    ``uses``, ``unregistered`` and ``expires`` (time.monotonic s) are guarded
    by the table's lock."""

    name: str
    client_id: str
    uid: int | None
    byte_size: int
    memory: _SystemMemory | _MemfdMemory | _CudaMemory
    expires: float
    uses: int = 0
    unregistered: bool = False


@dataclass(frozen=True)
class RegionStatus:
    """What SharedMemoryStatus reports of one region (expires_in_ms: lease left, ms)."""

    name: str
    kind: str  # "system" | "memfd" | "cuda"
    byte_size: int
    memory: dict  # system and memfd: key ("" for a memfd), offset; cuda: device_id
    in_flight: int
    expires_in_ms: float


@dataclass(frozen=True)
class TensorView:
    """A request's input tensor with its bytes in a region: the fields of
    ``reward_pb2.Tensor`` that ``ModelSession.decode`` reads, ``data`` a
    bytes-like view: a copy the server owns for system and CUDA regions, over
    the mapping itself for memfd ones."""

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
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # -- registration ------------------------------------------------------------

    def register_system(self, client_id: str, name: str, byte_size: int, key: str, offset: int,
                        uid: int | None) -> None:
        """Registers ``byte_size`` bytes at ``offset`` of the POSIX shared-memory
        object ``key`` as region ``name`` of (``uid``, ``client_id``); the object
        is kept open, never mapped.

        ``uid``: the caller's (the gRPC peer's, tandem/peer.py); the object must be its own.

        Raises:
            SharedMemoryError: PERMISSION_DENIED (``uid`` None, or an object of
                another user); see the module docstring for the rest.
        """
        if uid is None:
            raise _error(grpc.StatusCode.PERMISSION_DENIED,
                         "system: the server cannot tell which user the caller is (it looks the uid of a loopback TCP "
                         "peer up in /proc/net/tcp; a Unix-socket or remote peer has none), and it opens a "
                         "shared-memory object only for its owner")
        self._register(client_id, name, byte_size, uid, lambda: _SystemMemory(name, key, offset, byte_size, uid))

    def register_fd(self, client_id: str, name: str, fd: int, uid: int) -> int:
        """Maps the memfd ``fd`` (its whole size) as region ``name`` of (``uid``,
        ``client_id``) and returns its size in bytes. The descriptor, passed by
        its owner (SCM_RIGHTS: the caller's authority), is closed here whatever
        happens; the mapping keeps the memory.

        Raises:
            SharedMemoryError: INVALID_ARGUMENT (not a memfd, not sealed against
                shrinking, empty, or not mappable read-write); as :meth:`register_system` otherwise.
        """
        try:
            size = _memfd_size(fd)
            self._register(client_id, name, size, uid, lambda: _MemfdMemory(fd, size))
            return size
        finally:
            os.close(fd)

    def register_cuda(self, client_id: str, name: str, byte_size: int, raw_handle: bytes, device_id: int,
                      uid: int | None = None) -> None:
        """Opens the CUDA IPC handle ``raw_handle`` (an allocation of at least
        ``byte_size`` bytes on ``device_id``) as region ``name`` of (``uid``, ``client_id``).

        Raises:
            SharedMemoryError: FAILED_PRECONDITION without a usable GPU or on
                another device; INVALID_ARGUMENT for a malformed, stale or
                foreign handle or a byte_size beyond the allocation; as
                :meth:`register_system` otherwise.
        """
        self._register(client_id, name, byte_size, uid, lambda: _CudaMemory(raw_handle, device_id, byte_size))

    def _register(self, client_id: str, name: str, byte_size: int, uid: int | None, open_memory: Callable) -> None:
        _check_name("client_id", client_id)
        _check_name("name", name)
        if byte_size <= 0:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT, "byte_size: must be > 0")
        with self._lock:
            self._admit_locked(uid, client_id, name, byte_size)  # refuse early, before opening anything
        memory = open_memory()  # outside the lock: system calls, maybe the CUDA driver
        try:
            with self._lock:  # again: another call may have taken the name or the room meanwhile
                self._admit_locked(uid, client_id, name, byte_size)
                self._regions[name] = Region(name, client_id, uid, byte_size, memory, self._clock() + self._ttl_s)
        except SharedMemoryError:
            self._close(memory)
            raise

    def _admit_locked(self, uid: int | None, client_id: str, name: str, byte_size: int) -> None:
        if name in self._regions:
            raise _error(grpc.StatusCode.ALREADY_EXISTS, f"name: a region {quote(name)} is already registered")
        cfg = self.cfg
        mine = [r for r in self._regions.values() if r.uid == uid and r.client_id == client_id]
        if len(mine) >= cfg.max_regions_per_client:
            raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"client {quote(client_id)} holds {len(mine)} regions, the most "
                         f"reward.shared_memory.max_regions_per_client allows")
        held = sum(r.byte_size for r in mine)
        if held + byte_size > cfg.max_bytes_per_client:
            raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"byte_size: client {quote(client_id)} holds {held} bytes; {byte_size} more passes "
                         f"reward.shared_memory.max_bytes_per_client ({cfg.max_bytes_per_client})")
        # Counted per user too: client ids are free to choose, so one user rotating them
        # would otherwise fill the server's table and lock every other user out.
        users = sum(1 for r in self._regions.values() if r.uid == uid)
        if users >= cfg.max_regions_per_user:
            raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"uid {uid} holds {users} regions (all its client ids together), the most "
                         f"reward.shared_memory.max_regions_per_user allows")
        if len(self._regions) >= cfg.max_regions:
            raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the server holds {len(self._regions)} regions, reward.shared_memory.max_regions")

    def _owned_locked(self, uid: int | None, client_id: str, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise _error(grpc.StatusCode.NOT_FOUND, f"region {quote(name)}: not registered")
        if region.client_id != client_id or region.uid != uid:
            raise _error(grpc.StatusCode.FAILED_PRECONDITION, f"region {quote(name)}: registered by another client, "
                         f"not by client_id {quote(client_id)} of uid {uid}")
        return region

    def _mine_locked(self, uid: int | None, client_id: str) -> list[Region]:
        return [r for r in self._regions.values() if r.client_id == client_id and r.uid == uid]

    def unregister(self, client_id: str, name: str = "", *, uid: int | None) -> list[str]:
        """Unregisters region ``name`` of (``uid``, ``client_id``) (empty: all of
        its regions) and returns the names. A region a request is using is
        closed when that request releases it.

        Raises:
            SharedMemoryError: INVALID_ARGUMENT (empty client_id), NOT_FOUND,
                FAILED_PRECONDITION (another client's region).
        """
        _check_name("client_id", client_id)
        with self._lock:
            regions = [self._owned_locked(uid, client_id, name)] if name else self._mine_locked(uid, client_id)
            idle = [self._drop_locked(r) for r in regions]
        for region, close_now in zip(regions, idle):
            if close_now:
                self._close(region.memory)
        return [r.name for r in regions]

    def adopt(self, client_id: str, names: Collection[str] | None, uid: Callable[[], int | None],
              gone: Callable[[str], bool]) -> list[str]:
        """Gives ``client_id`` the regions of the caller's user (``uid()``,
        asked only where another client holds one) held by clients that
        ``gone(other_client_id)`` says have ended (a connection's client whose
        connection is closed), and returns their names: the regions ``names``
        (None: every region). ``gone`` is called outside the lock, once per
        client. Adopted regions count for ``client_id`` from now on; none is
        refused for its limits.
        """
        with self._lock:
            others = {(r.client_id, r.uid) for r in self._regions.values()
                      if r.client_id != client_id and r.uid is not None and (names is None or r.name in names)}
        if not others:
            return []
        caller = uid()
        ended = {c for c, u in others if u == caller and caller is not None and gone(c)}
        if not ended:
            return []
        with self._lock:
            moved = [r for r in self._regions.values() if r.uid == caller and r.client_id in ended
                     and (names is None or r.name in names)]
            for r in moved:
                log.info("shared memory: region %r of ended client %r (uid %s) adopted by %r",
                         r.name, r.client_id, r.uid, client_id)
                r.client_id = client_id
        return [r.name for r in moved]

    def _drop_locked(self, region: Region) -> bool:
        """Takes ``region`` out of the table; True when no request holds it
        (the caller closes it), else the last lease released will."""
        del self._regions[region.name]
        region.unregistered = True
        return region.uses == 0

    def status(self, client_id: str, name: str = "", *, uid: int | None) -> list[RegionStatus]:
        """The regions of (``uid``, ``client_id``) (or region ``name``), each
        lease renewed first: a status call is the client's heartbeat.

        Raises:
            SharedMemoryError: as :meth:`unregister`.
        """
        _check_name("client_id", client_id)
        with self._lock:
            now = self._clock()
            regions = ([self._owned_locked(uid, client_id, name)] if name
                       else sorted(self._mine_locked(uid, client_id), key=lambda r: r.name))
            for r in regions:
                r.expires = now + self._ttl_s
            return [RegionStatus(r.name, r.memory.kind, r.byte_size, r.memory.describe(), r.uses,
                                 min((r.expires - now) * 1e3, self.cfg.lease_ttl_ms)) for r in regions]  # no float overshoot

    # -- use -----------------------------------------------------------------------

    def acquire(self, client_id: str, names: Iterable[str], *, uid: int | None) -> Lease:
        """Holds the regions ``names`` of (``uid``, ``client_id``) for one
        request until the returned lease is closed (none is closed until then).

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
            regions = {n: self._owned_locked(uid, client_id, n) for n in names}
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

    @staticmethod
    def _close(memory) -> None:
        try:
            memory.close()
        except Exception as exc:  # a CUDA error on close must not fail the call that freed the region
            log.warning("shared memory: closing a %s region failed: %s", memory.kind, exc)

    # -- the lease's end ----------------------------------------------------------

    def reap(self) -> list[str]:
        """Unregisters and closes every region whose lease expired while no
        request used it, and returns the names reaped."""
        with self._lock:
            now = self._clock()
            expired = [r for r in self._regions.values() if r.uses == 0 and r.expires <= now]
            for r in expired:
                self._drop_locked(r)
        for r in expired:
            log.info("shared memory: region %r of client %r (uid %s) expired unused; closed", r.name, r.client_id, r.uid)
            self._close(r.memory)
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
        for r in regions:
            if r.uses == 0:
                self._close(r.memory)

    def stats(self) -> dict:
        """{"regions": registered, "bytes": their byte_size summed}."""
        with self._lock:
            return {"regions": len(self._regions), "bytes": sum(r.byte_size for r in self._regions.values())}


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
        """The input ``tensor`` (its ``shared_memory`` set) with its region's
        bytes, for ``ModelSession.decode``: a copy read from a system region
        (``byte_size`` bytes), a host copy of a CUDA one, a view over a memfd
        mapping (no copy). A tensor whose dtype or shape is itself wrong gets
        empty data, which ``decode`` then refuses naming that field.

        Raises:
            SharedMemoryError: INVALID_ARGUMENT: the span leaves the region, is
                misaligned, or byte_size is not prod(shape) * itemsize;
                FAILED_PRECONDITION: a system region's object shrank (a short read).
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

    def array(self, region: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
        """``shape`` of ``dtype`` at ``offset`` of the held region ``region``: a
        read-only NumPy array over a memfd mapping or a CuPy array over a CUDA
        allocation (neither copied), a NumPy copy read from a system region.
        The caller has checked the span against the region's size.

        Raises:
            SharedMemoryError: FAILED_PRECONDITION: a system region's object shrank.
        """
        return self._regions[region].memory.array(offset, np.dtype(dtype), shape)

    def write(self, region: str, offset: int, array: np.ndarray) -> None:
        """Copies ``array`` to ``offset`` of the held region ``region`` (span checked by the caller).

        Raises:
            SharedMemoryError: FAILED_PRECONDITION: a system region's object shrank.
        """
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
            SharedMemoryError: INVALID_ARGUMENT when the output is larger than
                ``ref.byte_size``; FAILED_PRECONDITION: a system region's object shrank.
        """
        array = np.ascontiguousarray(array, dtype=tensors.numpy_dtype(dtype))
        if array.nbytes > ref.byte_size:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"output_shared_memory[{quote(name)}].byte_size: {ref.byte_size}, but the output "
                         f"{list(array.shape)} needs {array.nbytes}")
        self._regions[ref.region].memory.write(ref.offset, array)
        written = reward_pb2.SharedMemoryRef(region=ref.region, offset=ref.offset, byte_size=array.nbytes)
        return reward_pb2.Tensor(name=name, dtype=dtype, shape=array.shape, shared_memory=written)
