"""The leaf channel (tandem/leaf_channel.py, reward_service/leaf_channel.py)
against a real reward service on loopback: the same answers as Evaluate, the
regions' life (host memory as sealed memfds passed over the socket), and
every bad input answered with its status while the connection and the
server go on serving."""
from __future__ import annotations

import json
import os
import resource
import socket
import threading
import time
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest
from conftest import loopback_config, wait_for
from prometheus_client import REGISTRY
from tandem.v1 import reward_pb2, reward_pb2_grpc

from reward_service import leaf_channel as leaf_channel_server
from reward_service import server as reward_server
from reward_service.leaf_channel import LeafChannelServer
from search_service.games import connect4 as c4
from tandem import tensors
from tandem.config import LeafChannelConfig
from tandem.leaf_channel import (ATTACH, ERROR, MAX_MESSAGE_BYTES, REPLY, WAVE, WAVE_FORMAT, LeafChannel,
                                 LeafChannelError, unpack_error)
from tandem.server import channel
from tandem.shared_memory_client import SealedMemory
from tandem.deadline import Deadline

MODEL = "connect4_value"


@pytest.fixture(scope="module")
def reward():
    cfg = loopback_config(reward={"leaf_channel": {"max_rows": 512, "max_connections": 4},
                                  "shared_memory": {"lease_ttl_ms": 2000}})
    service = reward_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.reward.address, cfg)
    yield service, reward_pb2_grpc.RewardServiceStub(ch)
    ch.close()
    service.stop()


def boards(*moves: str) -> np.ndarray:
    return c4.observation(c4.stack([c4.parse_moves(m) for m in moves]))


def held(service, client_id: str) -> int:
    """Regions the server holds for ``client_id``."""
    return len(service.servicer.regions.status(client_id, uid=os.getuid()))



def test_the_runtime_names_the_socket_and_the_answers_equal_evaluate(reward):
    service, stub = reward
    meta = stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL))
    assert meta.runtime["leaf_channel"] == service.servicer.leaf_channel.path
    assert meta.runtime["leaf_channel_device"] == "-1"  # the CPU build: a system input region
    obs = boards("", "4", "44", "4453", "1234567")
    lc = LeafChannel(stub, meta.runtime["leaf_channel"], MODEL, 64)
    try:
        got = lc.evaluate(obs, Deadline.after_s(10))
        want = stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", obs)],
                                                        request_class=reward_pb2.REQUEST_CLASS_CRITICAL))
        by_name = {t.name: tensors.from_proto(t) for t in want.outputs}
        assert set(got) == set(by_name) == {"value", "policy_logits"}
        for name in got:
            np.testing.assert_allclose(got[name], by_name[name], rtol=1e-5, atol=1e-6)
        # Waves of other sizes, one after another, each its own rows.
        for n in (1, 3, 64):
            rows = np.repeat(obs, -(-n // len(obs)), axis=0)[:n]
            assert lc.evaluate(rows, Deadline.after_s(10))["value"].shape == (n, 1)
        assert lc.bucket >= 1 and lc.compute_ms > 0
    finally:
        lc.close()


def test_closing_the_connection_unregisters_its_regions(reward):
    service, stub = reward
    lc = LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 16)
    client_id = lc._inputs.client_id
    assert held(service, client_id) == 2
    lc.close()
    assert held(service, client_id) == 0  # close() returns once the server has let go of them


def test_close_after_a_wave_given_up_returns_once_the_server_is_done_with_the_regions(reward):
    """The given-up wave may still be running on the server: close() waits for
    its end and the regions' unregistration before this side frees them."""
    service, stub = reward
    lc = LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 64)
    client_id = lc._inputs.client_id
    with pytest.raises(LeafChannelError) as err:
        lc.evaluate(np.repeat(boards(""), 64, axis=0), Deadline.after_s(1e-6))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    lc.close()
    assert held(service, client_id) == 0
    assert lc.closed


def test_an_idle_connection_keeps_its_regions_past_their_lease(reward):
    service, stub = reward
    lc = LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 16)
    try:
        time.sleep(3.0)  # lease_ttl_ms 2000: the connection renews every 0.5 s
        assert lc.evaluate(boards("4"), Deadline.after_s(10))["value"].shape == (1, 1)
    finally:
        lc.close()


