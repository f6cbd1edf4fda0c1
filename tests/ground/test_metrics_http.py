"""The /metrics endpoint on its bounded server (tandem/metrics_http.py):
half-sent requests hold at most MAX_HANDLERS threads and are closed after
TIMEOUT_S; scrapes are answered before and after."""
from __future__ import annotations

import socket
import threading
import time
import urllib.request

from tandem import metrics_http
from tandem.server import start_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_half_sent_requests_cost_at_most_max_handlers_threads_and_scrapes_go_on():
    port = free_port()
    server = start_metrics(port)
    try:
        assert "# HELP" in scrape(port)
        threads = threading.active_count()
        stalled = []
        for _ in range(30):  # never finish the headers: more than MAX_HANDLERS of them
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            stalled.append(s)
        time.sleep(0.2)  # the server accepts what it will
        assert threading.active_count() - threads <= metrics_http.MAX_HANDLERS
        # Past TIMEOUT_S the stalled connections are closed, and a scrape is answered.
        deadline = time.monotonic() + 30
        while True:
            try:
                body = scrape(port)
                break
            except OSError:
                assert time.monotonic() < deadline, "no scrape answered after the stalled connections timed out"
                time.sleep(0.2)
        assert "# HELP" in body
        for s in stalled:
            s.close()
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_off_and_a_port_in_use():
    assert start_metrics(0) is None
    port = free_port()
    server = start_metrics(port)
    try:
        try:
            start_metrics(port)
        except RuntimeError as exc:
            assert f"metrics_port {port}" in str(exc)
        else:
            raise AssertionError("a second server on the same port was started")
    finally:
        server.shutdown()
        server.server_close()
