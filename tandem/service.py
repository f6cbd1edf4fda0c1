"""What the reward and search processes share: a gRPC server that follows the
scheduler (register, report load, apply assignments) and stops cleanly."""
from __future__ import annotations

import faulthandler
import gc
import logging
import os
import socket
from dataclasses import dataclass
from typing import Callable, Iterable

import grpc

from tandem.config import ServerConfig, TandemConfig
from tandem.workers import WorkerPlace
from tandem.server import (
    RunningServer,
    build_server,
    serve_until_signalled,
    start_metrics,
)

log = logging.getLogger(__name__)

EXIT_TIMEOUT_S = 3.0  # after draining, the longest the interpreter may take to exit


@dataclass
class Service:
    """A started service: its server, and the scheduler client that follows the scheduler."""

    running: RunningServer
    scheduler: object | None  # tandem.scheduler_client.SchedulerClient
    servicer: object | None = None  # the service's gRPC servicer (tests read its state)
    on_close: Callable[[], None] | None = None

    @property
    def port(self) -> int:
        return self.running.port

    def stop(self, grace_ms: float = 0.0) -> None:
        """Reports NOT_SERVING, drains in-flight RPCs for up to ``grace_ms``, then stops."""
        self.running.set_serving(False)
        self.running.health.end_watches()
        self.running.server.stop(grace_ms / 1000.0).wait()
        self._close()

    def _close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.on_close:
            self.on_close()
        # start_service froze what start-up made; a stopped service's objects (sessions, batchers,
        # threads, in reference cycles) are garbage now, which the collector never frees while
        # frozen: a process that starts services again (tests, benches) would keep every one.
        gc.unfreeze()

    def serve_forever(self, grace_ms: float, seen: list[int] | None = None) -> None:
        """Blocks until SIGINT/SIGTERM (one already in ``seen``, a list of
        :func:`tandem.server.catch_stop_signals`, too), then drains and stops.

        Shutdown is bounded: if the interpreter has not exited
        ``EXIT_TIMEOUT_S`` after draining (a library thread that will not
        end), every thread's stack goes to stderr and the process exits 1.
        """
        serve_until_signalled(self.running, grace_ms, on_stop=self._close, seen=seen)
        log.info("stopped")
        faulthandler.dump_traceback_later(EXIT_TIMEOUT_S, exit=True)


def start_service(
    cfg: TandemConfig,
    kind: int,
    address: str,
    metrics_port: int,
    server_cfg: ServerConfig,
    register: Iterable[Callable[[grpc.Server], str]],
    load_fn: Callable[[], dict],
    on_assignment: Callable[[object], None],
    stream_priorities: list[int],
    memory_bytes: int,
    follow_scheduler: bool = True,
    capabilities: Iterable[str] = (),
    place: WorkerPlace = WorkerPlace(),
) -> Service:
    """Starts a server and (unless ``follow_scheduler`` is false) its scheduler client,
    as process ``place`` of its workers (tandem/workers.py: the port they share, and
    the metrics endpoint on worker 0 only, serving every worker's metrics).

    The service is SERVING as soon as it is started: it does not wait for the
    scheduler, which it follows in the background (registering with backoff).
    ``capabilities`` go to the server's Handshake (tandem/contract.py).
    """
    address, metrics_port = place.address(address), place.metrics_port(metrics_port)
    running = build_server(address, server_cfg, cfg, register, capabilities, place.shares_port)
    try:
        start_metrics(metrics_port, address.rpartition(":")[0].strip("[]"))
    except BaseException:
        running.server.stop(0)  # don't leave the port bound behind a failed start
        raise
    client = None
    if follow_scheduler:
        from tandem.scheduler_client import SchedulerClient

        host = address.rpartition(":")[0]
        client = SchedulerClient(
            address=cfg.scheduler.address,
            kind=kind,
            instance=f"{socket.gethostname()}-{os.getpid()}-{running.port}",
            service_address=f"{host}:{running.port}",
            stream_priorities=stream_priorities,
            memory_bytes=memory_bytes,
            load_fn=load_fn,
            on_assignment=on_assignment,
            report_interval_ms=cfg.scheduler.report_interval_ms,
            cfg=cfg,
        )
        client.start()
    # What start-up made (sessions, kernels, config, modules) lives as long as the server: moved
    # out of the collector's reach, a full collection while serving walks only what serving makes.
    gc.collect()
    gc.freeze()
    running.set_serving(True)
    log.info("serving %s on port %d", ", ".join(running.services), running.port)
    return Service(running, client)