class RawClient:
    """The protocol by hand: its own regions and socket, for the bad inputs."""

    def __init__(self, service, stub, max_rows=8, out_bytes=None, client_id=None, sock=None):
        self.stub = stub
        self.inputs = SealedMemory(max_rows * 84, client_id=client_id)
        self.outputs = SealedMemory(out_bytes or 4096, client_id=self.inputs.client_id)
        if sock is None:  # else a connection made already
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(10)
            sock.connect(service.servicer.leaf_channel.path)
        self.sock = sock
        self.max_rows = max_rows

    def attach(self, ready: SealedMemory | None = None, **overrides) -> bytes:
        """Attaches, passing the memfd of every region the attach names that is
        one of this client's (``ready``: a ready word's), unless ``overrides``
        gives ``memfds`` itself (then ``fds`` are the descriptors sent)."""
        fds = overrides.pop("fds", None)
        body = {"client_id": self.inputs.client_id, "model": MODEL, "max_rows": self.max_rows,
                "input_region": self.inputs.name, "output_region": self.outputs.name, **overrides}
        if ready is not None:
            body.setdefault("ready_region", ready.name)
        if "memfds" not in body:
            mine = [(role, m) for role, m in (("input_region", self.inputs), ("output_region", self.outputs),
                                              ("ready_region", ready)) if m is not None and body.get(role) == m.name]
            body["memfds"], fds = [role for role, _ in mine], [m.fd for _, m in mine]
        return self.ask(ATTACH + json.dumps(body).encode(), fds or [])

    def ask(self, message: bytes, fds=()) -> bytes:
        socket.send_fds(self.sock, [message], list(fds))
        return self.sock.recv(MAX_MESSAGE_BYTES)

    def wave(self, rows: int, seq: int = 1) -> bytes:
        return self.ask(WAVE + WAVE_FORMAT.pack(seq, rows, 5_000_000))

    def close(self):
        self.sock.close()
        self.inputs.close()
        self.outputs.close()


def status(reply: bytes) -> tuple[grpc.StatusCode, str]:
    assert reply[:1] == ERROR, reply[:40]
    _, exc = unpack_error(reply)
    return exc.code, str(exc)


