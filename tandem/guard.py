"""What every call to a tandem server passes before a worker thread serves it.

Python's synchronous gRPC server gives each call a thread of its executor for
the whole call, including the wait for the request message; a client could
hold every thread with calls that never send one, with streams it never
reads, or simply with more calls than there are threads (the rest queued,
health checks among them). :class:`Guard`, the servers' interceptor, bounds
that:

* **Token first.** The bearer token is checked from the call's headers, on
  gRPC's own polling thread; a call without it is refused UNAUTHENTICATED by a
  handler that never waits for its message.
* **Admission.** At most ``max_concurrent_rpcs`` application calls are served
  at once, each on its own thread (the executor has that many, plus a few
  that answer refusals): beyond that, RESOURCE_EXHAUSTED at once, never a
  queue in front of the executor.
* **Health apart.** ``grpc.health.v1.Health`` runs on a small executor of its
  own, outside admission and without the token (probes carry none); its Watch
  keeps the library's non-blocking form, so an open Watch holds no thread.
* **Request-message timeout.** Every handler is served in its request-streaming
  form, so the thread reads the request itself, under a watchdog: a call whose
  message has not arrived ``request_message_timeout_ms`` after the call did
  (for a stream: after the previous message was taken) is cancelled, which
  frees its thread. Health calls have :data:`HEALTH_REQUEST_TIMEOUT_S`.
* **Status contract.** Messages are capped (:func:`tandem.errors.cap`); an
  exception a handler did not map is logged and answered INTERNAL, never
  gRPC's UNKNOWN "Exception calling application" with the text echoed.
"""
from __future__ import annotations

import hmac
import itertools
import logging
import threading
import time
from concurrent import futures
from typing import Callable, Iterator

import grpc

from tandem.errors import cap

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
#: Threads of the health executor (created on demand).
HEALTH_WORKERS = 8
#: A health request is a few bytes: the longest a health call may take to send it (s).
HEALTH_REQUEST_TIMEOUT_S = 1.0
#: Threads beyond the admitted calls', which answer refusals at once.
REFUSAL_WORKERS = 8
#: How often the watchdog looks for overdue request messages (s).
WATCHDOG_TICK_S = 0.05


