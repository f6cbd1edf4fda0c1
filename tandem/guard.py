"""What every call to a tandem server passes before and while a worker thread serves it.

Python's synchronous gRPC server gives each call a thread of its executor for
the whole call: the wait for the request message, the work, and every
response write, which the thread waits to complete. A client could hold
every thread with calls that never send their message, with streams whose
responses it never reads, or simply with more calls than there are threads
(the rest queued, health checks among them). :class:`Guard`, the servers'
interceptor, bounds that. Its invariants:

* **Token first.** The bearer token is checked from the call's headers, on
  gRPC's own polling thread; a call without it is refused UNAUTHENTICATED on
  the refusal threads, never waiting for its message.
* **Admission before any queue.** Admission is decided on the polling thread,
  in the order calls arrive: at most ``max_concurrent_rpcs`` application calls
  hold a place, and the executor has a thread for each (plus
  :data:`SPARE_WORKERS`), so an admitted call never waits in the executor's
  queue (where a flood's calls were later cancelled instead of refused). A
  call beyond the limit is answered RESOURCE_EXHAUSTED, naming the limit and
  its key, by :data:`REFUSAL_WORKERS` threads of their own that do nothing
  else, so a flood of any size is refused, not queued behind admitted work.
* **Silent calls yield their place.** A call whose thread has waited
  :data:`SILENT_AFTER_S` for its first request message is *silent*: while the
  server is full, a newly arriving call takes the place of the longest silent
  one, which is cancelled (CANCELLED) at once. So calls that never send a
  message can fill only capacity no one else asks for: a victim's call is
  admitted however many silent calls a client holds.
* **Places per connection.** One connection (one client socket) holds at
  most ``max_rpcs_per_connection`` admission places; its further calls are
  refused RESOURCE_EXHAUSTED as their threads start, before their message is
  read. So one connection that floods, or never reads, leaves the rest of
  the places to everyone else.
* **Streams per connection**, where ``max_concurrent_streams`` is set (off by
  default: see :class:`tandem.config.ServerConfig`): one HTTP/2 connection
  carries at most that many calls at once (gRPC core's
  ``grpc.max_concurrent_streams``, set by :func:`tandem.server.build_server`).
* **Health apart.** ``grpc.health.v1.Health`` runs on a small executor of its
  own, outside admission and without the token (probes carry none); its Watch
  keeps the library's non-blocking form, so an open Watch holds no thread.
* **Request-message timeout.** Every handler is served in its
  request-streaming form, so the thread reads the request itself, under a
  watchdog: a call whose message has not arrived ``request_message_timeout_ms``
  after the call did (for a stream: after the previous message was taken) is
  cancelled, which frees its thread. Health calls have
  :data:`HEALTH_REQUEST_TIMEOUT_S`.
* **Response-write timeout.** A response-streaming handler's thread hands
  each response to gRPC and waits for the write to complete before asking for
  the next: a response that gRPC has not taken ``response_write_timeout_ms``
  after it was handed over (a client that grants no flow-control window, or
  does not read) cancels the call, which frees its thread and admission
  place (and the response's bytes). A unary response needs no timer: gRPC
  sends it with the status in one batch that no thread waits for, so the
  thread and the place are free as the handler returns.
* **Overload shedding.** Once admitted calls have queued for a thread
  without a break for 100 ms, a call whose thread starts more than
  ``server.queue_wait_target_ms`` after its arrival is refused
  RESOURCE_EXHAUSTED before any work (:mod:`tandem.overload`, CoDel's rule):
  a server offered more than it can serve answers some calls at once instead
  of all of them late.
* **Refusals give their memory back.** A call refused (or failed) after
  a request message of :data:`tandem.heap.TRIM_AFTER_BYTES` or more has
  :data:`tandem.heap.HEAP_TRIMMER` return the free pages of the C library's
  heaps to the system once the call has ended (:mod:`tandem.heap` says why).
* **Status contract.** Messages are capped (:func:`tandem.errors.cap`); an
  exception a handler did not map is logged and answered INTERNAL, never
  gRPC's UNKNOWN "Exception calling application" with the text echoed.
"""
from __future__ import annotations

