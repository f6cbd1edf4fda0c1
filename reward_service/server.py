"""RewardService: serves the configured ONNX models over gRPC."""
from __future__ import annotations

import logging
import threading
import time
import traceback
from contextlib import contextmanager

import grpc
import numpy as np
import onnxruntime as ort
from prometheus_client import Gauge
from tandem.v1 import reward_pb2, reward_pb2_grpc, scheduler_pb2

from reward_service import leaf_channel, oip, refusal
from reward_service.admission import INPUT_COPIES, OUTPUT_COPIES, ByteBudget, Held, OverBudget
from reward_service.batcher import LANES, Batcher
from reward_service.in_process import InProcessServer
from reward_service.model_metrics import ModelMetrics
from reward_service.refusal import Refusal
from reward_service.session import InputError, ModelSession, runners_per_model
from reward_service.shared_memory import Lease, RegionStatus, RegionTable, SharedMemoryError, check_client
from tandem import in_process as tandem_in_process
from tandem import gpu, multiprocess_metrics, peer, tensors, workers
from tandem.failover import STANDBY_KEY
from tandem.startup import Phases
from tandem.workers import WorkerPlace
from tandem.config import SharedMemoryConfig, TandemConfig
from tandem.deadline import Deadline
from tandem.errors import quote
from tandem.gpu import cuda_device_count, host_fact
from tandem.leaf_channel import RUNTIME_KEY as LEAF_CHANNEL_KEY
from tandem.server import catch_stop_signals
from tandem.service import Service, start_service

log = logging.getLogger(__name__)

BULK_SERVER_KEY = "bulk_server"  # ModelMetadata.runtime key: the bulk server's address, for bulk clients
# Under workers (tandem/workers.py) a gauge merges as its multiprocess_mode says: livesum for what the workers
# hold between them, liveall (a series a worker, label pid) for what the scheduler assigns each.
IN_FLIGHT = Gauge("tandem_reward_requests_in_flight", "Evaluate calls being served.", multiprocess_mode="livesum")
BYTES_IN_FLIGHT = Gauge("tandem_reward_bytes_in_flight", "Bytes of the Evaluate calls being served (serialized).",
                        multiprocess_mode="livesum")
STREAM_PRIORITY = Gauge("tandem_reward_stream_priority", "CUDA stream priority assigned by the scheduler.",
                        multiprocess_mode="liveall")
BULK_SHARE = Gauge("tandem_reward_bulk_share_ratio",
                   "Share of wall time (0-1) each model's bulk lane may run batches (the scheduler's lever).",
                   multiprocess_mode="liveall")
QUEUE_DEPTH = Gauge("tandem_reward_queue_depth", "Requests waiting in the models' batchers.",
                    multiprocess_mode="livesum")
LANE_QUEUE_DEPTH = Gauge("tandem_reward_lane_queue_depth", "Requests waiting in the models' batchers, per lane.",
                         ["lane"], multiprocess_mode="livesum")
POOL_LIMIT = Gauge("tandem_reward_pool_limit_bytes", "ONNX Runtime arena limit over all sessions (0 = none).",
                   multiprocess_mode="livesum")
SHM_REGIONS = Gauge("tandem_reward_shared_memory_regions", "Shared-memory regions registered.",
                    multiprocess_mode="livesum")
SHM_BYTES = Gauge("tandem_reward_shared_memory_bytes", "Bytes of the shared-memory regions registered.",
                  multiprocess_mode="livesum")


