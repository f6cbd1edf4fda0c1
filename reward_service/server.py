"""RewardService: serves the configured ONNX models over gRPC."""
from __future__ import annotations

import logging
import threading
import time

import grpc
import onnxruntime as ort
from prometheus_client import Gauge

from tandem import tensors
from tandem.config import TandemConfig
from tandem.service import Service, start_service
from tandem.v1 import reward_pb2, reward_pb2_grpc, scheduler_pb2

from reward_service.session import InputError, ModelSession

log = logging.getLogger(__name__)

IN_FLIGHT = Gauge("tandem_reward_requests_in_flight", "Evaluate calls being served.")
PRIORITY = Gauge("tandem_reward_stream_priority", "CUDA stream priority assigned by the scheduler.")


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Evaluate / ModelMetadata / ListModels over a dict of ModelSessions.

    Thread safety: ONNX Runtime's ``InferenceSession.run`` may be called from
    several threads at once; the only shared mutable state here is the load
    counters, guarded by ``_lock``.
    """

    def __init__(self, sessions: dict[str, ModelSession]):
        self.sessions = sessions
        self._lock = threading.Lock()
        self._in_flight = 0  # guarded by _lock
        self._served = 0  # guarded by _lock
        self._since = time.monotonic()  # guarded by _lock

    def _session(self, name: str, context) -> ModelSession:
        session = self.sessions.get(name)
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"model: no model named {name!r} (models: {sorted(self.sessions)})")
        return session

    def Evaluate(self, request, context):
        session = self._session(request.model, context)
        with self._lock:
            self._in_flight += 1
        IN_FLIGHT.inc()
        try:
            received = time.perf_counter()
            try:
                feeds = session.decode(list(request.inputs))
                outputs, compute_ms = session.run(feeds, list(request.output_names))
            except InputError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            queue_ms = (time.perf_counter() - received) * 1e3 - compute_ms
            return reward_pb2.EvaluateResponse(
                model=session.name,
                outputs=[tensors.to_proto(n, a) for n, a in outputs.items()],
                execution_provider=session.execution_provider,
                queue_ms=max(queue_ms, 0.0),
                compute_ms=compute_ms,
            )
        finally:
            IN_FLIGHT.dec()
            with self._lock:
                self._in_flight -= 1
                self._served += 1

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
        )

    def ListModels(self, request, context):
        return reward_pb2.ListModelsResponse(models=sorted(self.sessions))

    def load(self) -> dict:
        """Load report fields for the scheduler (LoadReport)."""
        with self._lock:
            now = time.monotonic()
            rate = self._served / max(now - self._since, 1e-3)
            self._served, self._since = 0, now
            return {"queue_depth": self._in_flight, "requests_per_s": rate}


def start(cfg: TandemConfig, follow_scheduler: bool = True) -> Service:
    """Loads every configured model and starts serving on ``cfg.reward.address``.

    Raises:
        RuntimeError: a model cannot be loaded, or the address cannot be bound.
    """
    sessions = {m.name: ModelSession(m, cfg.reward) for m in cfg.reward.models}
    providers = sorted({s.execution_provider for s in sessions.values()})
    log.warning("reward service: execution provider(s) in use: %s", ", ".join(providers))
    servicer = RewardServicer(sessions)

    def register(server):
        reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server)
        return reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name

    service = start_service(
        cfg,
        kind=scheduler_pb2.SERVICE_KIND_REWARD,
        address=cfg.reward.address,
        metrics_port=cfg.reward.metrics_port,
        server_cfg=cfg.reward.server,
        register=[register],
        load_fn=servicer.load,
        on_assignment=lambda a: PRIORITY.set(a.stream_priority),
        stream_priorities=[0],
        memory_bytes=cfg.reward.memory_pool_bytes,
        follow_scheduler=follow_scheduler,
    )
    service.servicer = servicer
    return service


def serve(cfg: TandemConfig) -> None:
    """Runs the reward service until SIGINT/SIGTERM."""
    start(cfg).serve_forever(cfg.reward.server.grace_period_ms)
