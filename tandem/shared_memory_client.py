"""Shared-memory tensors, the client's side: a region made here, registered
with the reward service once, then ``Evaluate`` calls whose inputs and outputs
live in it instead of in the messages (the server's side, and the rules it
enforces, are in reward_service/shared_memory.py; the design is Triton
Inference Server's shared-memory extension).

    stub = reward_pb2_grpc.RewardServiceStub(tandem.server.channel(address, cfg))
    with SystemSharedMemoryRegion(stub, byte_size=16 << 20) as region:
        outputs, reply = region.evaluate("frame_reward", {"frame": frames})   # frames: uint8 [N, 224, 224, 3]
        outputs["value"]                                                      # float32 [N, 1]

A region holds one request at a time: the inputs one after another, then the
outputs the request asks for, each on a 64-byte boundary
(:func:`required_bytes` says how much that takes). :meth:`~SharedMemoryRegion.stage`
writes the inputs and returns the request, so a caller that sends the same
batch again (a load test) stages it once. ``close`` (or the ``with`` block's
end) unregisters the region and frees its memory; a client that vanishes
without it is cleaned up by the server once the region's lease
(``lease_ttl_ms``, renewed by every use and by :meth:`~SharedMemoryRegion.renew`)
runs out.

:class:`SystemSharedMemoryRegion` is a POSIX shared-memory object (Python's
``multiprocessing.shared_memory``), which the server reads and writes through
its descriptor (it must belong to the user the client runs as);
:class:`CudaSharedMemoryRegion` a CUDA allocation on the server's GPU, exported
by a CUDA IPC handle (needs CuPy and a GPU; its outputs are CuPy arrays).
:class:`SealedMemory` is the leaf channel's host memory (tandem/leaf_channel.py):
a memfd sealed against resizing, passed to the server over the channel's Unix
socket rather than registered over gRPC.
"""
from __future__ import annotations

import abc
import fcntl
import logging
import mmap
import os
import threading
import uuid
from dataclasses import dataclass
from multiprocessing import shared_memory

import grpc
import numpy as np
from tandem.v1 import reward_pb2

from tandem import tensors
from tandem.gpu import cupy_module

log = logging.getLogger(__name__)

ALIGN_BYTES = 64  # every tensor starts on a cache line, so on any dtype's size too


def aligned(offset: int) -> int:
    """``offset`` rounded up to the next multiple of :data:`ALIGN_BYTES`."""
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class _Slot:
    """Where one tensor lies in the region."""

    name: str
    dtype: int  # tandem.v1.DataType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def ref(self, region: str) -> reward_pb2.SharedMemoryRef:
        return reward_pb2.SharedMemoryRef(region=region, offset=self.offset, byte_size=self.nbytes)


def _layout(meta: reward_pb2.ModelMetadataResponse, inputs: dict, output_names=()) -> tuple[list[_Slot], list[_Slot], int]:
    """The inputs' and the requested outputs' slots, and the bytes they take.

    Raises:
        ValueError: an input the model does not take or of another dtype, or
            an output the model lacks or whose row shape is dynamic.
    """
    specs = {s.name: s for s in meta.inputs}
    offset, ins = 0, []
    for name, array in inputs.items():
        spec = specs.get(name)
        if spec is None:
            raise ValueError(f"inputs: model {meta.name!r} has no input {name!r} (inputs: {list(specs)})")
        dtype = tensors.numpy_dtype(spec.dtype)
        if np.dtype(array.dtype) != dtype:
            raise ValueError(f"inputs[{name!r}]: {array.dtype}, but the model takes {dtype}")
        ins.append(_Slot(name, spec.dtype, tuple(array.shape), offset, array.nbytes))
        offset = aligned(offset + array.nbytes)
    rows = len(next(iter(inputs.values())))
    outs = []
    for spec in meta.outputs:
        if output_names and spec.name not in output_names:
            continue
        row = tuple(spec.shape[1:])
        if any(d < 0 for d in row):
            raise ValueError(f"outputs[{spec.name!r}]: dynamic row shape {list(row)}; its size is unknown before the run")
        shape = (rows, *row)
        nbytes = int(np.prod(shape, dtype=np.int64)) * tensors.numpy_dtype(spec.dtype).itemsize
        outs.append(_Slot(spec.name, spec.dtype, shape, offset, nbytes))
        offset = aligned(offset + nbytes)
    unknown = set(output_names) - {s.name for s in outs}
    if unknown:
        raise ValueError(f"output_names: model {meta.name!r} has no output {sorted(unknown)[0]!r}")
    return ins, outs, offset


