"""tandem/peer.py: a gRPC peer's locality and, over real loopback connections, its socket's owner."""
import os
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