@pytest.mark.parametrize("overrides, code, words", [
    ({"input_region": "no-such-region"}, grpc.StatusCode.NOT_FOUND, "not registered"),
    ({"model": "no_such_model"}, grpc.StatusCode.NOT_FOUND, "no model named"),
    ({"max_rows": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_rows"),
    ({"max_rows": True}, grpc.StatusCode.INVALID_ARGUMENT, "max_rows"),  # JSON true is no row count
    ({"max_rows": 100_000}, grpc.StatusCode.INVALID_ARGUMENT, "reward.leaf_channel.max_rows"),
    # frame_reward's max_batch_size is 256: a wider channel would carry waves Evaluate refuses.
    ({"model": "frame_reward", "max_rows": 300}, grpc.StatusCode.INVALID_ARGUMENT, "max_batch_size 256"),
    ({"max_rows": 64}, grpc.StatusCode.INVALID_ARGUMENT, "need"),  # the input region holds 8 rows
    ({"ready_event": "not hex"}, grpc.StatusCode.INVALID_ARGUMENT, "ready_event: not hex"),
    ({"ready_event": 7}, grpc.StatusCode.INVALID_ARGUMENT, "ready_event: not hex"),
    ({"ready_event": "00" * 10}, grpc.StatusCode.INVALID_ARGUMENT, "ready_event: 10 bytes"),
    ({"ready_region": "no-such-region"}, grpc.StatusCode.NOT_FOUND, "not registered"),
    # The descriptors: a list that does not match them.
    ({"memfds": ["input_region"]}, grpc.StatusCode.INVALID_ARGUMENT, "memfds names 1 regions, the message carried 0"),
    ({"memfds": ["input_region", "input_region"]}, grpc.StatusCode.INVALID_ARGUMENT, "must list distinct regions"),
    ({"memfds": ["ready_region"]}, grpc.StatusCode.INVALID_ARGUMENT, "that the attach names"),
    ({"memfds": "input_region"}, grpc.StatusCode.INVALID_ARGUMENT, "memfds"),
    ({"memfds": [], "fds": [0]}, grpc.StatusCode.INVALID_ARGUMENT, "memfds names 0 regions, the message carried 1"),
])
def test_a_bad_attach_is_refused_and_the_connection_may_attach_again(reward, overrides, code, words):
    service, stub = reward
    c = RawClient(service, stub)
    try:
        got_code, message = status(c.attach(**overrides))
        assert got_code == code and words in message
        assert c.attach()[:1] == ATTACH  # the same connection, now right
        assert c.wave(3)[:1] == REPLY
    finally:
        c.close()


def test_a_ready_event_on_a_server_that_cannot_order_by_events_leaves_the_channel_synchronised(reward):
    """A well-formed ready_event where the model's critical lane has no CUDA
    bound runner (the CPU here): the attach succeeds, its layout has no
    done_event, and waves are answered once their outputs are written."""
    service, stub = reward
    c = RawClient(service, stub)
    try:
        reply = c.attach(ready_event="ab" * 64)
        assert reply[:1] == ATTACH and "done_event" not in json.loads(reply[1:])
        assert c.wave(3)[:1] == REPLY
    finally:
        c.close()


def test_a_ready_region_that_is_a_wave_region_or_too_small_is_refused(reward):
    """The ready word (tandem/ready_word.py) needs a memfd of its own of at
    least 8 bytes: one of the wave's regions named again, or a smaller one,
    is INVALID_ARGUMENT naming it; the connection attaches right after."""
    service, stub = reward
    c = RawClient(service, stub)
    small = SealedMemory(4, client_id=c.inputs.client_id)
    try:
        for region, ready, words in ((c.inputs.name, None, "is also a wave's region"),
                                     (c.outputs.name, None, "is also a wave's region"), (small.name, small, "need 8")):
            code, message = status(c.attach(ready, ready_region=region))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and words in message and region in message
        assert held(service, c.inputs.client_id) == 0  # a failed attach leaves none of its memfds registered
        assert c.attach()[:1] == ATTACH
        assert c.wave(3)[:1] == REPLY
    finally:
        c.close()
        small.close()


@pytest.mark.parametrize("role", ["input_region", "ready_region"])
def test_a_system_region_registered_by_key_is_refused_as_a_channels_region(reward, role):
    """The channel's host memory is mapped (the ready word is polled in place):
    only a sealed memfd passed with the attach may be, never a client's object
    registered by key, which the server reads with pread alone."""
    _, stub = reward
    c = RawClient(reward[0], stub)
    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        stub.RegisterSharedMemory(reward_pb2.RegisterSharedMemoryRequest(
            client_id=c.inputs.client_id, name="by-key", byte_size=4096,
            system=reward_pb2.SystemSharedMemory(key=shm.name)))
        code, message = status(c.attach(**{role: "by-key"}))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "region 'by-key': a system region" in message
        assert "sealed memfd" in message
        assert c.attach()[:1] == ATTACH
    finally:
        c.close()
        stub.UnregisterSharedMemory(reward_pb2.UnregisterSharedMemoryRequest(client_id=c.inputs.client_id))
        shm.close()
        shm.unlink()


def test_a_memfd_not_sealed_against_shrinking_is_refused_and_a_sealed_one_attaches(reward):
    service, stub = reward
    c = RawClient(service, stub)
    unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(unsealed, 8 * 84)
        code, message = status(c.attach(memfds=["input_region"], fds=[unsealed], output_region="none"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not sealed against shrinking" in message
        code, message = status(c.attach(memfds=["input_region", "output_region"], fds=[unsealed, c.outputs.fd]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "F_SEAL_SHRINK" in message
        assert held(service, c.inputs.client_id) == 0  # the sealed output's registration undone with the attach
        assert c.attach()[:1] == ATTACH
        assert c.wave(3)[:1] == REPLY
    finally:
        os.close(unsealed)
        c.close()


def test_a_sealed_memfd_cannot_shrink_and_the_server_serves_on(reward):
    """What killed the server through a mapped object (SIGBUS) cannot be done
    to a channel's memory: ftruncate fails in the client itself."""
    service, stub = reward
    lc = LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 16)
    try:
        assert lc.kind == "memfd"
        for region in (lc._inputs, lc._outputs_region):
            for size in (0, region.byte_size // 2, region.byte_size * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(region.fd, size)
        assert lc.evaluate(boards("4"), Deadline.after_s(10))["value"].shape == (1, 1)
    finally:
        lc.close()


def test_a_ready_region_is_held_by_the_connection_and_unused_where_waves_are_synchronised(reward):
    """A well-formed ready word on a server whose critical lane cannot order
    by events (the CPU here): the attach succeeds without a done_event, its
    waves are answered once written, whatever the word holds, and the region
    is unregistered with the others when the connection closes."""
    service, stub = reward
    c = RawClient(service, stub)
    word = SealedMemory(8, client_id=c.inputs.client_id)
    try:
        reply = c.attach(word)
        assert reply[:1] == ATTACH and "done_event" not in json.loads(reply[1:])
        assert c.wave(3)[:1] == REPLY
        assert held(service, c.inputs.client_id) == 3
        c.close()
        assert wait_for(lambda: held(service, c.inputs.client_id) == 0, 10)
    finally:
        c.close()
        word.close()


def test_a_malformed_attach_and_a_wave_before_the_attach_are_refused(reward):
    service, stub = reward
    c = RawClient(service, stub)
    try:
        assert status(c.ask(ATTACH + b"{not json"))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert status(c.ask(ATTACH + b'{"model": "connect4_value"}'))[0] == grpc.StatusCode.INVALID_ARGUMENT
        code, message = status(c.wave(1))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "attach first" in message
        assert c.attach()[:1] == ATTACH
    finally:
        c.close()


def test_an_output_region_too_small_for_the_models_outputs_is_refused(reward):
    service, stub = reward
    c = RawClient(service, stub, out_bytes=8 * 4)  # room for the values, none for the policy logits
    try:
        code, message = status(c.attach())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and c.outputs.name in message and "need" in message
    finally:
        c.close()


def test_a_wave_out_of_range_or_malformed_is_refused_and_the_next_one_served(reward):
    service, stub = reward
    c = RawClient(service, stub, max_rows=8)
    try:
        assert c.attach()[:1] == ATTACH
        for rows in (0, 9, 2**32 - 1):
            code, message = status(c.wave(rows, seq=7))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of range 1..8" in message
            assert c.wave(1, seq=8)[:1] == REPLY
        assert status(c.ask(WAVE + b"short"))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert status(c.ask(b"Zjunk"))[0] == grpc.StatusCode.FAILED_PRECONDITION
        reply = c.wave(8, seq=9)
        assert reply[:1] == REPLY
    finally:
        c.close()


def test_a_region_attached_to_one_connection_cannot_be_attached_to_another(reward):
    service, stub = reward
    first = RawClient(service, stub)
    second = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        assert first.attach()[:1] == ATTACH
        second.settimeout(10)
        second.connect(service.servicer.leaf_channel.path)
        body = {"client_id": first.inputs.client_id, "model": MODEL, "max_rows": 8,
                "input_region": first.inputs.name, "output_region": first.outputs.name}
        second.send(ATTACH + json.dumps(body).encode())  # by name: no descriptors
        code, message = status(second.recv(MAX_MESSAGE_BYTES))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "attached to another" in message
        second.send(ATTACH + json.dumps({**body, "client_id": "someone-else"}).encode())
        code, message = status(second.recv(MAX_MESSAGE_BYTES))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "another client" in message
        assert first.wave(2)[:1] == REPLY
    finally:
        second.close()
        first.close()


def test_a_region_unregistered_under_an_attached_channel_fails_its_waves_cleanly(reward):
    service, stub = reward
    lc = LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 16)
    try:
        stub.UnregisterSharedMemory(reward_pb2.UnregisterSharedMemoryRequest(
            client_id=lc._inputs.client_id, name=lc._inputs.name))
        with pytest.raises(LeafChannelError) as err:
            lc.evaluate(boards("4"), Deadline.after_s(10))
        assert err.value.code == grpc.StatusCode.NOT_FOUND and lc._inputs.name in str(err.value)
    finally:
        lc.close()
    again = LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 16)  # the server serves on
    try:
        assert again.evaluate(boards("4"), Deadline.after_s(10))["value"].shape == (1, 1)
    finally:
        again.close()


def test_connections_beyond_the_limit_are_refused_until_one_closes(reward):
    service, stub = reward
    held = [LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 4) for _ in range(4)]
    try:
        with pytest.raises(LeafChannelError) as err:
            LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 4)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_connections" in str(err.value)
        held.pop().close()
        assert wait_for(lambda: len(service.servicer.leaf_channel._connections) < 4)
        held.append(LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 4))
    finally:
        for lc in held:
            lc.close()


def test_a_client_that_dies_without_closing_loses_nothing_on_the_server(reward):
    """The socket closing is the client going away: its regions are unregistered."""
    service, stub = reward
    c = RawClient(service, stub)
    assert c.attach()[:1] == ATTACH
    assert held(service, c.inputs.client_id) == 2
    c.sock.close()  # as a killed process's socket closes; its shared-memory objects stay for the server to drop
    assert wait_for(lambda: held(service, c.inputs.client_id) == 0)
    c.inputs.close(unregister=False)
    c.outputs.close(unregister=False)
    lc = LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 4)
    try:
        assert lc.evaluate(boards(""), Deadline.after_s(10))["value"].shape == (1, 1)
    finally:
        lc.close()