import collections
import functools
import hmac
import itertools
import logging
import threading
import time
from concurrent import futures
from typing import Callable, Iterator

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc._cython import cygrpc

from tandem.errors import cap
from tandem.heap import HEAP_TRIMMER, TRIM_AFTER_BYTES
from tandem.overload import SHED, QueueWait

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
#: Threads of the health executor (created on demand).
HEALTH_WORKERS = 8
#: A health request is a few bytes: the longest a health call may take to send it (s).
HEALTH_REQUEST_TIMEOUT_S = 1.0
#: Threads of the refusal executor: they answer refusals (admission, token) and nothing else.
REFUSAL_WORKERS = 8
#: Threads of the main executor beyond one per admission place: for the calls
#: whose place a newcomer took (cancelled, their thread still unwinding).
SPARE_WORKERS = 8
#: How long a call's thread may wait for its first request message before the
#: call counts as silent, and a newcomer may take its place while the server is full (s).
SILENT_AFTER_S = 0.5
#: How often the watchdog looks for overdue request messages and response writes (s).
WATCHDOG_TICK_S = 0.05


class Place:
    """One admitted call's place in :class:`Admission` (fields under its lock)."""

    __slots__ = ("held", "cancel", "waiting_since", "peer", "arrived", "queued")

    def __init__(self, arrived: float = 0.0, queued: bool = False):
        self.held = True  # False once given back, or taken by a newcomer
        self.arrived = arrived  # monotonic s: when it was admitted
        self.queued = queued  # admitted, its thread not started yet (counted in the QueueWait)
        self.cancel: Callable[[], None] | None = None  # set while the thread waits for the first message
        self.waiting_since = 0.0  # monotonic s: when the thread began to wait for it
        self.peer = ""  # the connection holding it, once its thread knows (Admission.claim)