def clear_chain(exc: BaseException) -> None:
    """Clears the finished frames of ``exc``'s traceback and of the errors it
    was raised from or during (``__cause__``, ``__context__``): their locals go
    at once, not at a garbage collection (a frame still running is kept)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Evaluate / ModelMetadata / ListModels over a dict of ModelSessions, each
    behind its own dynamic batcher (reward_service/batcher.py: a critical and a
    bulk lane, each with its own worker thread and runners), and the
    shared-memory calls (Register / Unregister / SharedMemoryStatus) over a
    region table (reward_service/shared_memory.py), whose regions Evaluate's
    tensors may name instead of carrying bytes.

    Evaluate validates a request completely (model, tensors, output names,
    deadline) on the gRPC thread before it is queued, so a bad request is
    answered alone and never fails the requests it would have been merged
    with. Status codes: NOT_FOUND (unknown model), INVALID_ARGUMENT (bad
    tensors or output names), DEADLINE_EXCEEDED (the gRPC deadline passed
    before the request ran: it is not run), RESOURCE_EXHAUSTED (the model's
    queue is full, a critical request displaced this bulk one, the requests
    in flight hold ``reward.max_bytes_in_flight`` bytes (reward_service/admission.py),
    or the run needed more than the fixed memory pool),
    UNAVAILABLE (stopping), INTERNAL (the model run failed); with shared
    memory also FAILED_PRECONDITION (another client's region, or one
    unregistered while the request used it).

    As the bulk server (``critical_address`` set: reward.bulk_server, a
    process of its own that serves bulk clients) a critical Evaluate is
    FAILED_PRECONDITION, naming the reward service that serves it, unless
    the bulk server is the reward service's ``standby`` (it then has a
    critical lane per model, for clients whose reward service is down).

    Thread safety: the batchers and the region table are thread-safe; the only
    other shared mutable state is the load counters, guarded by ``_lock``.
    """

    def __init__(self, sessions: dict[str, ModelSession], batchers: dict[str, Batcher],
                 shared_memory: SharedMemoryConfig | None = None, metrics: ModelMetrics | None = None,
                 max_bytes_in_flight: int = 0, critical_address: str = "", bulk_address: str = "",
                 standby: bool = False):
        self.sessions = sessions
        # The bulk server: where critical requests go instead ("" on the reward service itself).
        self.critical_address = critical_address
        self.bulk_address = bulk_address  # the reward service: its bulk server's address, if one runs
        self.standby = standby  # the reward service: its bulk server is its standby; the bulk server: it is one
        self.metrics = metrics or ModelMetrics(list(sessions))  # per-model figures (reward_service/model_metrics.py)
        self.batchers = batchers
        self.budget = ByteBudget(max_bytes_in_flight)  # reward_service/admission.py
        self.shared_memory = shared_memory or SharedMemoryConfig()
        self.regions = RegionTable(self.shared_memory)
        self._lock = threading.Lock()
        self._in_flight = 0  # guarded by _lock
        self._served = 0  # guarded by _lock
        self._since = time.monotonic()  # guarded by _lock
        self.assigned_stream_priority = 0  # the scheduler's last assignment (one int write; read anywhere)
        self.closed = False  # set by close (one bool write; read anywhere)
        self.leaf_channel: leaf_channel.LeafChannelServer | None = None  # set once by start(), before serving
        self.in_process: InProcessServer | None = None  # likewise: waves of a search in this process
        self.local_port = 0  # the port this server listens on, set once it does (one int write)

    def peer_uid(self, context) -> int | None:
        """The uid owning the caller's loopback socket (tandem/peer.py: the
        kernel's exact lookup once ``local_port`` is set, else /proc/net/tcp);
        None where it cannot be told."""
        return peer.uid(context.peer(), self.local_port)

    def _session(self, name: str, context) -> ModelSession:
        session = self.sessions.get(name)
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"model: no model named {quote(name)} (models: {sorted(self.sessions)})")
        return session

    def Evaluate(self, request, context):
        session = self._session(request.model, context)
        lane = LANES[_request_class(request.request_class)]
        self.metrics.requested(session.name, lane)
        start = time.perf_counter()
        with self._lock:
            self._in_flight += 1
        IN_FLIGHT.inc()
        try:
            try:
                if self.critical_address and not self.standby and lane == LANES[reward_pb2.REQUEST_CLASS_CRITICAL]:
                    raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "wrong_server",
                                  f"request_class: this is the reward service's bulk server (reward.bulk_server), "
                                  f"which serves bulk requests only; send critical ones to the reward service at "
                                  f"{self.critical_address}")
                names = _region_names(request)
                if names:
                    check_client(request.client_id, context.peer())
                with self.budget.admit(INPUT_COPIES * request.ByteSize(),
                                       lane == LANES[reward_pb2.REQUEST_CLASS_CRITICAL]) as held, \
                        self.regions.acquire(request.client_id, names, uid=self.peer_uid(context) if names else None) as lease:
                    try:
                        reply, rows = self._evaluate(session, request, lease, context, held)
                    except BaseException as exc:
                        # The failed call's frames (and those of the errors it was raised from) would
                        # keep its arrays -- the request's tensors, or arrays over shared memory and so
                        # the mappings of regions unregistered meanwhile -- until a garbage collection.
                        clear_chain(exc)
                        raise
            # A refusal is answered from a copy without a traceback: the exception itself, kept in
            # this frame while abort raises from it, would hold this frame through its traceback.
            except OverBudget as exc:  # reward.max_bytes_in_flight (reward_service/admission.py)
                refused = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "bytes_in_flight", f"model {session.name!r}: {exc}")
            except SharedMemoryError as exc:
                refused = Refusal(exc.code, "shared_memory", str(exc))
            except Refusal as exc:
                refused = Refusal(exc.code, exc.reason, exc.message)
            else:
                self.metrics.succeeded(session.name, lane, rows, time.perf_counter() - start, reply.queue_ms / 1e3)
                return reply
            self.metrics.failed(session.name, lane, refused.reason, time.perf_counter() - start)
            context.abort(refused.code, refused.message)
        finally:
            IN_FLIGHT.dec()
            with self._lock:
                self._in_flight -= 1
                self._served += 1

    def _evaluate(self, session: ModelSession, request, lease: Lease, context, held: Held | None = None):
        """Evaluate with the request's regions held by ``lease``: the reply and
        the request's rows; ``held``: its bytes in flight, which grow by its
        outputs' once its rows are known. Raises Refusal, OverBudget, or
        SharedMemoryError (the caller answers them)."""
        try:
            feeds = session.decode([lease.input(t) if t.WhichOneof("contents") == "shared_memory" else t
                                    for t in request.inputs])
            names = session.check_output_names(request.output_names)  # counted before any copy
            rows = len(next(iter(feeds.values())))
            output_refs = _output_refs(session, request, names, rows, lease)
        except InputError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "invalid_input", str(exc)) from None
        if held is not None:
            held.grow(OUTPUT_COPIES * rows * session.output_row_bytes(names))
        deadline = Deadline.of_grpc(context)  # None: a call without one
        request_class = _request_class(request.request_class)
        done = refusal.run(self.batchers[session.name], session.name, feeds, rows, request_class, deadline, names)
        outputs = done.outputs
        lease.check_live()  # a region unregistered meanwhile gets nothing written
        dtypes = {s.name: s.dtype for s in session.outputs}
        return reward_pb2.EvaluateResponse(
            model=session.name,
            outputs=[lease.write_output(n, output_refs[n], a, dtypes[n]) if n in output_refs else tensors.to_proto(n, a)
                     for n, a in outputs.items()],
            execution_provider=session.execution_provider,
            queue_ms=done.queue_ms,
            compute_ms=done.compute_ms,
            batch_size=done.batch_rows,
            padded_batch_size=done.bucket,
        ), rows

    # -- shared memory (reward_service/shared_memory.py) ---------------------------

    def RegisterSharedMemory(self, request, context):
        with _shared_memory_status(context):
            if self.shared_memory.local_clients_only and not peer.is_local(context.peer()):
                raise SharedMemoryError(grpc.StatusCode.PERMISSION_DENIED,
                                        f"peer {context.peer()}: shared memory is for clients on the server's host "
                                        f"(reward.shared_memory.local_clients_only)")
            check_client(request.client_id, context.peer())
            kind, uid = request.WhichOneof("memory"), self.peer_uid(context)
            if kind == "system":
                self.regions.register_system(request.client_id, request.name, request.byte_size,
                                             request.system.key, request.system.offset, uid)
            elif kind == "cuda":
                self.regions.register_cuda(request.client_id, request.name, request.byte_size,
                                           request.cuda.raw_handle, request.cuda.device_id, uid)
            else:
                raise SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT, "memory: set system or cuda")
        return reward_pb2.RegisterSharedMemoryResponse(lease_ttl_ms=self.shared_memory.lease_ttl_ms)

    def UnregisterSharedMemory(self, request, context):
        with _shared_memory_status(context):
            check_client(request.client_id, context.peer())
            names = self.regions.unregister(request.client_id, request.name, uid=self.peer_uid(context))
        return reward_pb2.UnregisterSharedMemoryResponse(names=names)

    def SharedMemoryStatus(self, request, context):
        with _shared_memory_status(context):
            check_client(request.client_id, context.peer())
            regions = self.regions.status(request.client_id, request.name, uid=self.peer_uid(context))
        return reward_pb2.SharedMemoryStatusResponse(regions=[_region_status(r) for r in regions],
                                                     lease_ttl_ms=self.shared_memory.lease_ttl_ms)

    def ModelMetadata(self, request, context):
        s = self._session(request.model, context)
        return reward_pb2.ModelMetadataResponse(
            name=s.name,
            version=s.version,
            description=s.description,
            inputs=[x.to_proto() for x in s.inputs],
            outputs=[x.to_proto() for x in s.outputs],
            execution_provider=s.execution_provider,
            available_providers=ort.get_available_providers(),
            max_batch_size=s.max_batch_size,
            # stream_priority_in_use: the bulk lane's, the one the assignment moves (as before lanes).
            runtime={**s.runtime, "stream_priority_in_use": str(s.active_stream_priority),
                     "stream_priority_bulk_lane": str(s.active_stream_priority),
                     # The bulk server has no critical lane: no priority to name (0 would read as the least).
                     "stream_priority_critical_lane": str(s.critical_stream_priority) if s.critical_lane else "none",
                     "stream_priority_assigned": str(self.assigned_stream_priority),
                     "bulk_share_percent": str(self.batchers[s.name].bulk_share),
                     **self._leaf_channel_runtime(s), **self._role_runtime()},
        )

    def _leaf_channel_runtime(self, s: ModelSession) -> dict[str, str]:
        """Where a search on this host finds the leaf channel (tandem/leaf_channel.py):
        its socket, and the CUDA device for a CUDA input region (-1: system memory)."""
        if self.leaf_channel is None:
            return {}
        device = 0 if s.execution_provider == "CUDAExecutionProvider" else -1
        # "_outputs": the kinds of output region this server takes (a client of an older
        # server, which named none, registers system memory for its outputs).
        return {LEAF_CHANNEL_KEY: self.leaf_channel.path, f"{LEAF_CHANNEL_KEY}_device": str(device),
                f"{LEAF_CHANNEL_KEY}_outputs": ",".join(leaf_channel.REGION_KINDS)}

    def _role_runtime(self) -> dict[str, str]:
        """Which server this is, and where its partner is: the reward service
        names its bulk server (``bulk_server``, where one runs), the bulk
        server the reward service for critical requests (``critical_server``)."""
        if self.critical_address:
            return {"role": "bulk server, standby for critical requests" if self.standby else "bulk server",
                    "critical_server": self.critical_address}
        return {"role": "reward service", **({BULK_SERVER_KEY: self.bulk_address} if self.bulk_address else {}),
                **({STANDBY_KEY: self.bulk_address} if self.bulk_address and self.standby else {})}

    def ListModels(self, request, context):
        return reward_pb2.ListModelsResponse(models=sorted(self.sessions))

    def set_stream_priority(self, stream_priority: int) -> None:
        """The scheduler's assignment (a CUDA stream priority; lower is more
        urgent): every model's bulk lane switches to its runner on the held
        stream :func:`tandem.stream_priority.nearest_allowed` picks (critical
        lanes stay on the greatest held stream priority). On a CPU host no
        stream is held: the assignment is only recorded."""
        self.assigned_stream_priority = stream_priority
        for s in self.sessions.values():
            s.set_stream_priority(stream_priority)

    def set_bulk_share(self, percent: int) -> None:
        """The scheduler's lever over bulk work: every model's bulk lane may run
        batches ``percent`` (1..100; 0 = 100) of wall time (reward_service/batcher.py)."""
        for b in self.batchers.values():
            b.set_bulk_share(percent)

    def load(self) -> dict:
        """Load report fields for the scheduler (LoadReport): requests in
        flight, the age of the oldest queued request (ms), the rate, and the
        95th percentile of critical requests' queue + model time (ms) since the
        previous report (0 when none ran)."""
        ages = [b.stats()["oldest_age_ms"] for b in self.batchers.values()]
        critical = [ms for b in self.batchers.values() for ms in b.take_latencies(reward_pb2.REQUEST_CLASS_CRITICAL)]
        with self._lock:
            now = time.monotonic()
            rate = self._served / max(now - self._since, 1e-3)
            self._served, self._since = 0, now
            return {"queue_depth": self._in_flight, "queue_age_ms": max(ages, default=0.0), "requests_per_s": rate,
                    "critical_latency_ms": float(np.percentile(critical, 95)) if critical else 0.0}

    def close(self) -> None:
        self.closed = True
        if self.in_process is not None:
            tandem_in_process.withdraw(self.in_process)
            self.in_process.close()
        if self.leaf_channel is not None:
            self.leaf_channel.close()
        for b in self.batchers.values():
            b.close()
        self.regions.close()