def test_no_socket_at_the_path_is_unavailable(tmp_path, reward):
    _, stub = reward
    with pytest.raises(LeafChannelError) as err:
        LeafChannel(stub, str(tmp_path / "none.sock"), MODEL, 4)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_stale_system_region_key_is_refused_at_registration(reward):
    """A key whose object is gone (a stale handle) never reaches the channel."""
    _, stub = reward
    shm = shared_memory.SharedMemory(create=True, size=4096)
    key = shm.name
    shm.close()
    shm.unlink()
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterSharedMemory(reward_pb2.RegisterSharedMemoryRequest(
            client_id="stale", name="stale-in", byte_size=4096, system=reward_pb2.SystemSharedMemory(key=key)))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_region_registered_again_under_its_name_is_refused_per_wave(reward):
    """Attached, then unregistered and registered again under the same name
    (here a small object by key): each wave checks the regions again, so the
    server answers naming it instead of reading what is not the channel's
    memory; the connection and the server serve on."""
    service, stub = reward
    c = RawClient(service, stub, max_rows=8)
    small = shared_memory.SharedMemory(create=True, size=84)
    try:
        assert c.attach()[:1] == ATTACH
        stub.UnregisterSharedMemory(reward_pb2.UnregisterSharedMemoryRequest(
            client_id=c.inputs.client_id, name=c.inputs.name))
        stub.RegisterSharedMemory(reward_pb2.RegisterSharedMemoryRequest(
            client_id=c.inputs.client_id, name=c.inputs.name, byte_size=84,
            system=reward_pb2.SystemSharedMemory(key=small.name)))
        for seq in (3, 4):
            code, message = status(c.wave(8, seq=seq))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and c.inputs.name in message and "system" in message
    finally:
        c.close()
        stub.UnregisterSharedMemory(reward_pb2.UnregisterSharedMemoryRequest(client_id=c.inputs.client_id))
        small.close()
        small.unlink()
    lc = LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 4)
    try:
        assert lc.evaluate(boards("4"), Deadline.after_s(10))["value"].shape == (1, 1)
    finally:
        lc.close()