def required_bytes(meta: reward_pb2.ModelMetadataResponse, inputs: dict, output_names=()) -> int:
    """Bytes a region needs for ``inputs`` (name -> array) and the outputs
    ``output_names`` (empty: all) of the model ``meta`` describes (ModelMetadata).

    Raises:
        ValueError: as :meth:`SharedMemoryRegion.stage`.
    """
    return _layout(meta, inputs, output_names)[2]


class SharedMemoryRegion(abc.ABC):
    """A region registered with the reward service for ``client_id``; the
    subclasses provide its memory. One request at a time (a lock keeps it so).

    Args:
        stub: a ``RewardServiceStub`` (on a channel with the token, where one is set).
        byte_size: the region's size in bytes.
        client_id: the owner the server checks; default a random one. Regions
            of one client share its limits (``reward.shared_memory``).
        name: the region's name on the server (unique there); default random.
        timeout_s: the gRPC deadline of the register, unregister and status calls.
    """

    kind = ""

    def __init__(self, stub, byte_size: int, *, client_id: str | None = None, name: str | None = None,
                 timeout_s: float = 10.0):
        self.stub, self.byte_size, self.timeout_s = stub, byte_size, timeout_s
        self.client_id = client_id or uuid.uuid4().hex
        self.name = name or f"{self.kind}-{uuid.uuid4().hex[:16]}"
        self.lease_ttl_ms = 0.0  # set by the server's answer to the registration
        self._lock = threading.Lock()
        self._metadata: dict[str, reward_pb2.ModelMetadataResponse] = {}
        self._registered = False

    def _register(self, **memory) -> None:
        """Registers the region (``memory``: ``system=`` or ``cuda=``).

        Raises:
            grpc.RpcError: the server refused it (the status names why).
        """
        reply = self.stub.RegisterSharedMemory(reward_pb2.RegisterSharedMemoryRequest(
            client_id=self.client_id, name=self.name, byte_size=self.byte_size, **memory), timeout=self.timeout_s)
        self.lease_ttl_ms = reply.lease_ttl_ms
        self._registered = True

    # -- memory: the subclasses' part ------------------------------------------------

    @abc.abstractmethod
    def _view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
        """An array of ``dtype`` and ``shape`` over the region's bytes from ``offset``."""

    def _write(self, slot: _Slot, array) -> None:
        self._view(slot.offset, tensors.numpy_dtype(slot.dtype), slot.shape)[...] = array

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
        """An array (NumPy; CuPy for a CUDA region) of ``dtype`` and ``shape``
        over the region's bytes from ``offset``: a view, valid until :meth:`close`."""
        return self._view(offset, np.dtype(dtype), shape)

    def write_rows(self, view, rows) -> None:
        """Writes ``rows`` (NumPy, or CuPy for a CUDA region) into the first
        rows of ``view`` (from :meth:`array`), visible to the server once this returns."""
        view[: len(rows)] = rows
        self._flush()

    def _flush(self) -> None:
        """Makes what was written visible to the server before it reads."""

    @abc.abstractmethod
    def _free(self) -> None:
        """Releases this process's memory behind the region (after unregistering)."""

    # -- requests ----------------------------------------------------------------------

    def metadata(self, model: str) -> reward_pb2.ModelMetadataResponse:
        """The model's ModelMetadata, asked once per model."""
        if model not in self._metadata:
            self._metadata[model] = self.stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=model),
                                                            timeout=self.timeout_s)
        return self._metadata[model]

    def stage(self, model: str, inputs: dict, output_names=(),
              request_class: int = reward_pb2.REQUEST_CLASS_BULK) -> reward_pb2.EvaluateRequest:
        """Writes ``inputs`` (name -> NumPy array, or CuPy for a CUDA region;
        the model's dtypes, one batch size) into the region and returns the
        ``EvaluateRequest`` that names them, with room for the outputs
        ``output_names`` (empty: all) after them.

        Raises:
            ValueError: an input or output the model lacks, a wrong dtype, a
                dynamic output row shape, or more bytes than the region holds.
        """
        ins, outs, total = _layout(self.metadata(model), inputs, output_names)
        if total > self.byte_size:
            raise ValueError(f"region {self.name!r}: the request needs {total} bytes, the region holds {self.byte_size}")
        for slot in ins:
            self._write(slot, inputs[slot.name])
        self._flush()
        return reward_pb2.EvaluateRequest(
            model=model, request_class=request_class, output_names=list(output_names), client_id=self.client_id,
            inputs=[reward_pb2.Tensor(name=s.name, dtype=s.dtype, shape=s.shape, shared_memory=s.ref(self.name))
                    for s in ins],
            output_shared_memory={s.name: s.ref(self.name) for s in outs})

    def outputs(self, reply: reward_pb2.EvaluateResponse) -> dict:
        """The reply's outputs by name: views into the region (valid until the
        region is staged again or closed) for those written there, decoded
        bytes for any others."""
        out = {}
        for t in reply.outputs:
            if t.WhichOneof("contents") == "shared_memory":
                out[t.name] = self._view(t.shared_memory.offset, tensors.numpy_dtype(t.dtype), tuple(t.shape))
            else:
                out[t.name] = tensors.from_proto(t)
        return out

    def evaluate(self, model: str, inputs: dict, output_names=(), *,
                 request_class: int = reward_pb2.REQUEST_CLASS_BULK, timeout_s: float = 30.0,
                 copy: bool = True) -> tuple[dict, reward_pb2.EvaluateResponse]:
        """Stages ``inputs``, calls ``Evaluate`` and returns (outputs by name, the reply).

        ``copy``: return copies of the outputs (else views into the region,
        overwritten by the next call on it).

        Raises:
            ValueError: as :meth:`stage`.
            grpc.RpcError: the call failed (the status names why).
        """
        with self._lock:
            request = self.stage(model, inputs, output_names, request_class)
            reply = self.stub.Evaluate(request, timeout=timeout_s)
            out = self.outputs(reply)
            return ({k: v.copy() for k, v in out.items()} if copy else out), reply

    def renew(self) -> float:
        """Renews the region's lease (SharedMemoryStatus, the heartbeat) for a
        client idle longer than ``lease_ttl_ms``; returns the lease left, ms.

        Raises:
            grpc.RpcError: NOT_FOUND once the server has already freed it.
        """
        reply = self.stub.SharedMemoryStatus(reward_pb2.SharedMemoryStatusRequest(
            client_id=self.client_id, name=self.name), timeout=self.timeout_s)
        return reply.regions[0].expires_in_ms

    def close(self, unregister: bool = True) -> None:
        """Unregisters the region and frees its memory. A server that is gone
        or has already freed the region (its lease ran out) is only logged.
        ``unregister=False``: only frees this side (the server unregisters it
        itself, as for a leaf channel's regions when its connection closes)."""
        registered, self._registered = self._registered, False
        if registered and unregister:
            try:
                self.stub.UnregisterSharedMemory(reward_pb2.UnregisterSharedMemoryRequest(
                    client_id=self.client_id, name=self.name), timeout=self.timeout_s)
            except grpc.RpcError as exc:
                log.warning("shared memory: unregistering %r: %s: %s", self.name, exc.code().name, exc.details())
        self._free()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SystemSharedMemoryRegion(SharedMemoryRegion):
    """A POSIX shared-memory object of ``byte_size`` bytes, created, registered
    (and, on ``close``, unregistered and unlinked) here. Outputs are NumPy arrays.

    Raises:
        grpc.RpcError: the server refused the registration (the object is freed).
    """

    kind = "system"

    def __init__(self, stub, byte_size: int, **kwargs):
        super().__init__(stub, byte_size, **kwargs)
        self._shm = shared_memory.SharedMemory(create=True, size=byte_size)
        try:
            self._register(system=reward_pb2.SystemSharedMemory(key=self._shm.name, offset=0))
        except BaseException:
            self._free()
            raise

    def _view(self, offset, dtype, shape):
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return np.frombuffer(self._shm.buf[offset : offset + nbytes], dtype).reshape(shape)

    def _free(self) -> None:
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.unlink()
            shm.close()  # BufferError while views from outputs(copy=False) are still held