class Admission:
    """Counts application calls in flight against ``limit`` (thread-safe).

    While ``limit`` places are held, :meth:`enter` takes the place of the call
    that has waited longest for its first request message, if that is at
    least ``silent_after_s`` (s), and cancels that call. ``queue_wait``: the
    overload shedding rule of the calls admitted but not started (None: none).
    """

    def __init__(self, limit: int, silent_after_s: float = SILENT_AFTER_S, per_connection: int = 0,
                 queue_wait: QueueWait | None = None):
        self.limit = int(limit)
        self.queue_wait = queue_wait  # guarded by _lock (its counts)
        self.per_connection = int(per_connection)  # places one connection may hold (0: no cap)
        self._silent_after_s = silent_after_s
        self._lock = threading.Lock()
        self._in_flight = 0  # guarded by _lock
        self._by_peer: collections.Counter = collections.Counter()  # guarded by _lock: places per connection
        self._waiting: dict[Place, None] = {}  # guarded by _lock; oldest first
        self.displaced = 0  # guarded by _lock: silent calls whose place a newcomer took

    def enter(self) -> Place | None:
        """A place for a new call; None when ``limit`` calls hold one and none is silent."""
        cancel = None
        now = time.monotonic()
        with self._lock:
            if self._in_flight >= self.limit:
                cancel = self._displace_silent()
                if cancel is None:
                    return None
            self._in_flight += 1
            if self.queue_wait is not None:
                self.queue_wait.arrived(now)
        if cancel is not None:  # outside the lock: gRPC may call back into ours
            log.info("a call silent for %.1f s or more gave its place to a new one (server full)",
                     self._silent_after_s)
            _quietly(cancel)
        return Place(now, self.queue_wait is not None)

    def start(self, place: Place) -> float | None:
        """The call's thread starts it; the time it waited (s) where the
        overload rule refuses it (tandem.overload), else None."""
        with self._lock:
            if not place.queued:
                return None
            place.queued = False
            now = time.monotonic()
            waited = now - place.arrived
            return None if self.queue_wait.started(waited, now) else waited

    def _displace_silent(self) -> Callable[[], None] | None:
        """Under _lock: gives back the longest-waiting place if silent; its cancel."""
        place = next(iter(self._waiting), None)
        if place is None or time.monotonic() - place.waiting_since < self._silent_after_s:
            return None
        self._release(place)
        self.displaced += 1
        return place.cancel

    def claim(self, place: Place, peer: str) -> bool:
        """Counts the held ``place`` against its connection ``peer``; False (the
        place given back) when that connection holds ``per_connection`` already."""
        with self._lock:
            if not place.held:
                return True  # taken by a newcomer meanwhile: the caller finds out next
            if self.per_connection and self._by_peer[peer] >= self.per_connection:
                self._release(place)
                return False
            place.peer = peer
            self._by_peer[peer] += 1
            return True

    def waiting(self, place: Place, cancel: Callable[[], None]) -> bool:
        """The call's thread begins to wait for its first message; False if its place was taken."""
        with self._lock:
            if not place.held:
                return False
            place.cancel, place.waiting_since = cancel, time.monotonic()
            self._waiting[place] = None
            return True

    def received(self, place: Place) -> bool:
        """The first message came (or the request stream ended); False if its place was taken meanwhile."""
        with self._lock:
            self._waiting.pop(place, None)
            return place.held

    def leave(self, place: Place) -> None:
        """Gives the place back (idempotent)."""
        with self._lock:
            if place.held:
                self._release(place)

    def _release(self, place: Place) -> None:
        if place.queued:  # ended before its thread started it
            place.queued = False
            self.queue_wait.gone()
        place.held = False
        self._waiting.pop(place, None)
        self._in_flight -= 1
        if place.peer:
            self._by_peer[place.peer] -= 1
            if not self._by_peer[place.peer]:
                del self._by_peer[place.peer]

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def silent(self) -> int:
        """Calls now silent (waiting :data:`SILENT_AFTER_S` or more for their first message)."""
        now = time.monotonic()
        with self._lock:
            return sum(now - p.waiting_since >= self._silent_after_s for p in self._waiting)


def _quietly(cancel: Callable[[], None]) -> None:
    try:
        cancel()
    except Exception:  # a call that ended meanwhile; never let the caller die of it
        log.debug("cancelling a call failed", exc_info=True)


class Watchdog:
    """One daemon thread that cancels calls whose request message or response write is overdue.

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
                _quietly(cancel)
            # Not kept while idle: a cancel is bound to its call's objects, which give
            # the call's admission place back when they go.
            cancels = cancel = None


WATCHDOG = Watchdog()  # shared by every server of the process


class _Context:
    """The servicer context a handler sees: the call's own, with every status
    message capped and aborts remembered (to tell them from failures)."""

    def __init__(self, context: grpc.ServicerContext):
        self._context = context
        self.aborted = False
        self.large = False  # a request message of TRIM_AFTER_BYTES or more has come

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

    def __init__(self, raw: Iterator, context: _Context, method: str, deserialize, timeout_s: float, arrived: float,
                 key: str = "server.request_message_timeout_ms"):
        self._raw, self._context, self._method = raw, context, method
        self._deserialize, self._timeout_s, self._key = deserialize, timeout_s, key
        self._deadline = arrived + timeout_s

    def _overdue(self) -> None:
        """On the watchdog's thread: the message has not come in time."""
        _cancel(self._context, f"{self._method}: no request message within {self._timeout_s * 1e3:.0f} ms "
                               f"({self._key}): the client did not send it, or the server was too busy to "
                               f"take it; retry later")

    def __iter__(self):
        return self

    def __next__(self):
        token = WATCHDOG.arm(self._deadline, self._overdue)
        try:
            raw = next(self._raw)  # StopIteration at the end; grpc.RpcError once cancelled
        finally:
            WATCHDOG.disarm(token)
            self._deadline = time.monotonic() + self._timeout_s
        if self._deserialize is None:
            return raw
        if len(raw) >= TRIM_AFTER_BYTES:
            self._context.large = True
        if len(raw) >= LARGE_MESSAGE_BYTES and _more_fields_than(raw, MAX_MESSAGE_FIELDS,
                                                                 _descriptor_of(self._deserialize)):
            self._context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: more than {MAX_MESSAGE_FIELDS} fields in a {len(raw)}-byte "
                                f"{self._method} message (nested ones counted); no call of this server takes so "
                                f"many (repeated entries are bounded by the model or the config)")
        try:
            return self._deserialize(raw)
        except Exception as exc:  # DecodeError: corrupt wire format, bad UTF-8, ...
            self._context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid message for {self._method} ({exc})")


