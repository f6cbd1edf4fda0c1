"""Start-up that all three gRPC servers share.

:func:`build_server` makes a ``grpc.server`` with the standard health service
(``grpc.health.v1``), server reflection, size and concurrency limits, keepalive
settings that accept idle pinging game engines, optional TLS / mutual TLS, an
optional bearer-token check, and per-RPC Prometheus latency histograms. What a
call passes before and while a thread serves it (token, admission, streams per
connection, health apart, the request-message and response-write timeouts,
capped status messages) is :mod:`tandem.guard`.
:func:`serve_until_signalled` runs it until SIGINT/SIGTERM and then drains.
"""
from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Histogram

from tandem import contract
from tandem.channel_options import CHANNEL_OPTIONS
from tandem.config import ServerConfig, TandemConfig, resolve_path
from tandem.heap import fix_mmap_threshold
from tandem.guard import HEALTH_WORKERS, REFUSAL_WORKERS, SPARE_WORKERS, Admission, Guard
from tandem.metrics_http import BoundedServer, serve_metrics
from tandem.overload import QueueWait
from tandem.v1 import contract_pb2_grpc

log = logging.getLogger(__name__)

# Sub-millisecond work needs buckets well under 1 ms (seconds, Prometheus' unit).
LATENCY_BUCKETS_S = (
    50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 750e-6,
    1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 10e-3, 16.7e-3, 25e-3, 33e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 2.5, 10.0,
)
RPC_LATENCY = Histogram(
    "tandem_rpc_latency_seconds",
    "Server-side latency of one RPC, from handler entry to response (s).",
    ["method", "code"],
    buckets=LATENCY_BUCKETS_S,
)

# Game engines (e.g. Unreal's TurboLink) ping idle connections every ~45 s:
# permit pings without calls, but no more often than every 10 s (the server
# config's ``keepalive_min_ping_interval_ms`` replaces that figure); a client
# that pings faster gets two strikes, then GOAWAY ENHANCE_YOUR_CALM
# ("too_many_pings") and its connection is closed (tests/stack/test_access.py).
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
)

# Calls gRPC core holds before the server's Python code has taken them (its
# polling thread takes one at a time, and runs the guard's admission). Past the
# soft limit core sheds new calls at random, past the hard one every new call,
# answering CANCELLED before tandem sees them; core's defaults (1,000 and
# 3,000) shed 5-10 % of a flood of 2,000 Searches sent at once over 40
# connections (CPU, 2 cores), which the guard answers RESOURCE_EXHAUSTED (or
# serves) with these. Each pending call holds core's call state and what its
# stream has received (at most its flow-control window).
MAX_PENDING_CALLS = 4096
MAX_PENDING_CALLS_HARD = 2 * MAX_PENDING_CALLS
PENDING_CALL_OPTIONS = (
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS_HARD),
)


def _observe_latency(method: str, code: str, seconds: float) -> None:
    RPC_LATENCY.labels(method, code).observe(seconds)