def _request_class(value: int) -> int:
    """The batcher's class for ``EvaluateRequest.request_class``: critical, or
    bulk for everything else (UNSPECIFIED and values this build does not know)."""
    critical = value == reward_pb2.REQUEST_CLASS_CRITICAL
    return reward_pb2.REQUEST_CLASS_CRITICAL if critical else reward_pb2.REQUEST_CLASS_BULK


@contextmanager
def _shared_memory_status(context):
    """Answers a SharedMemoryError with its status and message."""
    try:
        yield
    except SharedMemoryError as exc:
        context.abort(exc.code, str(exc))


def _region_names(request) -> set[str]:
    """The regions an EvaluateRequest names, inputs and outputs."""
    names = {t.shared_memory.region for t in request.inputs if t.WhichOneof("contents") == "shared_memory"}
    return names | {ref.region for ref in request.output_shared_memory.values()}


def _output_refs(session: ModelSession, request, names: tuple[str, ...], rows: int, lease: Lease) -> dict:
    """The request's output_shared_memory (output name -> SharedMemoryRef),
    each checked before the request is queued.

    Raises:
        InputError: an output the model lacks or the request does not ask for.
        SharedMemoryError: INVALID_ARGUMENT: a ref outside its region, misaligned or too small.
    """
    refs = dict(request.output_shared_memory)
    specs = {s.name: s for s in session.outputs}
    for name, ref in refs.items():
        field = f"output_shared_memory[{quote(name)}]"
        if name not in specs:
            raise InputError(f"{field}: model {session.name!r} has no output {quote(name)} (outputs: {list(specs)})")
        if names and name not in names:
            raise InputError(f"{field}: not among the requested output_names {list(names)}")
        spec = specs[name]
        row = spec.shape[1:]  # the first dimension is the batch
        static = all(d >= 0 for d in row)
        nbytes = rows * int(np.prod(row, dtype=np.int64)) * tensors.numpy_dtype(spec.dtype).itemsize if static else None
        lease.check_output(name, ref, spec.dtype, nbytes)
    return refs