def test_a_deeply_nested_attach_is_invalid_argument_and_the_connection_goes_on(reward):
    service, stub = reward
    c = RawClient(service, stub)
    try:
        code, message = status(c.ask(ATTACH + b"[" * 3000))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "attach: malformed" in message
        assert c.attach()[:1] == ATTACH
        assert c.wave(2)[:1] == REPLY
    finally:
        c.close()


def test_one_region_as_both_input_and_output_is_invalid_argument(reward):
    service, stub = reward
    c = RawClient(service, stub, max_rows=8, out_bytes=8192)
    try:
        code, message = status(c.attach(input_region=c.outputs.name))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "input_region" in message and "output_region" in message and c.outputs.name in message
        assert c.attach()[:1] == ATTACH
    finally:
        c.close()


def test_an_unknown_model_is_a_leaf_channel_error_naming_it(reward):
    service, stub = reward
    with pytest.raises(LeafChannelError) as err:
        LeafChannel(stub, service.servicer.leaf_channel.path, "no_such_model", 4)
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "no_such_model" in str(err.value)


def own_server(service, **cfg) -> LeafChannelServer:
    """A second leaf channel server over the reward service's own models, batchers and regions."""
    s = service.servicer
    return LeafChannelServer(LeafChannelConfig(**{"max_rows": 64, "max_connections": 2, **cfg}), s.sessions,
                             s.batchers, s.regions, s.metrics, 2.0)


def test_closing_the_server_ends_its_threads_unregisters_and_removes_the_socket(reward):
    service, stub = reward
    server = own_server(service)
    lc = LeafChannel(stub, server.path, MODEL, 4)
    client_id = lc._inputs.client_id
    try:
        assert lc.evaluate(boards("4"), Deadline.after_s(10))["value"].shape == (1, 1)
        threads = list(server._connections.values())
        server.close()
        assert not server._accepter.is_alive()  # woken from accept(), not left blocked in it
        assert not any(t.is_alive() for t in threads)
        assert held(service, client_id) == 0 and not os.path.exists(server.path)
        with pytest.raises(LeafChannelError) as err:
            lc.evaluate(boards("4"), Deadline.after_s(10))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        lc.close()
        server.close()  # twice is fine