class HealthServicer(health.HealthServicer):
    """grpc's health servicer, with ``set`` writing to the ``Watch`` streams
    outside its lock.

    grpc's ``set`` holds the servicer's lock while it waits for each stream's
    write to complete; the server's polling thread takes the same lock when a
    ``Watch`` stream closes, and it is the thread that completes the writes.
    A stream closing during an update so deadlocked the server: its stop hung
    for good (a fresh-clone CI run, the starvation test's 24 streams). Here
    the lock guards only the tables; the writes follow, without it.
    """

    def set(self, service: str, status: int) -> None:
        with self._lock:
            if self._gracefully_shutting_down:
                return
            self._server_status[service] = status
            callbacks = list(self._send_response_callbacks.get(service, ()))
        for send_response in callbacks:
            send_response(health_pb2.HealthCheckResponse(status=status))

    def Watch(self, request, context, send_response_callback=None):
        """grpc's Watch, each stream's sends ending at its first end (``None``),
        and a stream opened while the server stops given its status and ended at once."""
        if send_response_callback is None:  # the library's blocking form (not the guard's)
            return super().Watch(request, context, send_response_callback)
        ended = threading.Event()

        def send(response) -> None:
            if not ended.is_set():
                if response is None:
                    ended.set()
                send_response_callback(response)

        with self._lock:
            stopping = self._gracefully_shutting_down
            status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        if stopping:
            send(health_pb2.HealthCheckResponse(status=status))
            send(None)
            return None
        return super().Watch(request, context, send)

    def end_watches(self) -> None:
        """Ends every open Watch stream (status OK, after the last status it was
        sent), and any opened from now on at once: a stopping server keeps no
        stream open, which would hold its stop for the whole grace period
        (as grpc-dotnet #2582 describes). Call it after the NOT_SERVING update."""
        with self._lock:
            self._gracefully_shutting_down = True
            callbacks = [send for sends in self._send_response_callbacks.values() for send in sends]
        for send_response in callbacks:
            send_response(None)


HEALTH_UPDATE_TIMEOUT_S = 1.0  # how long set_serving waits for Watch streams to take an update


@dataclass
class RunningServer:
    server: grpc.Server
    health: HealthServicer
    port: int
    services: tuple[str, ...]
    admission: Admission | None = None  # the application calls in flight (tandem/guard.py)

    def set_serving(self, serving: bool, timeout_s: float = HEALTH_UPDATE_TIMEOUT_S) -> None:
        """Sets the health status of the server and of each service.

        The update pushes the new status down every open ``Watch`` stream and
        waits for each write (:class:`HealthServicer`); a stream whose client
        does not read can hold a write. So the update runs on its own thread,
        and this waits at most ``timeout_s`` for it: a stop goes on, and
        stopping the server then cancels the streams, which frees the update.
        """
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        done = threading.Event()

        def update() -> None:
            for name in ("", *self.services):
                self.health.set(name, status)
            done.set()

        threading.Thread(target=update, name="health-update", daemon=True).start()
        if not done.wait(timeout_s):
            log.warning("health: the update to %s is held up by a Watch stream; going on",
                        health_pb2.HealthCheckResponse.ServingStatus.Name(status))


