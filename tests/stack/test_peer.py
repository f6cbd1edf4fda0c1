"""tandem/peer.py: a gRPC peer's locality and, over real loopback connections, its socket's owner."""
import os
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem import peer


@pytest.mark.parametrize("text, local", [
    ("ipv4:127.0.0.1:5000", True), ("ipv4:127.8.9.1:5000", True), ("ipv6:[::1]:5000", True),
    ("ipv6:%5B::1%5D:5000", True), ("ipv6:[::ffff:127.0.0.1]:5000", True), ("unix:/tmp/tandem.sock", True),
    ("ipv4:10.1.2.3:5000", False), ("ipv6:[2001:db8::1]:5000", False), ("garbage", False),
])
def test_only_loopback_and_unix_peers_are_local(text, local):
    assert peer.is_local(text) is local


def test_a_remote_or_unparsable_peer_has_no_uid():
    assert peer.uid("ipv4:10.1.2.3:5000") is None
    assert peer.uid("unix:/tmp/x.sock") is None
    assert peer.uid("garbage") is None


class _Recorder(health.HealthServicer):
    def __init__(self):
        super().__init__()
        self.seen = []

    def Check(self, request, context):
        self.seen.append(peer.uid(context.peer()))
        return super().Check(request, context)


@pytest.fixture(params=["127.0.0.1", "[::1]"])
def server(request):
    recorder = _Recorder()
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(recorder, srv)
    try:
        port = srv.add_insecure_port(f"{request.param}:0")
    except RuntimeError:
        pytest.skip(f"{request.param} cannot be bound here")
    srv.start()
    yield f"{request.param}:{port}", recorder
    srv.stop(0)


def _check(address):
    with grpc.insecure_channel(address) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError:
            pass  # NOT_FOUND for the empty service name of a fresh servicer is fine: the call arrived


def test_a_loopback_peer_is_this_process_user(server):
    address, recorder = server
    _check(address)
    assert recorder.seen == [os.getuid()]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_a_loopback_peer_of_another_user_is_that_user(server):
    address, recorder = server
    code = ("import os, grpc\nfrom grpc_health.v1 import health_pb2, health_pb2_grpc\n"
            "os.setgid(65534); os.setuid(65534)\n"
            f"ch = grpc.insecure_channel({address!r})\n"
            "try: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)\n"
            "except grpc.RpcError: pass\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert recorder.seen == [65534]


class _PortRecorder(health.HealthServicer):
    """Looks the caller up both ways: the kernel's exact lookup and the /proc tables."""

    def __init__(self):
        super().__init__()
        self.port, self.seen = 0, []

    def Check(self, request, context):
        p = peer.parse(context.peer())
        family = socket.AF_INET if p.scheme == "ipv4" else socket.AF_INET6
        exact = [peer._diag_uid(family, p.host, p.port, host, self.port) for host in peer._server_hosts(p)]
        self.seen.append((next((u for u in exact if u is not None), None), peer.uid(context.peer())))
        return super().Check(request, context)


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_the_kernel_s_exact_lookup_agrees_with_the_proc_tables(host):
    recorder = _PortRecorder()
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(recorder, srv)
    try:
        recorder.port = srv.add_insecure_port(f"{host}:0")
    except RuntimeError:
        pytest.skip(f"{host} cannot be bound here")
    srv.start()
    try:
        _check(f"{host}:{recorder.port}")
    finally:
        srv.stop(0)
    assert recorder.seen == [(os.getuid(), os.getuid())]


_TCP_TIME_WAIT = 6  # include/net/tcp_states.h


def _closed_by_client(while_open=lambda text, port: None) -> tuple[str, int]:
    """A loopback connection the client closed first (its socket left in
    TIME_WAIT): its gRPC-style peer string and the server's port;
    ``while_open(text, port)`` is called before the close."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        text = f"ipv4:127.0.0.1:{client.getsockname()[1]}"
        accepted, _ = listener.accept()
        while_open(text, port)
        client.close()
        assert accepted.recv(1) == b""  # the client's FIN has come
        accepted.close()
    state = peer._diag(socket.AF_INET, "127.0.0.1", int(text.rsplit(":", 1)[1]), "127.0.0.1", port)
    assert state == peer.GONE or state[0] == _TCP_TIME_WAIT
    return text, port


def test_a_closed_connection_has_no_uid():
    # The kernel reports a TIME_WAIT socket as uid 0 whoever held it: taken for the
    # owner, a client closing its socket under its own call would be served as root.
    text, port = _closed_by_client()
    assert peer.uid(text, port) is None


def test_a_connection_is_open_until_its_client_closes_it():
    def is_open(text, port):
        assert peer.connection_open(text, port) is True

    text, port = _closed_by_client(is_open)
    assert peer.connection_open(text, port) is False
    assert peer.connection_open(text, 0) is None  # no port: cannot be told
    assert peer.connection_open("ipv4:10.1.2.3:5000", port) is None  # a remote peer
    assert peer.connection_open("unix:/tmp/x.sock", port) is None