def test_closing_while_a_connection_thread_is_starting_joins_it(reward, monkeypatch):
    """close() must never find a connection's thread registered but not started
    (joining it raised RuntimeError, and the reward service's close stopped there)."""
    service, _ = reward
    starting, go = threading.Event(), threading.Event()

    class SlowToStart(threading.Thread):
        def start(self):
            if self.name == "leaf-channel":
                starting.set()
                go.wait(30)
            super().start()

    monkeypatch.setattr(leaf_channel_server.threading, "Thread", SlowToStart)
    server = own_server(service)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    errors = []

    def close():
        try:
            server.close()
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    closer = threading.Thread(target=close)
    try:
        client.connect(server.path)
        assert starting.wait(10)
        closer.start()
        wait_for(lambda: server._closed, 1.0)  # close() is under way (or waits for the start to end)
        go.set()
        closer.join(30)
        assert not closer.is_alive() and errors == []
        assert wait_for(lambda: not server._connections) and not os.path.exists(server.path)
    finally:
        go.set()
        client.close()
        server.close()


def test_running_out_of_file_descriptors_pauses_accepting_and_it_resumes(reward, caplog):
    """accept() failing (EMFILE) must not end the accepting thread: the socket
    would still be advertised, and every later search would wait out its attach."""
    service, stub = reward
    server = own_server(service)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.settimeout(10)
    filler = []
    try:
        # The process out of descriptors for a moment: accept() has none for the connection.
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        try:
            while True:
                filler.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        with caplog.at_level("WARNING", logger="reward_service.leaf_channel"):
            client.connect(server.path)  # completes in the backlog; the server's accept() fails
            wait_for(lambda: "accepting a connection failed" in caplog.text, 3.0)  # accept() has failed
        for fd in filler:
            os.close(fd)
        filler.clear()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert server._accepter.is_alive()
        c = RawClient(service, stub, sock=client)  # the protocol on the connection made above
        try:
            assert c.attach()[:1] == ATTACH  # accepted once descriptors were free again
            assert c.wave(2)[:1] == REPLY
        finally:
            c.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        client.close()
        server.close()


def test_rows_of_another_shape_are_refused_before_anything_is_sent(reward):
    """[2, 6, 7] would broadcast into [2, 2, 6, 7]: refused, not valued as something else."""
    service, stub = reward
    lc = LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 8)
    try:
        for wrong in (np.zeros((2, 6, 7), np.uint8), np.zeros((1, 1, 6, 7), np.uint8)):
            with pytest.raises(ValueError, match=r"rows of shape .* takes \[2, 6, 7\]"):
                lc.evaluate(wrong, Deadline.after_s(10))
        assert lc._seq == 0  # nothing was sent
        assert lc.evaluate(boards("4"), Deadline.after_s(10))["value"].shape == (1, 1)
    finally:
        lc.close()


def test_a_wave_given_up_by_its_deadline_never_answers_a_later_one(reward):
    """The client skips the late answer to the wave it gave up; the next wave's
    outputs are its own rows', not the stale wave's."""
    service, stub = reward
    lc = LeafChannel(stub, service.servicer.leaf_channel.path, MODEL, 64)
    try:
        stale = np.repeat(boards(""), 64, axis=0)
        with pytest.raises(LeafChannelError) as err:
            lc.evaluate(stale, Deadline.after_s(1e-6))  # gives up before any answer can come
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        fresh = boards("4453", "1234567", "44")
        got = lc.evaluate(fresh, Deadline.after_s(10))
        want = stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", fresh)],
                                                        request_class=reward_pb2.REQUEST_CLASS_CRITICAL))
        by_name = {t.name: tensors.from_proto(t) for t in want.outputs}
        for name in got:
            np.testing.assert_allclose(got[name], by_name[name], rtol=1e-5, atol=1e-6)
    finally:
        lc.close()