_END = object()  # a request stream that ended before its first message

#: A message this large is walked before it is parsed (smaller ones parse in well under a millisecond).
LARGE_MESSAGE_BYTES = 64 * 1024
#: Fields a large message may hold, those nested in its sub-messages (map entries included)
#: counted: every call's repeated entries are few (a model's inputs and outputs, a batch's
#: searches: at most search.max_batch_searches, ~13 fields each), and parsing a 34 MB message
#: of 6.8 M tiny entries held the process's interpreter 0.7 s (CPU), 800 k entries of one
#: input's ``parameters`` map (13 MB) 0.3-3.7 s.
MAX_MESSAGE_FIELDS = 4096


def _descriptor_of(deserialize) -> Descriptor | None:
    """The request message's descriptor, where ``deserialize`` is a generated
    message class's ``FromString`` (None otherwise: top-level fields only)."""
    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    return descriptor if isinstance(descriptor, Descriptor) else None


@functools.lru_cache(maxsize=None)
def _submessages(descriptor: Descriptor | None) -> dict[int, Descriptor]:
    """The message-typed fields of ``descriptor``, by field number (a map
    field is a repeated message of its entry type)."""
    if descriptor is None:
        return {}
    return {f.number: f.message_type for f in descriptor.fields if f.type == FieldDescriptor.TYPE_MESSAGE}


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


_GROUP = -1  # on the walk's stack: a group's start (its end key pops it)


def _more_fields_than(raw: bytes, limit: int, descriptor: Descriptor | None = None) -> bool:
    """Whether the protobuf message ``raw`` holds more than ``limit`` fields,
    counting those inside each field that ``descriptor`` (the message's type;
    None: none) declares a message, at any depth, map entries included.
    Walked from key to key without parsing, one step per field counted:
    O(limit), whatever the size. Strings, bytes, packed scalars and unknown
    fields are one field each, stepped over whole; a group's fields are
    counted, never walked into as messages (the parser keeps groups as unknown
    fields). Malformed bytes end the walk (False): the parser then refuses them."""
    pos, fields, end = 0, 0, len(raw)
    table = _submessages(descriptor)
    stack: list[tuple[int, dict]] = []  # (end, table) of the messages and groups around this one
    try:
        while True:
            if pos >= end:
                if pos > end or not stack or stack[-1][0] == _GROUP:
                    return False  # past its message's end, the whole message walked, or a group left open
                end, table = stack.pop()
                continue
            fields += 1
            if fields > limit:
                return True
            key, pos = _varint(raw, pos)
            wire = key & 7
            if wire == 0:
                _, pos = _varint(raw, pos)
            elif wire == 1:
                pos += 8
            elif wire == 2:
                length, pos = _varint(raw, pos)
                inner = table.get(key >> 3)
                if inner is None:
                    pos += length
                elif pos + length > end:
                    return False
                else:
                    stack.append((end, table))
                    end, table = pos + length, _submessages(inner)
            elif wire == 3:
                stack.append((_GROUP, table))
                table = {}
            elif wire == 4:
                if not stack or stack[-1][0] != _GROUP:
                    return False
                table = stack.pop()[1]
            elif wire == 5:
                pos += 4
            else:  # no such wire type
                return False
    except IndexError:
        return False