def build_server(
    address: str,
    server_cfg: ServerConfig,
    cfg: TandemConfig,
    register: Iterable[Callable[[grpc.Server], str]],
    capabilities: Iterable[str] = (),
    reuse_port: bool = False,
) -> RunningServer:
    """Builds and starts a server on ``address`` ("host:port"; port 0 picks one);
    ``reuse_port``: other processes may bind it too (``SO_REUSEPORT``: a
    server's workers, tandem/workers.py; else a second bind fails).

    ``register`` holds functions that add one servicer and return its full
    service name (for health and reflection); ContractService (its Handshake
    names them and ``capabilities``) is added to every server. Health starts NOT_SERVING: the
    caller calls ``set_serving(True)`` once it is ready.

    Sets the process's interpreter switch interval to
    ``server_cfg.switch_interval_us`` (the smallest of its servers' where it
    runs several), and glibc's mmap threshold to 1 MiB (:func:`tandem.heap.fix_mmap_threshold`).

    Raises:
        RuntimeError: the address could not be bound.
    """
    sys.setswitchinterval(min(sys.getswitchinterval(), server_cfg.switch_interval_us / 1e6))
    fix_mmap_threshold()
    options = [
        ("grpc.max_receive_message_length", server_cfg.max_message_bytes),
        ("grpc.max_send_message_length", server_cfg.max_message_bytes),
        ("grpc.so_reuseport", int(reuse_port)),
        *PENDING_CALL_OPTIONS,
        *(
            (key, server_cfg.keepalive_min_ping_interval_ms)
            if key == "grpc.http2.min_ping_interval_without_data_ms" else (key, value)
            for key, value in KEEPALIVE_OPTIONS
        ),
    ]
    if server_cfg.max_concurrent_streams:  # see ServerConfig: off by default
        options.append(("grpc.max_concurrent_streams", server_cfg.max_concurrent_streams))
    # A thread for every admitted call (none waits in the executor's queue) and a few
    # spare; refusals and health calls have executors of their own; threads are made
    # on demand (tandem/guard.py).
    admission = Admission(server_cfg.max_concurrent_rpcs, per_connection=server_cfg.max_rpcs_per_connection,
                          queue_wait=QueueWait(server_cfg.queue_wait_target_ms))
    workers = max(server_cfg.max_workers, server_cfg.max_concurrent_rpcs) + SPARE_WORKERS
    health_pool = futures.ThreadPoolExecutor(max_workers=HEALTH_WORKERS, thread_name_prefix="grpc-health")
    refusal_pool = futures.ThreadPoolExecutor(max_workers=REFUSAL_WORKERS, thread_name_prefix="grpc-refusal")
    guard = Guard(cfg.auth_token, admission, server_cfg.request_message_timeout_ms / 1000.0, health_pool,
                  _observe_latency, refusal_pool, server_cfg.response_write_timeout_ms / 1000.0)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc-worker"),
        interceptors=[guard],
        options=options,
    )
    names = tuple(add(server) for add in register)
    contract_pb2_grpc.add_ContractServiceServicer_to_server(contract.ContractServicer(
        (*names, contract.SERVICE_NAME), capabilities, server_cfg.max_message_bytes,
        server_cfg.keepalive_min_ping_interval_ms, bool(cfg.auth_token)), server)
    names += (contract.SERVICE_NAME,)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if cfg.tls.cert_path:
        creds = grpc.ssl_server_credentials(
            [(resolve_path(cfg.tls.key_path).read_bytes(), resolve_path(cfg.tls.cert_path).read_bytes())],
            root_certificates=(
                resolve_path(cfg.tls.client_ca_path).read_bytes() if cfg.tls.client_ca_path else None
            ),
            require_client_auth=bool(cfg.tls.client_ca_path),
        )
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    running = RunningServer(server, health_servicer, port, names, admission)
    running.set_serving(False)
    server.start()
    return running


def can_bind(address: str) -> bool:
    """Is ``address`` (HOST:PORT) free to listen on? A plain bind, without
    ``SO_REUSEPORT``, which any listening socket on it refuses."""
    host, _, port = address.rpartition(":")
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    with socket.socket(family) as s:
        # As the servers do: connections of a stopped server in TIME_WAIT do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), int(port)))
        except OSError:
            return False
    return True


def start_metrics(port: int, host: str = "127.0.0.1") -> BoundedServer | None:
    """Serves Prometheus metrics on http://``host``:``port``/metrics (0: off),
    on a bounded server (tandem/metrics_http.py); ``host`` is the server's own
    bind host, so containers expose it too. Returns the HTTP server (None: off).

    Raises:
        RuntimeError: the port cannot be bound.
    """
    if not port:
        return None
    try:
        return serve_metrics(port, host)
    except OSError as exc:
        raise RuntimeError(f"metrics_port {port} on {host}: {exc.strerror}") from None


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SIGNAL_POLL_S = 0.1


def wait_for_stop_signal(seen: list[int] | None = None) -> int:
    """Blocks the main thread until SIGINT or SIGTERM; returns the signal
    (with ``seen``, a list of :func:`catch_stop_signals`: one that came
    before the call too).

    The handler only appends to a list: a Python signal handler runs on the
    main thread between two bytecodes, so one that took a lock (an
    ``Event.set()``) could find it held by the very wait it interrupted, and
    block forever: a server that took its parent-death SIGTERM while its main
    thread sat in ``Event.wait()`` never stopped (tests/stack/test_stack.py,
    test_servers_die_with_a_killed_supervisor: a search server outlived its
    SIGKILLed supervisor, its main thread in nested handlers each blocked in
    ``Event.set``).
    The main thread looks at the list every ``_SIGNAL_POLL_S`` (the sleep ends
    early when a signal comes: its handler runs, then the sleep goes on).
    """
    seen = catch_stop_signals() if seen is None else seen
    while not seen:
        time.sleep(_SIGNAL_POLL_S)
    return seen[0]