def _region_status(r: RegionStatus) -> reward_pb2.SharedMemoryRegionStatus:
    memory = ({"cuda": reward_pb2.CudaSharedMemory(**r.memory)} if r.kind == "cuda"
              else {"system": reward_pb2.SystemSharedMemory(**r.memory)})  # a memfd: a system region without a key
    return reward_pb2.SharedMemoryRegionStatus(name=r.name, byte_size=r.byte_size, in_flight=r.in_flight,
                                               expires_in_ms=r.expires_in_ms, **memory)


class _WarmUpContext:
    """The part of a gRPC context Evaluate uses, for the start-up call."""

    def time_remaining(self):
        return None

    def abort(self, code, details):
        raise RuntimeError(f"warm-up Evaluate failed: {code.name}: {details}")


def _warm_up(servicer: RewardServicer) -> None:
    """One Evaluate per model and lane (a critical and a bulk one; the bulk
    server's bulk one) through the servicer (decode, batcher, encode), so the
    first client request finds every Python path and the lanes' threads warm."""
    classes = (reward_pb2.REQUEST_CLASS_CRITICAL, reward_pb2.REQUEST_CLASS_BULK)
    for s in servicer.sessions.values():
        inputs = [tensors.to_proto(x.name, np.zeros([1 if d == -1 else d for d in x.shape], tensors.numpy_dtype(x.dtype)))
                  for x in s.inputs]
        for request_class in classes[1:] if servicer.critical_address and not servicer.standby else classes:
            request = reward_pb2.EvaluateRequest(model=s.name, inputs=inputs, request_class=request_class)
            servicer.Evaluate(request, _WarmUpContext())