class CudaSharedMemoryRegion(SharedMemoryRegion):
    """A CUDA allocation of ``byte_size`` bytes on ``device_id`` (the server's
    device), exported to the server by its IPC handle. Inputs may be NumPy or
    CuPy arrays; outputs are CuPy arrays.

    Raises:
        RuntimeError: CuPy or a GPU is missing.
        grpc.RpcError: the server refused the registration (the memory is freed).
    """

    kind = "cuda"

    def __init__(self, stub, byte_size: int, *, device_id: int = 0, **kwargs):
        cupy = cupy_module()
        if cupy is None:
            raise RuntimeError("CUDA shared memory needs CuPy and a GPU; use SystemSharedMemoryRegion")
        super().__init__(stub, byte_size, **kwargs)
        self._cp, self.device_id = cupy, device_id
        with cupy.cuda.Device(device_id):
            # An allocation of its own, not the memory pool's: an IPC handle opens
            # a whole cudaMalloc allocation at its base, not a piece of a pooled one.
            self._memory = cupy.cuda.Memory(byte_size)
            handle = cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr)
        try:
            self._register(cuda=reward_pb2.CudaSharedMemory(raw_handle=handle, device_id=device_id))
        except BaseException:
            self._free()
            raise

    def _view(self, offset, dtype, shape):
        return self._cp.ndarray(shape, dtype, self._cp.cuda.MemoryPointer(self._memory, offset))

    def _write(self, slot: _Slot, array) -> None:
        if isinstance(array, np.ndarray):  # host to device; CuPy arrays are copied on the device
            self._view(slot.offset, tensors.numpy_dtype(slot.dtype), slot.shape).set(np.ascontiguousarray(array))
        else:
            super()._write(slot, array)

    def _flush(self) -> None:
        with self._cp.cuda.Device(self.device_id):
            self._cp.cuda.runtime.deviceSynchronize()  # the server reads from another process and stream

    def write_rows(self, view, rows) -> None:
        with self._cp.cuda.Device(self.device_id):
            stream = self._cp.cuda.get_current_stream()
            if isinstance(rows, np.ndarray):
                view[: len(rows)].set(np.ascontiguousarray(rows), stream=stream)
            else:
                view[: len(rows)] = rows
            stream.synchronize()  # this stream's copy only: other threads' kernels need not finish

    def _free(self) -> None:
        self._memory = None  # cudaFree once no view holds it


