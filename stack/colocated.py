"""Co-located mode: the reward and search services in one process.

Across processes, CUDA stream priorities act only under MPS (docs/design.md,
"Measured physics"); within one process they always act. Where MPS cannot
run, ``co_located: true`` in the config makes ``tandem up`` start this one
process instead of two (``tandem serve co_located`` runs it alone): both
services keep their own servers, ports, batchers, scheduler clients and
streams of each priority, now in one CUDA context.

The search service hands its leaf waves to the reward service in-process
(tandem/in_process.py: no socket, no gRPC; on a GPU a search's device waves
never cross the host); its other calls (metadata, health) go over loopback gRPC as before.
"""
from __future__ import annotations

import faulthandler
import logging

from tandem import in_process
from tandem.config import TandemConfig
from tandem.server import wait_for_stop_signal
from tandem.service import EXIT_TIMEOUT_S, Service

log = logging.getLogger(__name__)


def start(cfg: TandemConfig, follow_scheduler: bool = True) -> tuple[Service, Service]:
    """Starts the reward service, then the search service, in this process.

    Raises:
        RuntimeError: either cannot start (the reward service is stopped again
            if the search service fails).
    """
    from reward_service import server as reward_server
    from search_service import server as search_server

    reward = reward_server.start(cfg, follow_scheduler)
    # The search service's waves go straight into the reward service's critical lane
    # (tandem/in_process.py); withdrawn when the reward service stops.
    in_process.offer(cfg.reward.address, reward.servicer.in_process)
    try:
        search = search_server.start(cfg, follow_scheduler)
    except BaseException:
        reward.stop()
        raise
    log.warning("co-located: reward and search services in one process (stream priorities act without MPS)")
    return reward, search


def serve(cfg: TandemConfig) -> None:
    """Runs both services until SIGINT/SIGTERM, then drains and stops the search
    service first (it calls the reward service), then the reward service."""
    reward, search = start(cfg)
    wait_for_stop_signal()
    search.stop(cfg.search.server.grace_period_ms)
    reward.stop(cfg.reward.server.grace_period_ms)
    log.info("stopped")
    faulthandler.dump_traceback_later(EXIT_TIMEOUT_S, exit=True)  # bounded exit, as Service.serve_forever