class Guard(grpc.ServerInterceptor):
    """The servers' interceptor (see the module docstring).

    Args:
        token: bearer token the calls must carry ("" = none).
        admission: the application calls' limit.
        request_timeout_s: longest wait for a request message (s).
        health_pool: the executor health calls run on.
        observe: ``observe(method, code_name, seconds)`` for every call of a
            unary-unary method (latency metrics).
        refusal_pool: the executor refusals run on (one of
            :data:`REFUSAL_WORKERS` threads is made when None).
        write_timeout_s: longest wait for gRPC to take one response (s; 0: none).
    """

    def __init__(self, token: str, admission: Admission, request_timeout_s: float,
                 health_pool: futures.ThreadPoolExecutor, observe: Callable[[str, str, float], None],
                 refusal_pool: futures.ThreadPoolExecutor | None = None, write_timeout_s: float = 0.0):
        self._expected = f"Bearer {token}".encode() if token else b""
        self._admission = admission
        self._timeout_s = request_timeout_s
        self._write_timeout_s = write_timeout_s
        self._health_pool = health_pool
        self._refusal_pool = refusal_pool or futures.ThreadPoolExecutor(REFUSAL_WORKERS, "grpc-refusal")
        self._observe = observe
        self._deny = self._refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong authorization token")

    def _authorized(self, details) -> bool:
        metadata = dict(details.invocation_metadata or ())
        got = metadata.get("authorization", "")
        got = got.encode("utf-8", "replace") if isinstance(got, str) else bytes(got)
        return hmac.compare_digest(got, self._expected)  # constant time

    def intercept_service(self, continuation, details):
        # Runs on gRPC's polling thread: nothing here may block.
        arrived = time.monotonic()
        method = details.method
        health = method.startswith(HEALTH_PREFIX)
        if self._expected and not health and not self._authorized(details):
            return self._deny
        handler = continuation(details)
        if handler is None:
            return None
        if health:
            return self._wrap(handler, method, arrived, None)
        place = self._admission.enter()
        if place is None:
            return self._refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"{method}: {self._admission.limit} calls in flight, the most this server takes "
                                 f"(server.max_concurrent_rpcs); retry later",
                                 method if handler.unary_unary is not None else None)
        try:
            return self._wrap(handler, method, arrived, place)
        except BaseException:
            self._admission.leave(place)
            raise

    def _refusal(self, code: grpc.StatusCode, message: str, observed: str | None = None) -> grpc.RpcMethodHandler:
        """A handler that answers ``code`` at once on the refusal threads, never
        reading the request (request-streaming, so nothing waits for it)."""
        def refuse(request_iterator, context):
            if observed is not None:
                self._observe(observed, code.name, 0.0)
            context.abort(code, message)
        refuse.experimental_thread_pool = self._refusal_pool
        return grpc.stream_unary_rpc_method_handler(refuse)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str, arrived: float, place: Place | None):
        inner = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        health = place is None
        timeout_s = min(self._timeout_s, HEALTH_REQUEST_TIMEOUT_S) if health else self._timeout_s
        if handler.response_streaming and getattr(inner, "experimental_non_blocking", False):
            # Health's Watch: no thread while the stream is open, so no response writes of ours to time.
            def watch(raw_requests, raw_context, send_response_callback):
                context = _Context(raw_context)
                try:
                    argument = _first(_Requests(raw_requests, context, method, handler.request_deserializer,
                                                timeout_s, arrived), context, method)
                    inner(argument, context, send_response_callback)
                except Exception as exc:
                    if _passes(context, exc):
                        raise
                    _internal(context, method, exc)
                finally:
                    if place is not None:
                        self._admission.leave(place)
            watch.experimental_non_blocking = True
            if health:
                watch.experimental_thread_pool = self._health_pool
            return grpc.stream_stream_rpc_method_handler(watch, response_serializer=handler.response_serializer)

        call = _Call(self, handler, inner, method, arrived, timeout_s, place)
        if handler.response_streaming:
            def behavior(raw_requests, raw_context):
                return call.responses(raw_requests, raw_context)
            factory = grpc.stream_stream_rpc_method_handler
        else:
            # A unary response goes with the status in one batch that the thread does not wait for:
            # no write to time, and no second write and thread wake-up per call as a stream's (the
            # stream form cost a unary call ~125 µs more at the p50 on a 2-core host).
            def behavior(raw_requests, raw_context):
                return call.responses(raw_requests, raw_context).only()
            factory = grpc.stream_unary_rpc_method_handler
        if health:
            behavior.experimental_thread_pool = self._health_pool
        return factory(behavior, response_serializer=handler.response_serializer)