class SealedMemory:
    """``byte_size`` bytes of host memory for a leaf channel: a memfd
    (``memfd_create`` with MFD_ALLOW_SEALING) sealed against shrinking, growing
    and further sealing, then mapped here. Its descriptor (:attr:`fd`) goes to
    the server with the channel's attach (SCM_RIGHTS), which maps it too:
    sealed, it can never shrink under either mapping (an ``ftruncate`` fails
    with EPERM), and it has no name another process could open.

    Args:
        byte_size: the memory's size, > 0.
        client_id: the owner the server registers it for; default a random one.
        name: its region's name on the server (unique there); default random.

    Raises:
        OSError: the memfd cannot be made (no memfd_create or sealing, out of memory).
    """

    kind = "memfd"
    SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

    def __init__(self, byte_size: int, *, client_id: str | None = None, name: str | None = None):
        self.byte_size = byte_size
        self.client_id = client_id or uuid.uuid4().hex
        self.name = name or f"{self.kind}-{uuid.uuid4().hex[:16]}"
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, byte_size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, self.SEALS)
            self._mmap = mmap.mmap(self.fd, byte_size)
        except BaseException:
            os.close(self.fd)
            raise

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A NumPy array of ``dtype`` and ``shape`` over the memory from ``offset``:
        a view, valid until :meth:`close`."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return np.frombuffer(self._mmap, dtype, nbytes // dtype.itemsize, offset).reshape(shape)

    @staticmethod
    def write_rows(view, rows) -> None:
        """Writes ``rows`` into the first rows of ``view`` (from :meth:`array`);
        the server's mapping sees them at once."""
        view[: len(rows)] = rows

    def close(self, unregister: bool = False) -> None:
        """Frees this side's mapping and descriptor (the server's copy of the
        memory goes when it unregisters the region: with the channel's
        connection). ``unregister`` is accepted for the regions' common
        interface; there is nothing to unregister over gRPC. Idempotent;
        raises BufferError while views from :meth:`array` live."""
        if self.fd >= 0:
            self._mmap.close()
            os.close(self.fd)
            self.fd = -1
