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


def uid(peer: str) -> int | None:
    """The uid owning the client socket of a local TCP peer, or None where it
    cannot be told (not local, a Unix socket, the connection gone, no /proc).

    Reads /proc/net/tcp and /proc/net/tcp6 (a few KB per hundred sockets):
    call it once per registration, not per request.
    """
    p = parse(peer)
    if not p.local or p.port == 0:
        return None
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
