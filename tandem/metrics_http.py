"""The Prometheus ``/metrics`` endpoint on a bounded HTTP server.

prometheus-client's own ``start_http_server`` starts a thread per connection
with no limit and no timeout: a local client that opens many connections and
never finishes its request holds a thread each for ever (1000 half-sent
``GET /metrics`` cost a server 1000 threads). Here the same WSGI app
(``prometheus_client.make_wsgi_app``) is served by wsgiref with at most
``MAX_HANDLERS`` connections handled at once (one more is closed at once: the
scraper tries again at its next interval) and a socket timeout on each, so a
connection that stops sending is closed after ``TIMEOUT_S``.

What it serves is :func:`tandem.multiprocess_metrics.registry`: the process's
own metrics, or, where the service runs as several worker processes, every
worker's merged (its function-valued gauges set just before each scrape).
"""
from __future__ import annotations

import socket
import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from tandem import multiprocess_metrics

MAX_HANDLERS = 8  # connections handled at once (a scraper needs one)
TIMEOUT_S = 2.0  # a connection's reads and writes; a scrape takes milliseconds


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # one line per scrape on stderr is noise


class BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    """wsgiref's server, a thread per connection up to ``MAX_HANDLERS``, each
    connection with a ``TIMEOUT_S`` socket timeout."""

    daemon_threads = True

    def __init__(self, *args, **kwargs):
        self.slots = threading.BoundedSemaphore(MAX_HANDLERS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):  # all handlers busy: refuse, never queue a thread
            self.shutdown_request(request)
            return
        try:
            request.settimeout(TIMEOUT_S)
            super().process_request(request, client_address)  # starts the handler's thread
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address):
        pass  # a client that timed out or went away: nothing to report


def serve_metrics(port: int, host: str = "127.0.0.1") -> BoundedServer:
    """Serves the metrics (:func:`tandem.multiprocess_metrics.registry`) on http://``host``:``port``/metrics
    from a daemon thread; returns the server (``shutdown()`` stops it).

    Raises:
        OSError: the port cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(BoundedServer):
        address_family = family

    app = make_wsgi_app(multiprocess_metrics.registry())

    def scrape(environ, start_response):
        multiprocess_metrics.refresh()  # multiprocess mode: this process's function-valued gauges, now
        return app(environ, start_response)

    httpd = make_server(host, port, scrape, Server, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
