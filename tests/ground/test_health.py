"""Health updates (tandem.server.HealthServicer, RunningServer.set_serving): a Watch
stream can neither deadlock the server nor hold its stop."""
from __future__ import annotations

import time


def test_set_serving_is_not_held_by_a_stuck_watch_stream():
    """grpc's HealthServicer.set waits for every Watch stream's write under its lock;
    a stream that never drains once hung a scheduler's stop. set_serving waits a bounded
    time and goes on; the update lands once the stream lets go. (A health servicer whose
    watcher is stuck: the real hang needs unlucky timing.)"""
    import threading

    from grpc_health.v1 import health_pb2

    from tandem.server import HealthServicer, RunningServer

    servicer = HealthServicer()
    release = threading.Event()
    servicer._send_response_callbacks[""] = [lambda response: release.wait(30)]  # a watcher whose write is stuck
    running = RunningServer(server=None, health=servicer, port=0, services=())
    began = time.monotonic()
    running.set_serving(False, timeout_s=0.2)
    assert time.monotonic() - began < 20  # bounded, not held for the stuck write's 30 s
    release.set()
    deadline = time.monotonic() + 10
    while servicer._server_status.get("") != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_watch_stream_closing_during_a_health_update_does_not_deadlock():
    """grpc's HealthServicer.set waited for each Watch write under the lock that a
    closing stream's callback takes on the server's polling thread: a deadlock
    that hung a server's stop. Here a write that needs the lock (as the polling
    thread would, to finish it) completes while set() is sending."""
    import threading

    from grpc_health.v1 import health_pb2

    from tandem.server import HealthServicer

    servicer = HealthServicer()
    written = threading.Event()

    def write_needing_the_lock(response):
        t = threading.Thread(target=lambda: servicer._lock.acquire() and servicer._lock.release(), daemon=True)
        t.start()
        t.join(10)  # under grpc's set() this thread waits for ever: set holds the lock
        assert not t.is_alive(), "the servicer's lock was held while writing"
        written.set()

    servicer._send_response_callbacks[""] = [write_needing_the_lock]
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert written.is_set()
