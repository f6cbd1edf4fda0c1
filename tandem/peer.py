"""Who a gRPC peer is: its address, whether it is on this host, and the user
that owns its socket.

gRPC names a peer by its transport address only ("ipv4:127.0.0.1:5123",
"ipv6:%5B::1%5D:5123", "unix:/path"). Where the peer is on this host, the
kernel knows which user owns the other end: for TCP, the socket whose local
address is the peer's address, listed with its owner's uid in
``/proc/net/tcp`` and ``/proc/net/tcp6`` (proc(5)); this is how identd-style
tools answer the question on Linux. The servers use that uid to act with the
caller's authority (a shared-memory object must be the caller's own) and to
count a caller's resources by user rather than by a name it chooses.
"""
from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass
from urllib.parse import unquote

_ESTABLISHED = "01"  # /proc/net/tcp "st" column


@dataclass(frozen=True)
class Peer:
    """A parsed gRPC peer: ``scheme`` "ipv4", "ipv6" or "unix"; ``host`` the
    address without brackets ("" for unix); ``port`` (0 for unix)."""

    scheme: str
    host: str
    port: int

    @property
    def local(self) -> bool:
        """True for a loopback address (IPv4, IPv6, or IPv4-mapped) or a Unix socket."""
        if self.scheme.startswith("unix"):
            return True
        try:
            address = ipaddress.ip_address(self.host)
        except ValueError:
            return False
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        return address.is_loopback or bool(mapped and mapped.is_loopback)


def parse(peer: str) -> Peer:
    """``context.peer()`` as a :class:`Peer`; an unknown form gives scheme
    "unknown" (never local)."""
    scheme, _, rest = unquote(peer).partition(":")  # gRPC writes "ipv6:%5B::1%5D:5123"
    if scheme in ("ipv4", "ipv6"):
        host, _, port = rest.rpartition(":")
        return Peer(scheme, host.strip("[]"), int(port) if port.isdigit() else 0)
    if scheme.startswith("unix"):
        return Peer(scheme, "", 0)
    return Peer("unknown", peer, 0)


def is_local(peer: str) -> bool:
    """Whether the gRPC peer string names a client on this host."""
    return parse(peer).local


def _proc_address(host: str, port: int, family: int) -> str:
    """``host:port`` as /proc/net/tcp{,6} prints a local address (hex, host byte order words)."""
    packed = socket.inet_pton(family, host)
    words = [packed[i:i + 4] for i in range(0, len(packed), 4)]
    return "".join(w[::-1].hex().upper() for w in words) + f":{port:04X}"


def _candidates(p: Peer) -> list[tuple[str, str]]:
    """(table, address) pairs where the peer's own socket may be listed."""
    if p.scheme == "ipv4":
        mapped = "::ffff:" + p.host
        return [("/proc/net/tcp", _proc_address(p.host, p.port, socket.AF_INET)),
                ("/proc/net/tcp6", _proc_address(mapped, p.port, socket.AF_INET6))]
    if p.scheme == "ipv6":
        return [("/proc/net/tcp6", _proc_address(p.host, p.port, socket.AF_INET6))]
    return []


# sock_diag(7): one socket looked up by its four-tuple (inet_diag_req_v2, SOCK_DIAG_BY_FAMILY).
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLMSG_ERROR = 4, 20, 1, 2
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_NLMSG_ERRNO = struct.Struct("=i")  # nlmsgerr.error (a negative errno) after the header
_ENOENT = 2
_REQUEST_HEAD = struct.Struct("=BBBBI")  # inet_diag_req_v2: family, protocol, ext, pad, states; then the sockid
_PORTS = struct.Struct(">HH")  # inet_diag_sockid: sport, dport (network order); then src[16], dst[16], if, cookie[8]
_SOCKID_TAIL = struct.Struct("=16s16sI8s")
_MESSAGE_STATE_AT = 1  # inet_diag_msg.idiag_state, after idiag_family
_MESSAGE_UID = struct.Struct("=I")  # inet_diag_msg.idiag_uid, after family..retrans (4), sockid (48), expires, rqueue, wqueue
_MESSAGE_UID_AT = 4 + _PORTS.size + _SOCKID_TAIL.size + 12
_NO_COOKIE = b"\xff" * 8  # INET_DIAG_NOCOOKIE
_TCP_ESTABLISHED = 1  # include/net/tcp_states.h
GONE = "gone"  # _diag's answer where the kernel has no such socket


