"""Who answers a leaf-channel wave (reward_service/leaf_channel.py): with a
CUDA output region, the critical lane's worker, once the run wrote the
outputs; else, or when the worker's non-blocking send is refused, the
connection's thread. Exactly one answer per wave either way, and a client
that does not read its answers never holds the lane.

On the CPU no run writes into a CUDA region, so the server here has a
stand-in region table whose output region says it is CUDA memory (the kind
is all the server asks of it) and a batcher run that writes each request's
targets as the bound runner does on the GPU (reward_service/session.py);
the socket, the server, its threads and the batcher are the real ones. The
GPU path itself is tested in test_leaf_channel_gpu.py.
"""
from __future__ import annotations

import json
import socket

import numpy as np
import pytest
from tandem.v1 import reward_pb2

from reward_service.batcher import Batcher
from reward_service.leaf_channel import LeafChannelServer
from reward_service.session import Spec
from tandem.config import LeafChannelConfig
from tandem.leaf_channel import ATTACH, MAX_MESSAGE_BYTES, REPLY, REPLY_FORMAT, WAVE, WAVE_FORMAT

F32 = reward_pb2.DATA_TYPE_FLOAT32


class _Session:
    name, max_batch_size, execution_provider = "m", 64, "test"
    inputs = (Spec("x", F32, (-1, 3)),)
    outputs = (Spec("y", F32, (-1, 3)),)


class _Regions:
    """Host arrays standing in for the client's regions; ``out_kind`` is the
    output region's kind as the server reads it."""

    def __init__(self, out_kind: str):
        self.out_kind = out_kind
        self.memory = {}

    def acquire(self, client_id, names, uid=None):
        return _Lease(self, list(names))

    def status(self, *args, **kwargs):
        return []

    def unregister(self, *args, **kwargs):
        return []


class _Lease:
    def __init__(self, table: _Regions, names):
        self.table, self.names = table, names

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def describe(self):
        return {n: (self.table.out_kind if n.startswith("out") else "memfd", 1 << 20) for n in self.names}

    def array(self, region, offset, dtype, shape):
        """A view of ``shape`` over the same bytes at every call, as a region's."""
        key = (region, offset)
        if key not in self.table.memory:
            self.table.memory[key] = np.ones(1 << 12, dtype)
        return self.table.memory[key][: int(np.prod(shape))].reshape(shape)

    def check_live(self):
        pass

    def write(self, region, offset, array):
        pass


class _Metrics:
    def requested(self, *args):
        pass

    succeeded = failed = requested


def _run_writing_targets(batch):
    """As the bound runner: the outputs into each request's targets, then ``targets_written``."""
    out = np.concatenate([r.feeds["x"] for r in batch.requests]) * 2
    for req, off in zip(batch.requests, batch.offsets):
        if req.targets:
            req.targets["y"][:] = out[off : off + req.rows]
            req.targets_written = True
    return {"y": out}


@pytest.fixture(params=["cuda", "memfd"])
def server(request, tmp_path):
    batcher = Batcher(_run_writing_targets, max_batch_size=64, max_queue_delay_us=0, name="m")
    # lease 400 s: the connections' sockets wait up to 10 s (renew_s) in a blocking send
    srv = LeafChannelServer(LeafChannelConfig(socket_dir=str(tmp_path)), {"m": _Session()}, {"m": batcher},
                            _Regions(request.param), _Metrics(), 400.0)
    yield srv
    srv.close()
    batcher.close()


def _connect(srv, tag: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5.0)
    s.connect(srv.path)
    s.send(ATTACH + json.dumps({"client_id": "c", "model": "m", "max_rows": 4,
                                "input_region": "in" + tag, "output_region": "out" + tag}).encode())
    assert s.recv(MAX_MESSAGE_BYTES)[:1] == ATTACH
    return s


def _answers(s: socket.socket, n: int) -> list[int]:
    """The sequence numbers of the next ``n`` answers (REPLY messages only)."""
    seqs = []
    for _ in range(n):
        reply = s.recv(MAX_MESSAGE_BYTES)
        assert reply[:1] == REPLY, reply
        seqs.append(REPLY_FORMAT.unpack_from(reply, 1)[0])
    return seqs


def test_every_wave_gets_exactly_one_answer(server):
    s = _connect(server, "1")
    for seq in range(1, 21):
        s.send(WAVE + WAVE_FORMAT.pack(seq, 1 + seq % 4, 0))
        assert _answers(s, 1) == [seq]
    s.settimeout(0.3)
    with pytest.raises(TimeoutError):  # nothing more: no wave was answered twice
        s.recv(MAX_MESSAGE_BYTES)
    s.close()


def test_a_client_that_reads_no_answers_never_holds_the_lane(server):
    """One client sends waves and reads none of the answers, until its
    connection's buffer is full; another client's waves are answered all the
    same (with the worker's send blocking, they would wait the 10 s of the
    first connection's send timeout each, past this test's 5 s)."""
    greedy = _connect(server, "1")
    greedy.settimeout(0.2)
    sent = 0
    try:
        for seq in range(1, 2001):
            greedy.send(WAVE + WAVE_FORMAT.pack(seq, 1, 0))
            sent += 1
    except TimeoutError:
        pass  # the server stopped reading: its answers fill this client's buffer
    assert sent < 2000
    polite = _connect(server, "2")
    for seq in range(1, 6):
        polite.send(WAVE + WAVE_FORMAT.pack(seq, 2, 0))
        assert _answers(polite, 1) == [seq]
    greedy.settimeout(5.0)
    got = _answers(greedy, 50)  # the first answers, in order: none lost, none doubled
    assert got == list(range(1, 51))
    polite.close()
    greedy.close()
