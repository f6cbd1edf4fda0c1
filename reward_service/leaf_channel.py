"""The leaf channel's server: per-wave model runs for search services on this
host, their tensors in shared-memory regions, their doorbell a Unix-domain
``SOCK_SEQPACKET`` socket (the protocol and the client: tandem/leaf_channel.py).

The regions are the shared-memory table's (reward_service/shared_memory.py).
A CUDA region is registered by the client with ``RegisterSharedMemory`` like
any bulk client's; host memory comes as sealed memfds whose descriptors the
attach message carries (SCM_RIGHTS), registered here for the connection's
client (``RegionTable.register_fd``: sealed against shrinking, so mapped
without risk; with no name in /dev/shm, no other client can register them).
All are checked the same way (owner, bounds, device), then attached to the
connection, which renews their lease while it lives and unregisters them
when it closes.
A wave runs in the model's critical lane (reward_service/batcher.py), merged
with any other critical requests there, under the wave's own deadline. A wave
in a CUDA region reaches the model device to device (the bound runner copies
it into its IO-bound buffers on the critical lane's stream: no host copy);
outputs are written into the output region (system shared memory).

Invariants:

* One thread per connection, long-lived: it reads a message, answers it, and
  reads the next, so a connection has at most one wave running and answers in
  order. A wave whose run wrote its outputs into a CUDA output region device
  to device (a bound runner, the batch all device waves) is answered by the
  critical lane's worker the moment they are in place -- on a channel
  ordered by CUDA events, the moment their copies are queued, ahead of the
  ``done`` event the client waits for (tandem/cuda_events.py)
  (``Request.on_written``: a thread hop sooner), with a non-blocking
  send on a duplicate of the socket, while the connection's thread still
  waits on the run, holding the regions' lease; that thread then sends
  nothing, and reads the next message only after. Any other wave, or one
  whose non-blocking send was refused (a client not reading its replies),
  is answered by the connection's thread. ``_lock`` guards ``_connections``
  and ``_attached`` only.
* A wave's request figures (``requested`` and ``succeeded``/``failed`` of
  reward_service/model_metrics.py) are recorded on its connection's thread
  just after its answer is sent -- off the client's wait -- and before the
  thread reads the next message: a reader may see them a moment after the
  reply, never lose them. Its run's figures are the batcher's
  (``Batcher(executed=)``), recorded on the worker before any waiter of the
  run wakes (in a run of worker-answered waves only, just after their
  replies).
* An ordered channel's ready word (tandem/ready_word.py: this wave's
  sequence number, in the client's ``ready_region``) or ``ready`` event is
  waited for by the critical lane's worker (session.READY_WAIT_S at most,
  counted for the word from the moment the poll sees the channel's previous
  outputs done, whatever its batch's limit);
  a wave whose inputs come later, or that a later wave superseded, is
  answered DEADLINE_EXCEEDED and gets nothing written into its regions.
  While it waits the worker serves no other request: a wave whose
  selection is still running holds the lane until it ends, and another
  search's wave that comes meanwhile runs in the next batch. Its opened
  event is released when the connection ends.
* A region is attached to at most one connection (``_attached``): two
  connections writing one output region would answer each other's waves.
  The ready word's region is a third, read by this host alone (system).
* Every message gets an answer (``R``/``A`` or ``E`` with a gRPC status); a
  malformed message closes nothing but the answer; the connection closes only
  when its client closes it, the server stops, the socket fails, or it has not
  attached within ``attach_timeout_ms`` of being accepted (answered
  DEADLINE_EXCEEDED first): it held a slot of ``max_connections`` and nothing else.
* Only this server's own user may attach: a peer of another uid
  (``SO_PEERCRED``; root passes the socket file's mode) is answered
  PERMISSION_DENIED and closed. Its regions are owned by (that uid, the
  attach's ``client_id``). Descriptors are taken from attach messages only
  (any other message is read without room for them: the kernel closes them),
  and each one is closed once registered or refused.
* The socket file is made with mode 0600 in ``reward.leaf_channel.socket_dir``
  and named after this process, so a stale file from a dead server is never
  reused; it is removed when the server closes, and a dead server's file by
  the next server started in that directory (:func:`remove_stale_sockets`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
from tandem.v1 import reward_pb2

from reward_service.batcher import LANES
from reward_service.model_metrics import ModelMetrics
from reward_service.refusal import Refusal, run
from reward_service.session import READY_WAIT_S, ModelSession
from reward_service.shared_memory import RegionTable, SharedMemoryError
from tandem import tensors, timeline
from tandem.config import LeafChannelConfig
from tandem.cuda_events import IPC_EVENT_HANDLE_BYTES, ExportedEvent, LocalEvent, OpenedEvent
from tandem.deadline import Deadline
from tandem.errors import quote
from tandem.leaf_channel import (ATTACH, MAX_MESSAGE_BYTES, REPLY, REPLY_FORMAT, WAVE, WAVE_FORMAT, OutputSlot,
                                 output_layout, pack_error)
from tandem.ready_word import WORD_BYTES, WordWait

log = logging.getLogger(__name__)

CRITICAL = reward_pb2.REQUEST_CLASS_CRITICAL
CRITICAL_LANE = LANES[CRITICAL]  # a wave's lane in the per-model metrics


class BadRequest(Exception):
    """A message answered with ``code`` and ``message``; the connection goes on."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _Attachment:
    """What one connection's attach settled: the model, its regions and their layout."""

    client_id: str
    uid: int  # the connection's peer's: with client_id, the regions' owner
    session: ModelSession
    max_rows: int
    input_region: str
    input_row: tuple[int, ...]
    input_dtype: np.dtype
    output_region: str
    outputs: tuple[OutputSlot, ...]
    input_bytes: int  # what ``max_rows`` rows need of each region
    output_bytes: int
    input_name: str  # the model's one input
    output_names: tuple[str, ...]  # the outputs' names, in slot order
    events: WaveEvents | None = None  # an ordered channel's CUDA events (tandem/cuda_events.py)
    ready_region: str | None = None  # the client's ready word (tandem/ready_word.py), a system region

    @property
    def regions(self) -> list[str]:
        """The regions pinned to the connection."""
        return [self.input_region, self.output_region, *([self.ready_region] if self.ready_region else [])]