class OneAnswerServer:
    """A socket that answers the attach with ``attach_reply`` and every wave with
    ``wave_reply``: a peer that does not speak the protocol."""

    def __init__(self, path: str, attach_reply: bytes, wave_reply: bytes = b""):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(1)
        self.conns = []
        threading.Thread(target=self._serve, args=(attach_reply, wave_reply), daemon=True).start()

    def _serve(self, attach_reply, wave_reply):
        conn, _ = self.listener.accept()
        self.conns.append(conn)
        try:
            conn.recv(MAX_MESSAGE_BYTES)
            conn.send(attach_reply)
            while conn.recv(MAX_MESSAGE_BYTES):
                conn.send(wave_reply)
        except OSError:
            pass
        # stays open: a channel closed for a message not of the protocol must not wait for this peer

    def close(self):
        for conn in self.conns:
            conn.close()
        self.listener.close()


@pytest.mark.parametrize("attach_reply, wave_reply", [(b"E", b""), (ATTACH + b"{}", REPLY), (ATTACH + b"{}", ERROR + b"x")])
def test_messages_not_of_the_protocol_are_internal_errors_and_close_the_channel(reward, tmp_path, attach_reply, wave_reply):
    _, stub = reward
    peer = OneAnswerServer(str(tmp_path / "peer.sock"), attach_reply, wave_reply)
    try:
        with pytest.raises(LeafChannelError) as err:
            lc = LeafChannel(stub, str(tmp_path / "peer.sock"), MODEL, 4)
            try:
                lc.evaluate(boards("4"), Deadline.after_s(10))
            finally:
                assert lc.closed
        assert err.value.code == grpc.StatusCode.INTERNAL and "malformed" in str(err.value)
    finally:
        peer.close()