class _Call:
    """How one method's calls are served: what :class:`_Responses` needs."""

    def __init__(self, guard: Guard, handler, inner, method: str, arrived: float, timeout_s: float,
                 place: Place | None):
        self.guard, self.handler, self.inner, self.method = guard, handler, inner, method
        self.arrived, self.timeout_s, self.place = arrived, timeout_s, place
        self.timeout_key = "tandem.guard.HEALTH_REQUEST_TIMEOUT_S" if place is None and method.startswith(
            HEALTH_PREFIX) else "server.request_message_timeout_ms"

    def responses(self, raw_requests, raw_context) -> "_Responses":
        return _Responses(self, _Context(raw_context), raw_requests)


class _Responses:
    """A call's responses, as gRPC's thread asks for them: the first ``next``
    reads the first request message and starts the handler. Each response
    handed to gRPC arms the write watchdog, and the next ``next`` (gRPC has
    sent it) disarms it. The admission place is given back when the stream
    ends, fails, or is dropped (client gone: gRPC lets go of the iterator,
    which then closes the handler's generator too)."""

    def __init__(self, call: _Call, context: _Context, raw_requests):
        self._call, self._context, self._raw = call, context, raw_requests
        self._inner: Iterator | None = None
        self._write: int | None = None  # the watchdog's token while a response is being written
        self._overdue = False
        self._released = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._write is not None:
            WATCHDOG.disarm(self._write)
            self._write = None
        if self._overdue:  # cancelled for a write that did not complete: stop here
            self._finish()
            raise StopIteration
        try:
            if self._inner is None:
                self._inner = self._start()
            response = next(self._inner)
        except StopIteration:
            self._release()
            raise
        except Exception as exc:
            self._release()
            if self._context.large:
                _trim_when_ended(self._context)
            if _passes(self._context, exc):
                raise
            _internal(self._context, self._call.method, exc)
        write_timeout_s = self._call.guard._write_timeout_s
        if write_timeout_s > 0 and self._call.handler.response_streaming:
            self._write = WATCHDOG.arm(time.monotonic() + write_timeout_s, self._write_overdue)
        return response

    def _start(self) -> Iterator:
        call, context = self._call, self._context
        place, admission = call.place, call.guard._admission
        if place is not None:
            _shed_if_overloaded(call, context)
        requests = _Requests(self._raw, context, call.method, call.handler.request_deserializer,
                             call.timeout_s, call.arrived, call.timeout_key)
        if place is not None and not admission.claim(place, context.peer()):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{call.method}: this connection has {admission.per_connection} calls in flight, the most "
                          f"one connection may hold (server.max_rpcs_per_connection); retry later")
        if place is not None and not admission.waiting(place, lambda: _cancel(context, _displaced_message(call))):
            _displaced(context, call)
        try:
            first = next(requests, _END) if call.handler.request_streaming else _first(requests, context, call.method)
        except BaseException:
            if place is not None:
                admission.received(place)
            raise
        if place is not None and not admission.received(place):
            _displaced(context, call)  # a newcomer took the place while the message was on its way
        if place is not None and call.handler.response_streaming and not context.add_callback(self._ended):
            self._ended()  # the call ended already
        if call.handler.request_streaming:
            argument = requests if first is _END else itertools.chain((first,), requests)
        else:
            argument = first
        if call.handler.response_streaming:
            return iter(call.inner(argument, context))
        return self._unary(argument)

    def _unary(self, argument) -> Iterator:
        """The one response of a unary-response handler, timed for unary-unary methods."""
        call, context = self._call, self._context
        start = time.perf_counter()
        try:
            response = call.inner(argument, context)
        finally:
            if call.handler.unary_unary is not None:
                code = context.code() if hasattr(context._context, "code") else None
                call.guard._observe(call.method, (code or grpc.StatusCode.OK).name, time.perf_counter() - start)
        yield response

    def only(self):
        """The one response of a unary-response handler, served without the
        stream form (its place given back before it is sent)."""
        try:
            return next(self)
        except StopIteration:  # displaced: the call has its status already; this one is never sent
            self._context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _displaced_message(self._call))
        finally:
            self._release()

    def _write_overdue(self) -> None:
        """On the watchdog's thread: gRPC has not taken the response in time."""
        self._overdue = True
        message = (f"{self._call.method}: a response not taken within {self._call.guard._write_timeout_s * 1e3:.0f} "
                   f"ms (server.response_write_timeout_ms): the client does not read; call ended")
        log.warning("%s", message)
        _cancel(self._context, message)

    def _ended(self) -> None:
        """On gRPC's thread as the call terminates (sent, failed or cancelled):
        the place comes back now. gRPC stops asking a cancelled stream for
        responses without closing it, and an armed write timer would keep this
        object, and the place, until it fired."""
        write, self._write = self._write, None
        if write is not None:
            WATCHDOG.disarm(write)
        self._call.guard._admission.leave(self._call.place)

    def _finish(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()
        self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            if self._write is not None:
                WATCHDOG.disarm(self._write)
                self._write = None
            if self._call.place is not None:
                self._call.guard._admission.leave(self._call.place)

    def __del__(self):
        self._finish()


def _trim_when_ended(context: _Context) -> None:
    """Has the heaps trimmed once the call has ended (its message's buffers freed)."""
    if not context.add_callback(HEAP_TRIMMER.request):
        HEAP_TRIMMER.request()  # ended already


def _shed_if_overloaded(call: _Call, context: _Context) -> None:
    """Refuses the call RESOURCE_EXHAUSTED where the server's queue of
    admitted calls stands and this one waited past its target (tandem.overload)."""
    admission = call.guard._admission
    waited = admission.start(call.place)
    if waited is None:
        return
    SHED.labels(call.method).inc()
    if call.handler.unary_unary is not None:
        call.guard._observe(call.method, grpc.StatusCode.RESOURCE_EXHAUSTED.name, 0.0)
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admission.queue_wait.refusal(call.method, waited))