def _diag(family: int, src: str, sport: int, dst: str, dport: int) -> tuple[int, int] | str | None:
    """(state, uid) of the TCP socket (src:sport -> dst:dport), asked of the
    kernel by netlink (an exact lookup: microseconds, where /proc/net/tcp
    walks every hash bucket: milliseconds); :data:`GONE` where the kernel has
    no such socket; None where netlink cannot answer."""
    try:
        request = (_REQUEST_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + _PORTS.pack(sport, dport)
                   + _SOCKID_TAIL.pack(socket.inet_pton(family, src), socket.inet_pton(family, dst), 0, _NO_COOKIE))
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(_NLMSG.pack(_NLMSG.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + request)
            reply = nl.recv(4096)
    except (OSError, ValueError):
        return None
    if len(reply) < _NLMSG.size + _NLMSG_ERRNO.size:
        return None
    kind = _NLMSG.unpack_from(reply)[1]
    if kind == _NLMSG_ERROR:
        return GONE if _NLMSG_ERRNO.unpack_from(reply, _NLMSG.size)[0] == -_ENOENT else None
    if kind != _SOCK_DIAG_BY_FAMILY or len(reply) < _NLMSG.size + _MESSAGE_UID_AT + _MESSAGE_UID.size:
        return None
    return reply[_NLMSG.size + _MESSAGE_STATE_AT], _MESSAGE_UID.unpack_from(reply, _NLMSG.size + _MESSAGE_UID_AT)[0]


def _diag_uid(family: int, src: str, sport: int, dst: str, dport: int) -> int | None:
    """The uid of the ESTABLISHED TCP socket (src:sport -> dst:dport) (:func:`_diag`);
    None for any other state: a closing socket has no owner any more (the
    kernel reports a TIME_WAIT socket as uid 0, whoever held it)."""
    found = _diag(family, src, sport, dst, dport)
    if not isinstance(found, tuple) or found[0] != _TCP_ESTABLISHED:
        return None
    return found[1]


def _server_hosts(p: Peer) -> list[str]:
    """Where a local client may have connected to: its own address (a loopback
    client's usual destination) and the family's loopback address."""
    loopback = "127.0.0.1" if p.scheme == "ipv4" else "::1"
    return [p.host] if p.host == loopback else [p.host, loopback]


def uid(peer: str, local_port: int = 0) -> int | None:
    """The uid owning the client socket of a local TCP peer, or None where it
    cannot be told (not local, a Unix socket, the connection gone, no /proc).

    With ``local_port`` (the port the server listens on) the kernel is asked
    for that one connection by netlink (sock_diag(7); tens of µs); without it,
    or where that finds none, /proc/net/tcp{,6} are read (proc(5); ~2 ms per
    table on a host with a large TCP hash, whatever the sockets in use).
    """
    p = parse(peer)
    if not p.local or p.port == 0:
        return None
    if local_port:
        family = socket.AF_INET if p.scheme == "ipv4" else socket.AF_INET6
        for host in _server_hosts(p):
            found = _diag_uid(family, p.host, p.port, host, local_port)
            if found is not None:
                return found
    for table, address in _candidates(p):
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    if len(fields) > 7 and fields[1] == address and fields[3] == _ESTABLISHED:
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


def connection_open(peer: str, local_port: int) -> bool | None:
    """Whether the connection of a local TCP peer (``context.peer()``) to the
    server's port ``local_port`` is still open: True while the client's socket
    is ESTABLISHED, False once the kernel has it closing or closed (the client
    closed it or its process ended), None where that cannot be told (a remote
    or Unix-socket peer, no port, netlink refused). One netlink lookup per
    address the client may have connected to (tens of µs; sock_diag(7)).
    """
    p = parse(peer)
    if not p.local or p.port == 0 or not local_port or p.scheme not in ("ipv4", "ipv6"):
        return None
    mapped = getattr(ipaddress.ip_address(p.host), "ipv4_mapped", None)
    if mapped is not None:  # a dual-stack server's IPv4 client: its own socket is an IPv4 one
        p = Peer("ipv4", str(mapped), p.port)
    family = socket.AF_INET if p.scheme == "ipv4" else socket.AF_INET6
    answers = [_diag(family, p.host, p.port, host, local_port) for host in _server_hosts(p)]
    if any(isinstance(a, tuple) and a[0] == _TCP_ESTABLISHED for a in answers):
        return True
    return None if any(a is None for a in answers) else False