def _batcher(session: ModelSession, cfg: TandemConfig, metrics: ModelMetrics) -> Batcher:
    def executed(batch, seconds):  # a failed run is an execution too
        metrics.executed(session.name, LANES[batch.lane], batch.rows, batch.bucket, seconds)

    return Batcher(
        session.run_batch,
        buckets=session.buckets,
        max_batch_size=session.max_batch_size,
        max_queue_delay_us=cfg.reward.max_queue_delay_us,
        max_queue_size=cfg.reward.max_queue_size,
        name=session.name,
        merge=session.mergeable,
        warm_up=session.warm_up,  # warm_up(lane), on each lane's worker thread, which runs that lane's requests
        executed=executed,  # on the worker, before the batch's waiters go on (Batcher's executed)
    )


def start(cfg: TandemConfig, follow_scheduler: bool = True, bulk_server: bool = False,
          place: WorkerPlace = WorkerPlace()) -> Service:
    """Loads every configured model (sessions, warm-up), starts a batcher per
    model (two lanes: each lane's worker thread warms that lane's runners up
    before the service serves) and serves on ``cfg.reward.address``, as
    process ``place`` of its workers (tandem/workers.py).

    With ``bulk_server``: the bulk server instead (``reward.bulk_server``, a
    process of its own): the same models, no leaf channel, on
    ``cfg.reward.bulk_server.address``; as the reward service's standby
    (``reward.bulk_server.standby``) with a critical lane each, for clients
    whose reward service is down (tandem/failover.py), else without, and
    critical requests there are FAILED_PRECONDITION.

    Raises:
        RuntimeError: a model cannot be loaded, or the address cannot be bound;
            the bulk server where ``reward.bulk_server.enabled`` is false.
    """
    gpu.set_host_wait(cfg.reward.host_wait)  # before ONNX Runtime or CuPy makes the device's context
    models, bulk_cfg = cfg.reward.models, cfg.reward.bulk_server
    if bulk_server and not bulk_cfg.enabled:
        # Off in the config, no one would know of it: the reward service names no bulk server, tandem
        # status shows none, and its ports were never checked against the other servers'.
        raise RuntimeError(f"reward.bulk_server.enabled is false: this config runs no bulk server (set it to true "
                           f"to serve one on {bulk_cfg.address})")
    # The memory pool is split evenly over every runner (models x (stream priorities + the critical
    # lane's own)), and each runner's share over its sessions (one per batch bucket).
    critical_lane = not bulk_server or bulk_cfg.standby  # the bulk server's only as the standby
    per_runner = cfg.reward.memory_pool_bytes // max(len(models) * runners_per_model(cfg.reward, critical_lane), 1)
    phases = Phases(log)
    sessions = {}
    for m in models:
        with phases.phase(f"model {m.name}: sessions"):
            sessions[m.name] = ModelSession(m, cfg.reward, pool_bytes=per_runner, warm=False,
                                            critical_lane=critical_lane)
    providers = sorted({s.execution_provider for s in sessions.values()})
    fact = host_fact(log)
    fact("reward service: execution provider(s) in use: %s", ", ".join(providers))
    for s in sessions.values():
        off = {k: v for k, v in s.runtime.items() if v.startswith("off")}
        if off:
            fact("model %s: GPU features off: %s", s.name, "; ".join(f"{k} {v}" for k, v in off.items()))
    metrics = ModelMetrics(list(sessions))
    batchers = {}
    for name, s in sessions.items():
        with phases.phase(f"model {name}: each lane's warm-up"):  # the lanes' workers warm their runners
            batchers[name] = _batcher(s, cfg, metrics)
    servicer = RewardServicer(sessions, batchers,
                              cfg.reward.shared_memory, metrics, cfg.reward.max_bytes_in_flight,
                              critical_address=cfg.reward.address if bulk_server else "",
                              bulk_address=bulk_cfg.address if bulk_cfg.enabled and not bulk_server else "",
                              standby=bulk_cfg.enabled and bulk_cfg.standby)
    gauge = multiprocess_metrics.set_function  # Gauge.set_function, and under workers set every second
    gauge(BYTES_IN_FLIGHT, lambda: servicer.budget.held)
    for name, b in servicer.batchers.items():
        for lane in LANES.values():
            metrics.watch_pending(name, lane, lambda b=b, lane=lane: b.stats()["lanes"][lane]["queued"])
    gauge(QUEUE_DEPTH, lambda: sum(b.stats()["queued"] for b in servicer.batchers.values()))
    for lane in LANES.values():
        gauge(LANE_QUEUE_DEPTH.labels(lane=lane),
              lambda lane=lane: sum(b.stats()["lanes"][lane]["queued"] for b in servicer.batchers.values()))
    gauge(SHM_REGIONS, lambda: servicer.regions.stats()["regions"])
    gauge(SHM_BYTES, lambda: servicer.regions.stats()["bytes"])
    POOL_LIMIT.set(cfg.reward.memory_pool_bytes)
    with phases.phase("one request per model and lane"):
        _warm_up(servicer)
    metrics.start()  # the warm-up's requests are not counted
    servicer.regions.start()
    if cfg.reward.leaf_channel.enabled and not bulk_server:  # leaves are critical work: not the bulk server's
        try:
            servicer.leaf_channel = leaf_channel.LeafChannelServer(
                cfg.reward.leaf_channel, sessions, servicer.batchers, servicer.regions, metrics,
                cfg.reward.shared_memory.lease_ttl_ms / 1e3)
            fact("reward service: leaf channel on %s", servicer.leaf_channel.path)
        except OSError as exc:  # searches then send their leaves over gRPC
            log.warning("reward service: no leaf channel (%s); searches use gRPC", exc)
    if not bulk_server:  # co-located mode offers it to its search service (stack/colocated.py)
        servicer.in_process = InProcessServer(sessions, servicer.batchers, metrics, cfg.reward.leaf_channel.max_rows)
    held = sorted({p for s in sessions.values() for p in s.stream_priorities}, reverse=True) or [0]

    def register(server):
        reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server)
        return reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name

    # The Open Inference Protocol beside RewardService, where tritonclient is installed (reward_service/oip.py).
    oip_register = oip.registrar(servicer, serving=lambda: not servicer.closed)

    def on_assignment(a):
        STREAM_PRIORITY.set(a.stream_priority)
        BULK_SHARE.set((a.bulk_share_percent or 100) / 100.0)
        servicer.set_stream_priority(a.stream_priority)
        servicer.set_bulk_share(a.bulk_share_percent)

    try:
        service = start_service(
            cfg,
            kind=scheduler_pb2.SERVICE_KIND_REWARD,  # the bulk server too: the bulk lever reaches it
            address=bulk_cfg.address if bulk_server else cfg.reward.address,
            metrics_port=bulk_cfg.metrics_port if bulk_server else cfg.reward.metrics_port,
            # Every Evaluate holds a gRPC thread while it waits in the batcher; the shared
            # server gives every admitted RPC a thread, so none waits in gRPC's FIFO
            # executor, where request classes and the bounded queue would not apply.
            server_cfg=cfg.reward.server,
            register=[register] + ([oip_register] if oip_register else []),
            load_fn=servicer.load,
            on_assignment=on_assignment,
            stream_priorities=held,
            memory_bytes=cfg.reward.memory_pool_bytes,
            follow_scheduler=follow_scheduler,
            capabilities=_capabilities(oip_register is not None, servicer),
            place=place,
        )
    except BaseException:
        servicer.close()
        raise
    service.servicer = servicer
    servicer.local_port = service.port  # from now on a caller's uid is one netlink lookup (tandem/peer.py)
    previous = service.on_close

    def close():
        if previous:
            previous()
        servicer.close()

    service.on_close = close
    return service


