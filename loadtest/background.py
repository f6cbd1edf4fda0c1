"""A background client that saturates the reward service: an RL trainer
scoring rollouts, in large batches of rendered frames sent as bulk requests.

``workers`` threads each send one ``Evaluate`` of ``batch`` frames at a time
(closed loop: the next as soon as the last is answered), at
``REQUEST_CLASS_BULK``, so the reward service always has a large batch queued or
running while the frame load test measures its critical path.

Two transports (``transport``): ``grpc`` sends the frames' bytes in every
message (9.6 MB for 64 frames); ``shm`` gives each worker a POSIX
shared-memory region (tandem/shared_memory_client.py), writes the frames into
it once, and sends only references, the outputs coming back through the
region too: a trainer on the server's host, off the Python gRPC server's
message path (docs/design.md, "Shared-memory tensors").

    bg = BackgroundLoad(address, cfg=cfg, batch=64, workers=2, transport="shm")
    bg.start(); ...; bg.stop()
    bg.report()  # {"batches", "frames", "refused", "frames_per_s", ...}

:class:`BackgroundProcess` runs it in a child process, as a trainer is: its
own connection (gRPC shares one TCP connection between a process's channels
to the same address, so 9.6 MB batches would hold up a game engine's small
calls behind them on the wire) and its own interpreter lock.

Concurrency: each worker owns its request; the counters are guarded by
``_lock``; ``stop`` sets an event and joins the workers (each ends after its
call in flight, bounded by ``timeout_s``).
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid

import grpc
from tandem.v1 import reward_pb2, reward_pb2_grpc

from tandem import tensors
from tandem.server import channel
from tandem.shared_memory_client import SystemSharedMemoryRegion, required_bytes
from training.frames import render_moves

TRANSPORTS = ("grpc", "shm")  # frames as bytes in each message, or in shared memory

# Rollout positions the trainer scores (any legal Connect Four move strings; the model's cost does not depend on them).
_ROLLOUT_MOVES = ("4", "44", "4453", "445362", "1234567", "44444435", "7654321123", "3344556677")


class BackgroundLoad:
    """Bulk ``Evaluate`` calls of ``batch`` rendered frames, as fast as answered.

    Args:
        address: the reward service, HOST:PORT.
        cfg: tandem config (TLS, token) or None (plaintext).
        model: model name; its first input must take uint8 [N, 224, 224, 3].
        batch: frames per call (at most the model's max_batch_size).
        workers: calls in flight at once.
        timeout_s: gRPC deadline of each call.
        counter: a ``multiprocessing.Value`` that also counts answered calls
            (read from another process), or None.
        transport: ``grpc`` (bytes in the messages) or ``shm`` (a shared-memory
            region per worker, registered at ``start``, unregistered at ``close``).

    Raises:
        ValueError: an unknown transport.
    """

    def __init__(self, address: str, cfg=None, *, model: str = "frame_reward", batch: int = 64,
                 workers: int = 2, timeout_s: float = 30.0, counter=None, transport: str = "grpc"):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        self.model, self.batch, self.workers, self.timeout_s = model, batch, workers, timeout_s
        self.transport = transport
        self._regions: list[SystemSharedMemoryRegion] = []
        self._channel = channel(address, cfg)
        self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)
        moves = [_ROLLOUT_MOVES[i % len(_ROLLOUT_MOVES)] for i in range(batch)]
        self._frames = render_moves(moves)
        self._lock = threading.Lock()
        self._batches = 0  # guarded by _lock: answered calls
        self._refused: dict[str, int] = {}  # guarded by _lock: status code name -> count
        self._counter = counter
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._t0 = self._t1 = 0.0

    def start(self) -> None:
        meta = self._stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=self.model), timeout=10)
        inputs = {meta.inputs[0].name: self._frames}
        if self.transport == "shm":
            requests = self._stage(meta, inputs)
        else:
            requests = [reward_pb2.EvaluateRequest(
                model=self.model, inputs=[tensors.to_proto(n, a) for n, a in inputs.items()],
                request_class=reward_pb2.REQUEST_CLASS_BULK)] * self.workers
        self._stop.clear()
        self._t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._work, args=(request,), name=f"background-{i}", daemon=True)
                         for i, request in enumerate(requests)]
        for t in self._threads:
            t.start()

    def _stage(self, meta: reward_pb2.ModelMetadataResponse, inputs: dict) -> list[reward_pb2.EvaluateRequest]:
        """One region per worker (a region holds one call at a time), the frames
        written into each once; the requests that name them. The regions share
        one client id, so the server's per-client limits see one trainer."""
        size, client_id = required_bytes(meta, inputs), uuid.uuid4().hex
        for _ in range(self.workers):
            self._regions.append(SystemSharedMemoryRegion(self._stub, size, client_id=client_id))
        return [r.stage(self.model, inputs) for r in self._regions]

    def _work(self, request: reward_pb2.EvaluateRequest) -> None:
        while not self._stop.is_set():
            try:
                self._stub.Evaluate(request, timeout=self.timeout_s)
                with self._lock:
                    self._batches += 1
                if self._counter is not None:
                    with self._counter.get_lock():
                        self._counter.value += 1
            except grpc.RpcError as exc:
                with self._lock:
                    name = exc.code().name
                    self._refused[name] = self._refused.get(name, 0) + 1
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self._stop.wait(0.05)  # the server is going away: do not spin

    def stop(self) -> None:
        """Stops sending; waits for the calls in flight (each bounded by ``timeout_s``)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 1.0)
        self._t1 = time.monotonic()

    def close(self) -> None:
        """Unregisters and frees the shared-memory regions (stop first), then closes the channel."""
        for region in self._regions:
            region.close()
        self._regions = []
        self._channel.close()

    def report(self) -> dict:
        """Answered batches and frames, refusals by status code, and frames scored per second."""
        with self._lock:
            batches, refused = self._batches, dict(self._refused)
        return _report(self.batch, self.workers, self.transport, batches, refused,
                       (self._t1 or time.monotonic()) - self._t0)


def _report(batch: int, workers: int, transport: str, batches: int, refused: dict, elapsed: float) -> dict:
    """The report of both classes: answered ``batches`` of ``batch`` frames over ``elapsed`` seconds."""
    return {"batch": batch, "workers": workers, "transport": transport, "batches": batches,
            "frames": batches * batch, "refused": refused, "seconds": round(elapsed, 2),
            "frames_per_s": round(batches * batch / elapsed, 1) if elapsed > 0 else None}


def _child(address, cfg, kwargs, counter, conn) -> None:
    """The child of :class:`BackgroundProcess`: starts the load, reports, runs until told to stop."""
    bg = None
    try:
        bg = BackgroundLoad(address, cfg, counter=counter, **kwargs)
        bg.start()
    except Exception as exc:  # reported to the parent, which raises it
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        if bg is not None:
            bg.close()  # regions registered before the failure
        return
    conn.send({"started": True})
    conn.recv()  # "stop"
    bg.stop()
    conn.send(bg.report())
    bg.close()


class BackgroundProcess:
    """:class:`BackgroundLoad` in a child process (spawned), with the same
    ``start`` / ``stop`` / ``report`` / ``close``; ``report()`` while it runs
    counts the calls answered so far.

    Raises:
        RuntimeError: from ``start``, when the child could not start the load.
    """

    def __init__(self, address: str, cfg=None, **kwargs):
        ctx = mp.get_context("spawn")
        self.batch, self.workers = kwargs.get("batch", 64), kwargs.get("workers", 2)
        self.transport = kwargs.get("transport", "grpc")
        self._counter = ctx.Value("q", 0)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(address, cfg, kwargs, self._counter, child),
                                 name="background-load", daemon=True)
        self._final: dict | None = None
        self._t0 = 0.0

    def start(self) -> None:
        self._proc.start()
        if not self._conn.poll(60):
            raise RuntimeError("background load: the child did not start within 60 s")
        msg = self._conn.recv()
        if "error" in msg:
            raise RuntimeError(f"background load: {msg['error']}")
        self._t0 = time.monotonic()

    def stop(self) -> None:
        if self._proc.is_alive() and self._final is None:
            self._conn.send("stop")
            self._final = self._conn.recv() if self._conn.poll(120) else None

    def close(self) -> None:
        self.stop()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()

    def report(self) -> dict:
        if self._final is not None:
            return self._final
        return _report(self.batch, self.workers, self.transport, self._counter.value, {}, time.monotonic() - self._t0)