def catch_stop_signals() -> list[int]:
    """From now on SIGINT and SIGTERM are recorded, not fatal: each is
    appended to the list returned (by a handler that takes no lock, as
    :func:`wait_for_stop_signal` says), which :func:`wait_for_stop_signal`
    then takes, so a signal that came while a server was still starting
    (its workers) stops it as soon as it serves."""
    seen: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: seen.append(signum))
    return seen


def serve_until_signalled(running: RunningServer, grace_ms: float, on_stop: Callable[[], None] | None = None,
                          seen: list[int] | None = None) -> None:
    """Blocks until SIGINT or SIGTERM (:func:`wait_for_stop_signal`, with
    ``seen``), then reports NOT_SERVING, drains in-flight RPCs for up to
    ``grace_ms`` and stops."""
    wait_for_stop_signal(seen)
    log.info("stopping: draining for up to %.0f ms", grace_ms)
    running.set_serving(False)
    running.health.end_watches()
    running.server.stop(grace_ms / 1000.0).wait()
    if on_stop:
        on_stop()


# gRPC's default reconnect backoff starts at 1 s and grows by 1.6 up to 120 s: after
# a minute's outage a channel kept failing UNAVAILABLE for 10+ s after the peer was
# back. Capped at 0.5 s (+-20 % jitter) a channel is connected again within ~0.6 s
# of its peer listening (tests/ground/test_reconnect.py). The connect timeout
# (``grpc.min_reconnect_backoff_ms``, 20 s) is left alone: a slow peer still connects.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


def channel(address: str, cfg: TandemConfig | None = None) -> grpc.Channel:
    """A client channel to a tandem server, with TLS and the token where configured.

    The channel retries a lost connection every 0.1-0.5 s (:data:`RECONNECT_OPTIONS`),
    so calls succeed again within ~1 s of a restarted peer listening; calls made
    while it is down fail at once with UNAVAILABLE (pass ``wait_for_ready=True``
    to a call that should wait for it instead).

    Under TLS the server is verified against ``tls.ca_path`` (default: the
    servers' own ``tls.cert_path``), and ``tls.client_cert_path`` /
    ``tls.client_key_path``, where set, are presented for mutual TLS.
    A wildcard bind address (``0.0.0.0:P``, ``[::]:P``) is dialled on loopback.
    """
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]"):
        address = f"127.0.0.1:{port}"
    options = [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS]
    if cfg is None or not cfg.tls.cert_path:
        ch = grpc.insecure_channel(address, options=options)
    else:
        tls = cfg.tls
        creds = grpc.ssl_channel_credentials(
            root_certificates=resolve_path(tls.ca_path or tls.cert_path).read_bytes(),
            private_key=resolve_path(tls.client_key_path).read_bytes() if tls.client_key_path else None,
            certificate_chain=resolve_path(tls.client_cert_path).read_bytes() if tls.client_cert_path else None,
        )
        ch = grpc.secure_channel(address, creds, options=options)
    if cfg is not None and cfg.auth_token:
        ch = grpc.intercept_channel(ch, _TokenInterceptor(cfg.auth_token))
    return ch


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._md = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        md = list(details.metadata or []) + [self._md]
        return details._replace(metadata=md) if hasattr(details, "_replace") else _Details(details, md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression, self.metadata = d.wait_for_ready, d.compression, metadata


def health_status(address: str, cfg: TandemConfig | None = None, service: str = "", timeout_s: float = 1.0) -> str:
    """The health service's answer for ``service`` at ``address``: "SERVING",
    "NOT_SERVING", … or "UNREACHABLE"."""
    with channel(address, cfg) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"  # the server answers, but not for that service name
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
