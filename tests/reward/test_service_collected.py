"""tandem/service.py freezes start-up's objects out of the collector
(gc.freeze) before SERVING; a service stopped in-process (tests, benches,
stack/colocated.py) must still be freed: its objects sit in reference
cycles, which a frozen heap never collects."""
from __future__ import annotations

import gc
import weakref

from conftest import loopback_config

from reward_service import server as reward_server


def test_a_stopped_reward_server_is_collected_once_another_has_started():
    """Two servers in turn; the first's servicer (its sessions, batchers and
    threads) is collected once both stopped. The last one started stays
    referenced by the process-wide gauges' callbacks until the next start."""
    gone = []
    for _ in range(2):
        service = reward_server.start(loopback_config(reward={"leaf_channel": {"enabled": False}}),
                                      follow_scheduler=False)
        assert gc.get_freeze_count() > 0  # start-up's objects were frozen
        gone.append(weakref.ref(service.servicer))
        service.stop()
        del service
    gc.collect()
    assert gone[0]() is None, "the first server's servicer is still alive: frozen, never collected"