class Admission:
    """Counts application calls in flight against ``limit`` (thread-safe)."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self._lock = threading.Lock()
        self._in_flight = 0  # guarded by _lock

    def enter(self) -> bool:
        """Takes a place; False when ``limit`` calls are in flight already."""
        with self._lock:
            if self._in_flight >= self.limit:
                return False
            self._in_flight += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight


class Watchdog:
    """One daemon thread that cancels calls whose request message is overdue.

    ``arm(deadline, cancel)`` registers ``cancel`` (a callable) to run once
    the monotonic time ``deadline`` (s) has passed, unless ``disarm(token)``
    came first. Precision: :data:`WATCHDOG_TICK_S`. Thread-safe.
    """

    def __init__(self, tick_s: float = WATCHDOG_TICK_S):
        self._tick_s = tick_s
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[float, Callable[[], None]]] = {}  # guarded by _lock
        self._ids = itertools.count()
        self._wake = threading.Event()  # set while anything is pending
        self._thread: threading.Thread | None = None  # guarded by _lock

    def arm(self, deadline: float, cancel: Callable[[], None]) -> int:
        with self._lock:
            token = next(self._ids)
            self._pending[token] = (deadline, cancel)
            self._wake.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grpc-request-watchdog", daemon=True)
                self._thread.start()
        return token

    def disarm(self, token: int) -> None:
        with self._lock:
            self._pending.pop(token, None)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(self._tick_s)
            now = time.monotonic()
            with self._lock:
                due = [token for token, (deadline, _) in self._pending.items() if deadline <= now]
                cancels = [self._pending.pop(token)[1] for token in due]
                if not self._pending:
                    self._wake.clear()
            for cancel in cancels:
                try:
                    cancel()
                except Exception:  # a call that ended meanwhile; never let the watchdog die
                    log.debug("cancelling an overdue call failed", exc_info=True)


WATCHDOG = Watchdog()  # shared by every server of the process


class _Context:
    """The servicer context a handler sees: the call's own, with every status
    message capped and aborts remembered (to tell them from failures)."""

    def __init__(self, context: grpc.ServicerContext):
        self._context = context
        self.aborted = False

    def abort(self, code, details):
        self.aborted = True
        self._context.abort(code, cap(details))

    def set_details(self, details):
        self._context.set_details(cap(details))

    def __getattr__(self, name):
        return getattr(self._context, name)


class _Requests:
    """The call's request messages, each awaited for at most ``timeout_s``
    (the first from the call's arrival), decoded with ``deserialize``."""

    def __init__(self, raw: Iterator, context: _Context, method: str, deserialize, timeout_s: float, arrived: float):
        self._raw, self._context, self._method = raw, context, method
        self._deserialize, self._timeout_s = deserialize, timeout_s
        self._deadline = arrived + timeout_s

    def __iter__(self):
        return self

    def __next__(self):
        token = WATCHDOG.arm(self._deadline, self._context.cancel)
        try:
            raw = next(self._raw)  # StopIteration at the end; grpc.RpcError once cancelled
        finally:
            WATCHDOG.disarm(token)
            self._deadline = time.monotonic() + self._timeout_s
        if self._deserialize is None:
            return raw
        try:
            return self._deserialize(raw)
        except Exception as exc:  # DecodeError: corrupt wire format, bad UTF-8, ...
            self._context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid message for {self._method} ({exc})")

    def first(self):
        """The one request message of a unary-request method."""
        try:
            return next(self)
        except StopIteration:
            self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {self._method} takes one request message")


class Guard(grpc.ServerInterceptor):
    """The servers' interceptor (see the module docstring).

    Args:
        token: bearer token the calls must carry ("" = none).
        admission: the application calls' limit.
        request_timeout_s: longest wait for a request message (s).
        health_pool: the executor health calls run on.
        observe: ``observe(method, code_name, seconds)`` for every call of a
            unary-unary method (latency metrics).
    """

    def __init__(self, token: str, admission: Admission, request_timeout_s: float,
                 health_pool: futures.ThreadPoolExecutor, observe: Callable[[str, str, float], None]):
        self._expected = f"Bearer {token}".encode() if token else b""
        self._admission = admission
        self._timeout_s = request_timeout_s
        self._health_pool = health_pool
        self._observe = observe

    def _authorized(self, details) -> bool:
        metadata = dict(details.invocation_metadata or ())
        got = metadata.get("authorization", "")
        got = got.encode("utf-8", "replace") if isinstance(got, str) else bytes(got)
        return hmac.compare_digest(got, self._expected)  # constant time

    def intercept_service(self, continuation, details):
        # Runs on gRPC's polling thread: nothing here may block.
        arrived = time.monotonic()
        health = details.method.startswith(HEALTH_PREFIX)
        if self._expected and not health and not self._authorized(details):
            return _DENY
        handler = continuation(details)
        if handler is None:
            return None
        return self._wrap(handler, details.method, arrived, health)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str, arrived: float, health: bool):
        inner = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        unary_request = not handler.request_streaming
        timeout_s = min(self._timeout_s, HEALTH_REQUEST_TIMEOUT_S) if health else self._timeout_s
        non_blocking = bool(getattr(inner, "experimental_non_blocking", False))
        admission = None if health else self._admission

        def prologue(raw_requests, raw_context):
            context = _Context(raw_context)
            if admission is not None and not admission.enter():
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{method}: {admission.limit} calls in flight, the most this server takes "
                              f"(server.max_concurrent_rpcs); retry later")
            try:
                requests = _Requests(raw_requests, context, method, handler.request_deserializer, timeout_s, arrived)
                return context, requests.first() if unary_request else requests
            except BaseException:
                if admission is not None:
                    admission.leave()
                raise

        def call(context, argument, *callback):
            try:
                return inner(argument, context, *callback)
            except Exception as exc:
                if _passes(context, exc):
                    raise  # as it is: a frame of ours that held it would keep it, its request and its traceback alive
                _internal(context, method, exc)

        if handler.response_streaming and non_blocking:
            def behavior(raw_requests, raw_context, send_response_callback):
                context, argument = prologue(raw_requests, raw_context)
                try:
                    call(context, argument, send_response_callback)
                finally:
                    if admission is not None:
                        admission.leave()
            behavior.experimental_non_blocking = True
        elif handler.response_streaming:
            def behavior(raw_requests, raw_context):
                context, argument = prologue(raw_requests, raw_context)
                return _Responses(context, method, lambda: inner(argument, context), admission)
        else:
            timed = handler.unary_unary is not None

            def behavior(raw_requests, raw_context):
                start = time.perf_counter()
                try:
                    context, argument = prologue(raw_requests, raw_context)
                    try:
                        return call(context, argument)
                    finally:
                        if admission is not None:
                            admission.leave()
                finally:
                    if timed:
                        code = raw_context.code() if hasattr(raw_context, "code") else None
                        self._observe(method, (code or grpc.StatusCode.OK).name, time.perf_counter() - start)

        if health:
            behavior.experimental_thread_pool = self._health_pool
        make = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                else grpc.stream_unary_rpc_method_handler)
        return make(behavior, request_deserializer=None, response_serializer=handler.response_serializer)


class _Responses:
    """The responses of a blocking response-streaming handler, started at the
    first ``next``. Its admission place is given back when the stream ends,
    fails, or is dropped unread (client gone: gRPC lets go of the iterator,
    which then closes the handler's generator too)."""

    def __init__(self, context: _Context, method: str, start: Callable[[], Iterator], admission: Admission | None):
        self._context, self._method, self._start, self._admission = context, method, start, admission
        self._inner: Iterator | None = None
        self._released = False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            if self._inner is None:
                self._inner = iter(self._start())
            return next(self._inner)
        except StopIteration:
            self._release()
            raise
        except Exception as exc:
            self._release()
            if _passes(self._context, exc):
                raise
            _internal(self._context, self._method, exc)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            if self._admission is not None:
                self._admission.leave()

    def __del__(self):
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()
        self._release()


def _passes(context: _Context, exc: Exception) -> bool:
    """Whether ``exc`` goes on as it is: an abort, or a gRPC error. The caller
    re-raises it with a bare ``raise``: re-raised from a function that took it
    as a parameter, its traceback would hold that function's frame, which
    holds it -- a cycle that kept a refused request's memory (the message and
    every frame's copies of it) until a garbage collection."""
    return context.aborted or isinstance(exc, grpc.RpcError)


def _internal(context: _Context, method: str, exc: Exception) -> None:
    """Answers NotImplementedError UNIMPLEMENTED (gRPC's generated base classes
    raise it for every method not overridden) and anything else INTERNAL
    (``exc``: not one that :func:`_passes`)."""
    if isinstance(exc, NotImplementedError):  # a generated servicer base's method this server does not serve
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method}: not served here")
    log.exception("%s failed", method)
    context.abort(grpc.StatusCode.INTERNAL, f"{method}: internal error ({type(exc).__name__}: {exc})")


def _deny_call(request_iterator, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong authorization token")


# Request-streaming, so that the refusal does not wait for the message.
_DENY = grpc.stream_unary_rpc_method_handler(_deny_call)