@dataclass(frozen=True)
class WaveEvents:
    """A wave's events (Request.events): ``ready``, the client's, and ``done``,
    the run's. An ordered channel's: the client's opened here, or per wave
    its ready word's poll (tandem/ready_word.py; None in the attachment's),
    and this server's exported; an in-process port's: two of that process
    (LocalEvent)."""

    ready: OpenedEvent | LocalEvent | WordWait | None
    done: ExportedEvent | LocalEvent


_FLOAT32 = np.dtype(np.float32)
_WORD = np.dtype(np.uint64)
WORD_WAIT_CAP_S = 1.0  # the longest a wave without a deadline waits for its ready word (its previous outputs'
# run included: the client writes the inputs only after those outputs are done)
REGION_KINDS = ("memfd", "cuda")  # either wave region may be either kind; the ready word's is a memfd
ROLES = ("input_region", "output_region", "ready_region")  # the attach's regions, any of which may come as a memfd
MAX_FDS = len(ROLES)  # descriptors one attach may carry
SOCKET_PREFIX = "tandem-leaf-"  # then the server's pid, "-", an id, ".sock"


def _close_ready(events: WaveEvents | None) -> None:
    """Releases an attachment's opened ``ready`` event, where it has one."""
    if events is not None and events.ready is not None:
        events.ready.close()