def _capabilities(open_inference_protocol: bool, servicer: RewardServicer) -> list[str]:
    """What this reward server offers beyond RewardService's base calls (Handshake):
    the bulk server names itself (``reward.bulk_only``); the reward service
    its leaf channel and, where one runs, a bulk server (``reward.bulk_server``:
    its address in ModelMetadata.runtime["bulk_server"])."""
    out = ["reward.request_classes", "reward.shared_memory.system"]
    if servicer.critical_address:
        out.append("reward.standby" if servicer.standby else "reward.bulk_only")
    else:
        out.append("reward.leaf_channel")
    if servicer.bulk_address:
        out.append("reward.bulk_server")
    if cuda_device_count() > 0:
        out.append("reward.shared_memory.cuda")
    if open_inference_protocol:
        out.append("reward.open_inference_protocol")
    return out


def serve(cfg: TandemConfig) -> None:
    """Runs the reward service until SIGINT/SIGTERM, as ``reward.workers``
    processes sharing its address (tandem/workers.py)."""
    workers.serve(cfg, cfg.reward.workers, cfg.reward.address, cfg.reward.server.grace_period_ms,
                  "reward_service.server:start")


def serve_bulk(cfg: TandemConfig) -> None:
    """Runs the reward service's bulk server (``reward.bulk_server``) until SIGINT/SIGTERM."""
    seen = catch_stop_signals()  # a stop signal during the start stops it once started (tandem/workers.py serve)
    start(cfg, bulk_server=True).serve_forever(cfg.reward.server.grace_period_ms, seen)