def test_a_connection_that_never_attaches_is_closed_after_the_attach_window_and_frees_its_slot(reward):
    """max_connections silent (or never rightly attaching) connections would
    otherwise hold every slot: each is answered DEADLINE_EXCEEDED and closed
    once reward.leaf_channel.attach_timeout_ms has passed since it connected."""
    service, stub = reward
    server = own_server(service, attach_timeout_ms=1000)  # max_connections 2
    silent = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    try:
        for s in silent:
            s.settimeout(30)
            s.connect(server.path)
        for s in silent:
            code, message = status(s.recv(MAX_MESSAGE_BYTES))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "attach_timeout_ms" in message
            assert s.recv(MAX_MESSAGE_BYTES) == b""  # then closed
        assert wait_for(lambda: not server._connections)
        lc = LeafChannel(stub, server.path, MODEL, 4)
        try:
            assert lc.evaluate(boards("4"), Deadline.after_s(10))["value"].shape == (1, 1)
        finally:
            lc.close()
    finally:
        for s in silent:
            s.close()
        server.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_a_peer_of_another_user_is_permission_denied(reward):
    """Root passes the socket file's mode 0600 (here opened to all, as a
    careless directory might): the server's own check (SO_PEERCRED) refuses
    any uid but its own, before reading any attach or descriptor."""
    import subprocess
    import sys

    service, stub = reward
    server = own_server(service)
    os.chmod(server.path, 0o666)
    code = ("import os, socket\nos.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\ns.settimeout(30)\n"
            f"s.connect({server.path!r})\ns.send(b'A{{}}')\nprint(s.recv(4096).hex())\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        code, message = status(bytes.fromhex(done.stdout.strip()))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "peer uid 65534" in message
        lc = LeafChannel(stub, server.path, MODEL, 4)  # its own user is served
        try:
            assert lc.evaluate(boards("4"), Deadline.after_s(10))["value"].shape == (1, 1)
        finally:
            lc.close()
    finally:
        server.close()


def test_a_dead_servers_socket_file_is_removed_and_a_live_ones_kept(tmp_path):
    """A server killed before its close leaves its file; the next server started in
    that directory removes it (by its pid, gone), never a live server's."""
    import subprocess

    from reward_service.leaf_channel import SOCKET_PREFIX, remove_stale_sockets

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process holds now
    dead = tmp_path / f"{SOCKET_PREFIX}{gone.pid}-7f00.sock"
    live = tmp_path / f"{SOCKET_PREFIX}{os.getpid()}-7f01.sock"
    other = tmp_path / "tandem-leaf-notapid.sock"
    for path in (dead, live, other):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(str(path))
        s.close()  # the file stays, as a killed server's does
    assert remove_stale_sockets(str(tmp_path)) == [dead.name]
    assert not dead.exists() and live.exists() and other.exists()


def _figures(service) -> dict:
    """The model's critical-lane metrics and OIP totals that a wave moves."""
    def get(name: str, **extra) -> float:
        return REGISTRY.get_sample_value(name, {"model": MODEL, "lane": "critical", **extra}) or 0.0

    t = service.servicer.metrics.totals(MODEL)
    return {
        "requests": get("tandem_reward_model_requests_total"),
        "successes": get("tandem_reward_model_request_successes_total"),
        "invalid": get("tandem_reward_model_request_failures_total", reason="invalid_input"),
        "queue_count": get("tandem_reward_model_queue_seconds_count"),
        "executions": get("tandem_reward_model_executions_total"),
        "batch_rows": get("tandem_reward_model_batch_size_sum"),
        "compute_count": get("tandem_reward_model_compute_seconds_count"),
        "inference_count": t.inference_count, "success_count": t.success.count, "fail_count": t.fail.count,
        "queue_totals": t.queue.count, "execution_count": t.execution_count,
    }


def test_waves_are_counted_in_the_models_metrics_once_answered(reward):
    """A wave's request figures are recorded just after its reply is sent, on
    its connection's thread, before that thread reads the next message: once
    the connections are gone, every wave is counted, with the same values as
    when they were recorded before the reply."""
    service, stub = reward
    server = service.servicer.leaf_channel
    assert wait_for(lambda: not server._connections, 30)  # earlier tests' waves all recorded
    before = _figures(service)
    lc = LeafChannel(stub, server.path, MODEL, 16)
    bad = RawClient(service, stub, max_rows=8)
    try:
        for n in (1, 3, 5):
            assert lc.evaluate(np.repeat(boards("4"), n, axis=0), Deadline.after_s(30))["value"].shape == (n, 1)
        assert bad.attach()[:1] == ATTACH
        assert status(bad.wave(0))[0] == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        lc.close()
        bad.close()
    assert wait_for(lambda: not server._connections, 30)  # their threads ended: nothing left to record
    after = _figures(service)
    delta = {k: after[k] - before[k] for k in before}
    assert delta == {"requests": 4, "successes": 3, "invalid": 1, "queue_count": 3, "executions": 3,
                     "batch_rows": 9, "compute_count": 3, "inference_count": 9, "success_count": 3,
                     "fail_count": 1, "queue_totals": 3, "execution_count": 3}


def test_offered_narrows_the_channel_to_the_models_max_batch_size():
    """A model that takes at most 16 rows per batch gets a 16-row channel from
    ``LeafChannel.offered`` (the server refuses a wider attach), and its
    waves answer as Evaluate does."""
    models = [{"name": MODEL, "path": "reward_service/models/connect4_value.onnx", "max_batch_size": 16}]
    cfg = loopback_config(reward={"models": models, "leaf_channel": {"max_rows": 512}})
    service = reward_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.reward.address, cfg)
    try:
        stub = reward_pb2_grpc.RewardServiceStub(ch)
        lc = LeafChannel.offered(stub, MODEL, 512, timeout_s=10)
        try:
            assert lc.max_rows == 16
            obs = boards(*[str(c) for c in range(1, 8)] * 2)  # 14 positions
            got = lc.evaluate(obs)
            reply = stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", obs)]))
            np.testing.assert_allclose(got["value"], tensors.from_proto(reply.outputs[0]), atol=1e-5)
            with pytest.raises(ValueError, match="1..16"):
                lc.evaluate(np.zeros((17, 2, 6, 7), np.uint8))
        finally:
            lc.close()
    finally:
        ch.close()
        service.stop()


@pytest.mark.parametrize("spin_s", [0.0, 0.002])
def test_the_reply_read_spins_then_blocks_and_keeps_the_deadline(monkeypatch, spin_s):
    """The client's reply read (read without blocking for REPLY_SPIN_S, then
    blocking to the deadline): a reply already sent comes back, one sent
    during the wait too, a closed peer reads as b'' (the caller's
    UNAVAILABLE), and none by the deadline is TimeoutError (the caller's
    DEADLINE_EXCEEDED) -- also where the deadline falls inside the spin."""
    from tandem import leaf_channel as client

    monkeypatch.setattr(client, "REPLY_SPIN_S", spin_s)
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    chan = type("Chan", (), {"_sock": ours})()
    read = client.LeafChannel._recv_reply
    try:
        peer.send(b"R1")
        assert read(chan, Deadline.after_s(30)) == b"R1"
        threading.Timer(0.02, peer.send, args=(b"R2",)).start()
        assert read(chan, None) == b"R2"
        with pytest.raises(TimeoutError):
            read(chan, Deadline.after_s(0.001))  # inside the spin where there is one
        peer.close()
        assert read(chan, Deadline.after_s(30)) == b""
    finally:
        ours.close()
