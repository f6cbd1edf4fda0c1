"""Starting the scheduler daemon.

* :func:`serve` -- blocking, for the command line (``tandem up`` calls
  ``scheduler.main.serve(cfg)``; ``python -m scheduler.main [config.yaml]``
  works too): probes the device, logs what it found (a WARNING when stream
  priorities are not enforced across processes), serves on
  ``cfg.scheduler.address`` with metrics on ``cfg.scheduler.metrics_port``
  until SIGINT/SIGTERM, then drains.
* :func:`start` -- non-blocking, for tests and embedding: returns a
  :class:`SchedulerHandle` with ``.port`` and ``.stop()``.

Prometheus metrics (defined in :mod:`scheduler.server`):
``tandem_scheduler_services``, ``tandem_scheduler_stream_priority{service_instance}``,
``tandem_scheduler_urgency{service_instance}``, ``tandem_scheduler_decisions_total``,
``tandem_scheduler_mps_active`` (0/1),
plus the per-RPC latency histogram every tandem server has.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from scheduler import mps
from scheduler.server import SchedulerServicer, add_to_server
from tandem import device, nvml
from tandem.config import TandemConfig, load_config
from tandem.device import DeviceInfo, probe
from tandem.gpu import cuda_device_count
from tandem.server import (
    RunningServer,
    build_server,
    serve_until_signalled,
    start_metrics,
)
from tandem.urgency_weights import UrgencyWeights

log = logging.getLogger("scheduler")


@dataclass
class SchedulerHandle:
    """A running scheduler. ``stop`` ends the watch streams, then the server."""

    running: RunningServer
    servicer: SchedulerServicer
    device: DeviceInfo
    grace_ms: float

    @property
    def port(self) -> int:
        """The TCP port the server bound (useful with ``...:0``)."""
        return self.running.port

    def stop(self, grace_ms: float | None = None) -> None:
        """Reports NOT_SERVING, ends every watch stream (UNAVAILABLE), drains
        unary RPCs for up to ``grace_ms`` (default: the config's) and stops. Idempotent."""
        self.running.set_serving(False)
        self.running.health.end_watches()
        self.servicer.close()
        grace = self.grace_ms if grace_ms is None else grace_ms
        self.running.server.stop(grace / 1000.0).wait()


class _DrainHook:
    """Looks like a RunningServer to :func:`serve_until_signalled`; ends the
    watch streams as soon as it reports NOT_SERVING, so they do not hold up
    the drain for the whole grace period."""

    def __init__(self, handle: SchedulerHandle):
        self._handle = handle
        self.server = handle.running.server
        self.health = handle.running.health

    def set_serving(self, serving: bool) -> None:
        self._handle.running.set_serving(serving)
        if not serving:
            self._handle.servicer.close()


def log_findings(device: DeviceInfo, policy_name: str) -> None:
    """Logs the device and MPS findings; a WARNING when a GPU's priorities are not enforced."""
    if not device.has_gpu:  # nothing to enforce: not worth a warning, nor a range read from no device
        log.info("no GPU: the models and the search run on the CPU; stream priorities and MPS: %s",
                 mps.NOT_APPLICABLE)
        return
    prange = device.priority_range
    source = "from the device" if device.range_from_device else "nominal (H200), no device to ask"
    log.info("GPU: %s; memory %d bytes; stream priorities least %d .. greatest %d (%s)",
             device.gpu_name or "none", device.total_memory_bytes, prange.least, prange.greatest, source)
    log.info("MPS: %s", device.mps_message)
    if device.priorities_enforced:
        log.info("%s", device.message)
    else:
        log.warning("stream priorities are not enforced across processes: %s%s", device.message,
                    f"; policy {policy_name!r} assigns priorities that only act within one process"
                    if policy_name != "default" else "")


def start(cfg: TandemConfig, *, device: DeviceInfo | None = None,
          weights: UrgencyWeights | None = None) -> SchedulerHandle:
    """Starts the scheduler on ``cfg.scheduler.address`` (port 0 picks one) and
    reports SERVING. Does not start the metrics endpoint (:func:`serve` does).

    ``device`` defaults to :func:`tandem.device.probe()`, ``weights`` to
    ``cfg.scheduler.urgency``.

    Raises:
        RuntimeError: the address could not be bound.
        ValueError: unknown policy.
    """
    device = device if device is not None else probe()
    sched = cfg.scheduler
    servicer = SchedulerServicer(sched, device, weights or sched.urgency)
    try:
        running = build_server(sched.address, sched.server, cfg, register=[add_to_server(servicer)],
                               capabilities=["scheduler.leases", "scheduler.watch_assignments"])
    except BaseException:
        servicer.close()
        raise
    running.set_serving(True)
    return SchedulerHandle(running, servicer, device, sched.server.grace_period_ms)


def serve(cfg: TandemConfig) -> None:
    """Runs the scheduler until SIGINT/SIGTERM (blocking; call from the main thread)."""
    sched = cfg.scheduler
    control = start_mps(cfg)
    try:
        device = probe(control.pipe_directory)
        log_findings(device, sched.policy)
        start_metrics(sched.metrics_port, sched.address.rpartition(":")[0].strip("[]"))
        if sched.metrics_port and nvml.register_gpu_metrics():
            log.info("GPU utilisation and memory exported from NVML")
        handle = start(cfg, device=device)
        log.info("scheduler serving on %s (port %d), policy %r, lease ttl %.0f ms, metrics on port %d",
                 sched.address, handle.port, sched.policy, sched.lease_ttl_ms, sched.metrics_port)
        serve_until_signalled(_DrainHook(handle), handle.grace_ms, on_stop=handle.servicer.close)
    finally:
        mps.stop(control)
    log.info("scheduler stopped")


def start_mps(cfg: TandemConfig) -> mps.MpsControl:
    """Attaches to or starts the MPS control daemon (``scheduler.mps: auto``) and
    logs what holds; a WARNING where cross-process priorities are not enforced."""
    pipe, logs = device.mps_directories(cfg.scheduler)
    if cfg.scheduler.mps == "off":
        control = mps.MpsControl(pipe, logs, message="MPS left alone (scheduler.mps: off)")
    else:
        control = mps.ensure(pipe, logs, cuda_device_count() > 0)
    # Inactive on a GPU host: priorities do not act across processes (WARNING); on a CPU host: expected.
    (log.info if control.active or not cuda_device_count() else log.warning)("MPS: %s", control.message)
    return control


def main(argv: list[str] | None = None) -> None:
    """``python -m scheduler.main [config.yaml]``."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(load_config(argv[0] if argv else None))


if __name__ == "__main__":
    main()