def remove_stale_sockets(directory: str) -> list[str]:
    """Removes the socket files in ``directory`` of leaf-channel servers whose
    process is gone (a server killed before its close), and returns their
    names. A file whose process lives, or that is not ours to judge (not this
    user's, a name of another form), is left alone."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(SOCKET_PREFIX) and name.endswith(".sock")):
            continue
        pid = name[len(SOCKET_PREFIX):].split("-", 1)[0]
        path = os.path.join(directory, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)  # raises ProcessLookupError once the process is gone
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed.append(name)
            except OSError:
                pass
        except OSError:  # PermissionError: another user's process lives under that pid
            continue
    return removed


def _peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of ``conn`` (SO_PEERCRED: as it was when it connected)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _receive(conn: socket.socket, with_fds: bool) -> tuple[bytes, list[int]]:
    """The next message and, ``with_fds``, the descriptors it carried (at most
    MAX_FDS, close-on-exec; without room for them the kernel closes any sent).

    Raises:
        BadRequest: INVALID_ARGUMENT: more than MAX_FDS descriptors (all closed).
        OSError: TimeoutError, or the socket failed.
    """
    if not with_fds:
        return conn.recv(MAX_MESSAGE_BYTES), []
    message, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE_BYTES, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    if flags & socket.MSG_CTRUNC:  # those past MAX_FDS were closed by the kernel
        _close_fds(fds)
        return message, [-1]  # refused by the attach as a count that does not match
    return message, fds


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)
    fds.clear()


def _memfd_roles(req: dict, fds: list[int]) -> list[str]:
    """The attach's ``memfds``: the roles (of ROLES, named in the attach) whose
    regions come as the message's descriptors, in their order.

    Raises:
        BadRequest: INVALID_ARGUMENT: a malformed list, or one that does not
            match the descriptors the message carried.
    """
    roles = req.get("memfds", [])
    if (not isinstance(roles, list) or len(set(map(str, roles))) != len(roles)
            or any(r not in ROLES or req.get(r) is None for r in roles)):
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"attach: memfds: {quote(str(roles))}, must list "
                         f"distinct regions of {list(ROLES)} that the attach names")
    if len(roles) != len(fds) or -1 in fds:
        carried = f"more than {MAX_FDS}" if -1 in fds else str(len(fds))
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"attach: memfds names {len(roles)} regions, the message "
                         f"carried {carried} descriptors (SCM_RIGHTS)")
    return roles


def _reply(seq: int, done) -> bytes:
    """The ``R`` message of a wave whose run ended (a batcher request, done)."""
    return REPLY + REPLY_FORMAT.pack(seq, done.bucket, done.queue_ms, done.compute_ms)


def _try_send(sock: socket.socket, message: bytes) -> bool:
    """Sends ``message`` on the non-blocking ``sock`` if it goes at once
    (a SEQPACKET message goes whole or not at all); False when refused."""
    try:
        sock.send(message)
        timeline.mark("channel.replied")
        return True
    except BlockingIOError:
        return False  # the client's buffer is full: its connection's thread waits instead
    except OSError:
        return True  # the client is gone: nobody to answer (its thread ends at the next recv)


def model_signature(session: ModelSession):
    """The model's one input spec and row, and its outputs with their rows: what
    a wave of leaves needs of a model (the leaf channel's check, and the
    in-process waves', reward_service/in_process.py).

    Raises:
        BadRequest: FAILED_PRECONDITION: not one input, an output not float32, or a dynamic row.
    """
    if len(session.inputs) != 1:
        raise BadRequest(grpc.StatusCode.FAILED_PRECONDITION,
                         f"model {session.name!r}: {len(session.inputs)} inputs; the leaf channel carries one")
    spec = session.inputs[0]
    rows = [(spec, tuple(spec.shape[1:]))] + [(o, tuple(o.shape[1:])) for o in session.outputs]
    for s, row in rows:
        if any(d < 0 for d in row):
            raise BadRequest(grpc.StatusCode.FAILED_PRECONDITION,
                             f"model {session.name!r}: {s.name} has a dynamic row shape {list(row)}")
    for o in session.outputs:
        if o.dtype != reward_pb2.DATA_TYPE_FLOAT32:
            raise BadRequest(grpc.StatusCode.FAILED_PRECONDITION,
                             f"model {session.name!r}: output {o.name} is {tensors.dtype_name(o.dtype)}, not float32")
    return spec, rows[0][1], rows[1:]


def wave_output(done, name: str, row: tuple[int, ...], rows: int, model: str) -> np.ndarray:
    """Output ``name`` of a wave's done run (a batcher request), float32
    ``[rows, *row]``, checked against the model's signature.

    Raises:
        Refusal: INTERNAL: an output of another shape.
    """
    out = np.asarray(done.outputs[name], np.float32)
    if out.shape[1:] != row or len(out) < rows:
        raise Refusal(grpc.StatusCode.INTERNAL, "run_failed",
                      f"model {model!r}: output {name} is {list(out.shape)}, a wave expects {[rows, *row]}")
    return out[:rows]


class LeafChannelServer:
    """Listens on its own socket file and serves every connection on a thread of its own.

    Args:
        cfg: ``reward.leaf_channel``.
        sessions, batchers, regions, metrics: the reward servicer's.
        lease_ttl_s: the regions' lease (``reward.shared_memory.lease_ttl_ms``
            in s): an idle connection renews its regions every quarter of it.

    Raises:
        OSError: the socket cannot be made.
    """

    def __init__(self, cfg: LeafChannelConfig, sessions: dict[str, ModelSession], batchers: dict,
                 regions: RegionTable, metrics: ModelMetrics, lease_ttl_s: float):
        self.cfg, self.sessions, self.batchers, self.regions, self.metrics = cfg, sessions, batchers, regions, metrics
        self._renew_s = min(max(lease_ttl_s / 4, 0.01), 10.0)
        self._attach_s = cfg.attach_timeout_ms / 1e3  # a connection not attached by then is closed: it only holds a slot
        directory = cfg.socket_dir or tempfile.gettempdir()
        remove_stale_sockets(directory)
        self.path = os.path.join(directory, f"{SOCKET_PREFIX}{os.getpid()}-{id(self):x}.sock")
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}  # guarded by _lock
        self._attached: set[str] = set()  # region names; guarded by _lock
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            old = os.umask(0o177)  # the file is made 0600: only this user may connect
            try:
                self._listener.bind(self.path)
            finally:
                os.umask(old)
            self._listener.listen(cfg.max_connections)
        except BaseException:
            self._listener.close()
            if os.path.exists(self.path):  # bound, then listen failed: no file left behind
                os.unlink(self.path)
            raise
        self._accepter = threading.Thread(target=self._accept, name="leaf-channel-accept", daemon=True)
        self._accepter.start()

    # -- connections ------------------------------------------------------------------

    def _accept(self) -> None:
        failing = False
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return  # the listener closed: the server is stopping
                if not failing:  # e.g. out of file descriptors (EMFILE): accepting resumes once some are freed
                    log.warning("leaf channel: accepting a connection failed (%s); retrying", exc)
                failing = True
                time.sleep(0.1)
                continue
            failing = False
            with self._lock:
                full = len(self._connections) >= self.cfg.max_connections
                if not full and not self._closed:
                    thread = threading.Thread(target=self._serve, args=(conn,), name="leaf-channel", daemon=True)
                    self._connections[conn] = thread
                    thread.start()  # under the lock: close() joins every thread it finds, never an unstarted one
                    continue
            if full:  # answered on a thread of its own, so accepting goes on
                message = (f"{self.cfg.max_connections} leaf channels are attached, "
                           "reward.leaf_channel.max_connections")
                threading.Thread(target=self._refuse, args=(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, message),
                                 name="leaf-channel-refuse", daemon=True).start()
            else:  # closed
                conn.close()

    def _refuse(self, conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
        """Answers a connection it will not serve (beyond ``max_connections``, or
        of another user) with ``code`` and closes it. Its attach is read first
        (any descriptors in it closed by the kernel: no room is given): closing
        a socket with a message unread would reset it, and the client would see
        a broken connection instead of why."""
        try:
            conn.settimeout(1.0)
            conn.recv(MAX_MESSAGE_BYTES)
        except OSError:
            pass
        self._send(conn, pack_error(0, code, message))
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        attachment = None
        attach_by = time.monotonic() + self._attach_s  # from the connection's start, whatever it sends meanwhile
        # The same socket for the critical lane's worker to answer on without blocking
        # (a socket's timeout is per object; a send on a timeout socket waits up to it).
        # Without a descriptor for it (EMFILE) this thread answers every wave.
        try:
            nonblocking = conn.dup()
            nonblocking.setblocking(False)
        except OSError:
            nonblocking = None
        try:
            uid = _peer_uid(conn)
            if uid != os.getuid():
                return self._refuse(conn, grpc.StatusCode.PERMISSION_DENIED, f"peer uid {uid}: the leaf channel "
                                    f"serves its server's own user (uid {os.getuid()}) only")
            while True:
                if attachment is None:
                    conn.settimeout(max(attach_by - time.monotonic(), 1e-3))
                try:
                    message, fds = _receive(conn, with_fds=attachment is None)
                    timeline.mark("channel.received")
                except TimeoutError:
                    if attachment is None:
                        self._send(conn, pack_error(0, grpc.StatusCode.DEADLINE_EXCEEDED, "no attach within "
                                                    f"{self.cfg.attach_timeout_ms:g} ms of connecting "
                                                    "(reward.leaf_channel.attach_timeout_ms); closed"))
                        return
                    self._renew(attachment)  # idle: the connection is the regions' heartbeat
                    continue
                if not message:
                    _close_fds(fds)
                    return  # the client closed the connection
                kind = message[:1]
                if kind == ATTACH and attachment is None:
                    attachment = self._attach_message(conn, message, fds, uid)
                    if attachment is not None:
                        conn.settimeout(self._renew_s)
                elif kind == WAVE and attachment is not None:
                    self._wave_message(conn, nonblocking, attachment, message)
                else:
                    _close_fds(fds)
                    what = "an attach first" if attachment is None else "a wave"
                    self._send(conn, pack_error(0, grpc.StatusCode.FAILED_PRECONDITION,
                                                f"message kind {kind!r}: expected {what}"))
        except OSError:
            pass  # the connection broke, or the server closed it to stop
        finally:
            if attachment is not None:
                self._detach(attachment)
            with self._lock:
                self._connections.pop(conn, None)
            if nonblocking is not None:
                nonblocking.close()
            conn.close()

    @staticmethod
    def _send(conn: socket.socket, message: bytes) -> None:
        try:
            conn.send(message)
        except OSError:
            pass  # the client is gone; its thread ends at the next recv

    # -- attach -----------------------------------------------------------------------

    def _attach_message(self, conn: socket.socket, message: bytes, fds: list[int], uid: int) -> _Attachment | None:
        try:
            attachment = self._attach(message[1:], fds, uid)
        except (BadRequest, SharedMemoryError) as exc:
            self._send(conn, pack_error(0, exc.code, str(exc)))
            return None
        except Exception as exc:  # a bug: answered, and the connection goes on (an uncaught one would end it)
            log.exception("leaf channel: attach failed")
            self._send(conn, pack_error(0, grpc.StatusCode.INTERNAL, f"attach failed: {type(exc).__name__}: {exc}"))
            return None
        finally:
            _close_fds(fds)  # those the attach did not take (registering one closes it)
        layout = {"outputs": [{"name": s.name, "row": list(s.row), "offset": s.offset} for s in attachment.outputs],
                  "execution_provider": attachment.session.execution_provider}
        if attachment.events is not None:
            layout["done_event"] = attachment.events.done.handle.hex()
        self._send(conn, ATTACH + json.dumps(layout).encode())
        return attachment

    def _attach(self, body: bytes, fds: list[int], uid: int) -> _Attachment:
        """Checks an attach request, registers the regions that came as
        descriptors ``fds`` (taken from the list as each is registered, for the
        attach's client of ``uid``) and pins all its regions to the connection.
        A failed attach leaves none of them registered.

        Raises:
            BadRequest: INVALID_ARGUMENT (malformed; max_rows out of range -- over
                reward.leaf_channel.max_rows or the model's max_batch_size; a region
                too small or of the wrong kind; one region named as both),
                NOT_FOUND (no such model), FAILED_PRECONDITION (a model whose
                signature does not fit the channel), ALREADY_EXISTS (a region
                attached elsewhere); INVALID_ARGUMENT for a malformed
                ``ready_event`` (one the driver cannot open, stale or foreign,
                leaves the channel synchronised: no ``done_event`` in the layout);
                INVALID_ARGUMENT for ``memfds`` that do not
                match the descriptors, or a system region (registered by key:
                host memory comes as a memfd).
            SharedMemoryError: a region that is not registered or not the
                client's; INVALID_ARGUMENT for a descriptor that is not a memfd
                sealed against shrinking (reward_service/shared_memory.py).
        """
        try:
            req = json.loads(body)
            client_id, model, max_rows = str(req["client_id"]), str(req["model"]), req["max_rows"]
            input_region, output_region = str(req["input_region"]), str(req["output_region"])
            ready_region = req.get("ready_region")
            ready_region = None if ready_region is None else str(ready_region)
            roles = _memfd_roles(req, fds)
        except (ValueError, KeyError, TypeError, RecursionError, AttributeError) as exc:  # RecursionError: nested too deep
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"attach: malformed ({type(exc).__name__}: {exc})") from None
        if input_region == output_region:  # one buffer for both would have outputs overwrite the next wave's inputs
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"input_region and output_region: both {quote(input_region)}; "
                             "the channel needs two regions")
        if ready_region in (input_region, output_region):  # the word would be overwritten by a wave's tensors
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"ready_region: {quote(ready_region)} is also a wave's "
                             "region; the ready word needs one of its own")
        session = self.sessions.get(model)
        if session is None:
            raise BadRequest(grpc.StatusCode.NOT_FOUND, f"model: no model named {quote(model)} (models: {sorted(self.sessions)})")
        # A wave is refused above the model's max_batch_size, as an Evaluate of as many rows is.
        limit = min(self.cfg.max_rows, session.max_batch_size)
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or not 1 <= max_rows <= limit:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                             f"max_rows: {quote(str(max_rows))}, must be 1..{limit} (reward.leaf_channel.max_rows "
                       f"{self.cfg.max_rows}, model {quote(model)}'s max_batch_size {session.max_batch_size})")
        spec, input_row, outputs = model_signature(session)
        dtype = tensors.numpy_dtype(spec.dtype)
        slots, out_bytes = output_layout([(o.name, row) for o, row in outputs], max_rows)
        in_bytes = max_rows * math.prod(input_row) * dtype.itemsize
        registered = []  # the memfds' regions: unregistered if a later check fails
        events = None
        try:
            named = {"input_region": input_region, "output_region": output_region, "ready_region": ready_region}
            for role in roles:
                self.regions.register_fd(client_id, named[role], fds.pop(0), uid)
                registered.append(named[role])
            # last of the checks: closed if a later one fails
            events = self._open_events(req.get("ready_event"), ready_region is not None, session)
            attachment = _Attachment(client_id, uid, session, max_rows, input_region, input_row, dtype, output_region,
                                     tuple(slots), in_bytes, out_bytes, spec.name, tuple(s.name for s in slots),
                                     events, ready_region)
            with self.regions.acquire(client_id, attachment.regions, uid=uid) as lease:
                out_kind = self._check_regions(lease, attachment)
            with self._lock:
                taken = set(attachment.regions) & self._attached
                if taken:
                    raise BadRequest(grpc.StatusCode.ALREADY_EXISTS,
                                     f"region {quote(min(taken))}: attached to another leaf channel")
                self._attached |= set(attachment.regions)
        except BaseException:
            _close_ready(events)
            self._unregister(client_id, uid, registered)
            raise
        if events is not None and out_kind != "cuda":  # outputs the host writes: the reply alone orders them
            _close_ready(events)
            attachment = dataclasses.replace(attachment, events=None)
        return attachment

    @staticmethod
    def _open_events(ready_hex, ready_word: bool, session: ModelSession) -> WaveEvents | None:
        """The channel's events where the client offers a ready word
        (``ready_word``; its polls are made per wave) or its ``ready_event``
        (hex of a CUDA IPC event handle) and the model's critical lane can
        order by events; else None (the channel synchronises as before).

        Raises:
            BadRequest: INVALID_ARGUMENT: not a string of hex, or not a handle's size
                (a handle the driver cannot open is not ordered by: None).
        """
        if ready_word:
            return WaveEvents(None, ExportedEvent()) if session.orders_by_events else None
        if ready_hex is None:
            return None
        try:
            handle = bytes.fromhex(ready_hex)
        except (ValueError, TypeError) as exc:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"attach: ready_event: not hex ({exc})") from None
        if len(handle) != IPC_EVENT_HANDLE_BYTES:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"attach: ready_event: {len(handle)} bytes; "
                             f"a cudaIpcEventHandle_t has {IPC_EVENT_HANDLE_BYTES}")
        if not session.orders_by_events:  # a CPU run, or no bound runner: synchronised
            return None
        try:
            ready = OpenedEvent(handle)
        except ValueError as exc:  # e.g. a driver or MPS set-up without IPC events: the channel synchronises
            log.warning("leaf channel: the client's ready_event %s; its waves are synchronised instead", exc)
            return None
        try:
            return WaveEvents(ready, ExportedEvent())
        except BaseException:
            ready.close()
            raise

    @staticmethod
    def _check_regions(lease, a: _Attachment) -> str:
        """Checks that the held regions are of a kind and size the attachment needs:
        at the attach, and again at every wave, since a client may unregister a
        region and register another under its name. Returns the output region's kind.

        Raises:
            BadRequest: INVALID_ARGUMENT (a region too small or of the wrong kind).
        """
        sizes = lease.describe()
        rows = f"{a.max_rows} rows of model {a.session.name!r}"
        needs = [(a.input_region, a.input_bytes, REGION_KINDS, rows), (a.output_region, a.output_bytes, REGION_KINDS, rows)]
        if a.ready_region:  # polled by this host in place: a mapped memfd (from offset 0: the uint64 aligned)
            needs.append((a.ready_region, WORD_BYTES, ("memfd",), "the ready word"))
        for name, need, kinds, what in needs:
            kind, size = sizes[name]
            if kind not in kinds:
                raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"region {quote(name)}: a {kind} region; "
                                 f"this one must be {' or '.join(kinds)} (host memory comes as a sealed memfd "
                                 "with the attach)")
            if size < need:
                raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"region {quote(name)}: {size} bytes, but {what} "
                                 f"need {need}")
        return sizes[a.output_region][0]

    def _renew(self, a: _Attachment) -> None:
        try:
            for name in a.regions:
                self.regions.status(a.client_id, name, uid=a.uid)
        except SharedMemoryError as exc:
            log.warning("leaf channel of client %r: renewing its regions: %s", a.client_id, exc)

    def _detach(self, a: _Attachment) -> None:
        try:
            _close_ready(a.events)
        except Exception as exc:  # noqa: BLE001 - the slot and the regions are freed whatever the driver says
            log.warning("leaf channel of client %r: releasing its ready_event: %s", a.client_id, exc)
        with self._lock:
            self._attached -= set(a.regions)
        self._unregister(a.client_id, a.uid, a.regions)

    def _unregister(self, client_id: str, uid: int, names: list[str]) -> None:
        for name in names:
            try:
                self.regions.unregister(client_id, name, uid=uid)
            except SharedMemoryError:
                pass  # already gone: unregistered by its client, or reaped

    # -- waves ------------------------------------------------------------------------

    def _wave_message(self, conn: socket.socket, nonblocking: socket.socket | None, a: _Attachment,
                      message: bytes) -> None:
        start = time.perf_counter()
        seq, rows, done, reason = 0, 0, None, None
        try:
            if len(message) != 1 + WAVE_FORMAT.size:
                raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"wave: {len(message)} bytes, expected {1 + WAVE_FORMAT.size}")
            seq, rows, timeout_us = WAVE_FORMAT.unpack_from(message, 1)
            if not 1 <= rows <= a.max_rows:
                raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"wave: rows {rows} out of range 1..{a.max_rows} "
                                 "(the attached regions' size)")
            deadline = Deadline.after_s(timeout_us / 1e6) if timeout_us > 0 else None
            # The worker's send never blocks (a client not reading its replies must not hold
            # the lane): refused, this thread sends instead.
            answer = None if nonblocking is None else (lambda req, seq=seq: _try_send(nonblocking, _reply(seq, req)))
            done = self._run_wave(a, seq, rows, deadline, answer)
        except BadRequest as exc:
            reason, reply = "invalid_input", pack_error(seq, exc.code, str(exc))
        except SharedMemoryError as exc:
            reason, reply = "shared_memory", pack_error(seq, exc.code, str(exc))
        except Refusal as exc:
            reason, reply = exc.reason, pack_error(seq, exc.code, exc.message)
        except Exception as exc:  # a bug: answered, and the connection goes on (an uncaught one would end it)
            log.exception("leaf channel: wave %d of model %r failed", seq, a.session.name)
            reason = "run_failed"
            reply = pack_error(seq, grpc.StatusCode.INTERNAL, f"wave failed: {type(exc).__name__}: {exc}")
        else:
            reply = None if done.answered else _reply(seq, done)
        elapsed_s = time.perf_counter() - start
        if reply is not None:
            self._send(conn, reply)
        # Recorded once the client has its answer: the client is another process, so this
        # Python work is off its wait. This connection's next wave is read only after.
        name = a.session.name
        self.metrics.requested(name, CRITICAL_LANE)
        if reason is None:
            self.metrics.succeeded(name, CRITICAL_LANE, rows, elapsed_s, done.queue_ms / 1e3)
        else:
            self.metrics.failed(name, CRITICAL_LANE, reason, elapsed_s)

    def _run_wave(self, a: _Attachment, seq: int, rows: int, deadline: Deadline | None, answer):
        """Runs rows [0, rows) of the input region and writes the outputs.
        With a CUDA output region the run may write them there itself (a
        bound runner fed device waves only), and the critical lane's worker
        then sends the reply (``answer(request)``, as
        :attr:`reward_service.batcher.Request.on_written`): the returned
        request's ``answered`` is set and nothing is left to send.

        Raises:
            Refusal: as reward_service.refusal.run; INTERNAL for an output
                whose shape is not the one attached.
            SharedMemoryError: a region unregistered meanwhile.
            BadRequest: INVALID_ARGUMENT: a region registered again under its name,
                too small or of the wrong kind.
        """
        with self.regions.acquire(a.client_id, a.regions, uid=a.uid) as lease:
            out_kind = self._check_regions(lease, a)
            timeline.mark("channel.leased")
            # Views of the wave's rows: a CUDA region keeps the ones it made (shared_memory.py).
            feed = lease.array(a.input_region, 0, a.input_dtype, (rows, *a.input_row))
            targets = None
            if out_kind == "cuda":  # the bound runner writes the outputs there, device to device
                targets = {s.name: lease.array(a.output_region, s.offset, _FLOAT32, (rows, *s.row))
                           for s in a.outputs}
            events = a.events
            if events is not None and a.ready_region:  # this wave's poll of the ready word
                word = lease.array(a.ready_region, 0, _WORD, (1,))
                hard_limit = (Deadline.after_s(WORD_WAIT_CAP_S) if deadline is None else deadline).at
                events = WaveEvents(WordWait(word, seq, events.done, READY_WAIT_S, hard_limit), events.done)
            timeline.mark("channel.submitted")
            done = run(self.batchers[a.session.name], a.session.name, {a.input_name: feed}, rows,
                       CRITICAL, deadline, a.output_names, targets, answer, events)
            if done.inputs_late:  # run without them: its outputs are not this wave's
                raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded",
                              f"wave: its inputs were not written within {READY_WAIT_S * 1e3:g} ms of its run "
                              "(the client's ready word or ready_event), or the client gave the wave up")
            if done.targets_written:  # written by the run, while the lease held the region
                return done
            lease.check_live()  # a region unregistered meanwhile gets nothing written
            for slot in a.outputs:
                lease.write(a.output_region, slot.offset, wave_output(done, slot.name, slot.row, rows, a.session.name))
            return done

    def close(self) -> None:
        """Stops accepting, closes every connection (their regions are
        unregistered as their threads end) and removes the socket file."""
        with self._lock:
            self._closed = True
            connections = dict(self._connections)
        try:  # wakes the accepting thread (closing alone leaves accept() blocked on Linux)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in connections:
            try:  # wakes its thread's recv; the client sees the end only once the thread has detached
                conn.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        for thread in connections.values():
            thread.join(5.0)
        self._accepter.join(5.0)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