def _first(requests: _Requests, context: _Context, method: str):
    """The one request message of a unary-request method."""
    try:
        return next(requests)
    except StopIteration:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {method} takes one request message")


def _displaced(context: _Context, call: _Call) -> None:
    """Ends a call whose place a newcomer took: cancelled with its status (the
    newcomer's thread does the same; the first wins), and the response stream
    ends without a word (an exception would be logged)."""
    _cancel(context, _displaced_message(call))
    raise StopIteration


def _displaced_message(call: _Call) -> str:
    admission = call.guard._admission
    return (f"{call.method}: no request message {SILENT_AFTER_S:.1f} s after the call began while "
            f"{admission.limit} calls were in flight (server.max_concurrent_rpcs): its place went to a new "
            f"call; retry later")


def _cancel(context: _Context, message: str) -> None:
    """Ends the call from another thread with RESOURCE_EXHAUSTED and ``message``:
    gRPC core sends that status before its RST_STREAM (trailers need no flow
    control window). The public ``cancel`` could only say CANCELLED; it is the
    fallback where the call's core object is not reachable."""
    call = getattr(getattr(context._context, "_rpc_event", None), "call", None)
    try:
        call.cancel(cygrpc.StatusCode.resource_exhausted, cap(message))
    except (AttributeError, TypeError):
        context.cancel()


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
