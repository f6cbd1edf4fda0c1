"""Fuzz targets: the request decoding and validation of the three services, in process.

Each target takes what a client controls (request bytes, or a move string or
board for the game rules), runs our code on it exactly as the server would,
and checks the contract: the input is either refused with the documented
error (``DecodeError`` from the protobuf parse, ``ValueError``/``InputError``/
``InvalidArgument``, or an abort with INVALID_ARGUMENT / NOT_FOUND that names
the field), or accepted and then handled correctly (accepted tensors decode
to the declared shape and the model runs on them; accepted positions are
searchable and the answer is a legal move; accepted registrations fit the
limits). Any other exception is a bug (a client would see UNKNOWN). Each
returns a short outcome label that the harness tallies.

Targets need a :class:`Fixtures` (a loaded model session, servicers with
small budgets); build one per process with :func:`fixtures`.
"""
from __future__ import annotations

import functools
import math
import socket
from dataclasses import dataclass

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from tandem.v1 import reward_pb2, scheduler_pb2, search_pb2

from reward_service import server as reward_server
from reward_service.session import InputError
from scheduler import policy
from scheduler.server import (
    MAX_INSTANCE_CHARS,
    MAX_STREAM_PRIORITIES,
    InvalidArgument,
    SchedulerServicer,
    check_register,
)
from search_service.games import connect4
from search_service.mcts.cpu_reference import CpuReferenceBackend
from search_service.server import SearchServicer
from tandem import tensors
from tandem.config import parse_config
from tandem.device import cpu_only

#: What a refusal may say. Anything else a client would see as a server fault.
CLEAR_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND})

MAX_SIMULATIONS = 64  # accepted searches stay cheap
MAX_DEADLINE_MS = 5.0


class Aborted(Exception):
    """``context.abort`` of :class:`FakeContext`."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """The part of ``grpc.ServicerContext`` the servicers use, with no deadline."""

    def abort(self, code, details):
        raise Aborted(code, details)

    def time_remaining(self):
        return None

    def peer(self):
        return "unix:fuzz"  # one owner of every session (search_service.sessions.owner)

    def is_active(self):
        return True

    def code(self):
        return None


def _refused(exc: Aborted, allowed=CLEAR_CODES) -> str:
    assert exc.code in allowed, f"unclear status {exc.code.name}: {exc.details}"
    assert exc.details and ":" in exc.details, f"the message names no field: {exc.details!r}"
    return exc.code.name


def _zero_evaluator(obs: np.ndarray):
    """A leaf evaluator stand-in: value 0, no priors (the value model is fuzzed on its own)."""
    return np.zeros(len(obs), np.float32), None


@dataclass
class Fixtures:
    session: object  # reward_service.session.ModelSession
    reward: object  # reward_service.server.RewardServicer
    search: SearchServicer
    scheduler: SchedulerServicer
    services: tuple = ()

    def close(self) -> None:
        self.scheduler.close()
        for service in self.services:
            service.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@functools.lru_cache(maxsize=1)
def fixtures() -> Fixtures:
    """One set per process: the reward service with the shipped value model
    (CPU, batch limit 64; started on a free loopback port, its servicer called
    directly), a search servicer with small budgets and a stand-in evaluator,
    and a scheduler servicer (no server)."""
    cfg = parse_config({
        "reward": {"address": f"127.0.0.1:{_free_port()}", "metrics_port": 0, "execution_provider": "cpu", "intra_op_threads": 1,
                   "models": [{"name": "connect4_value", "path": "reward_service/models/connect4_value.onnx",
                               "max_batch_size": 64}]},
        "search": {"backend": "cpu", "max_simulations": MAX_SIMULATIONS, "max_deadline_ms": MAX_DEADLINE_MS,
                   "parallel_sims": 4, "max_sessions": 8},
        "scheduler": {"lease_ttl_ms": 200, "gpu_memory_bytes": 1 << 30, "policy": "dynamic"},
    })
    reward = reward_server.start(cfg, follow_scheduler=False)
    servicer = reward.servicer
    return Fixtures(
        session=servicer.sessions["connect4_value"],
        reward=servicer,
        search=SearchServicer(cfg, CpuReferenceBackend(), _zero_evaluator),
        scheduler=SchedulerServicer(cfg.scheduler, cpu_only()),
        services=(reward,),
    )


# -- tandem.tensors.from_proto ------------------------------------------------------------
def tensor_from_proto(data: bytes) -> str:
    try:
        t = reward_pb2.Tensor.FromString(data)
    except DecodeError:
        return "decode_error"
    try:
        array = tensors.from_proto(t)
    except ValueError as exc:
        assert str(exc), "empty error message"
        return "ValueError"
    assert array.shape == tuple(t.shape)
    assert array.nbytes == len(t.data)
    assert array.dtype == tensors.numpy_dtype(t.dtype)
    again = tensors.to_proto(t.name, array)
    assert again.data == t.data
    assert list(again.shape) == list(t.shape)  # 0-d tensors keep their shape [] (tandem/tensors.py)
    return "OK"


# -- reward_service: ModelSession.decode (+ run) through RewardServicer.Evaluate ----------------
def evaluate(data: bytes, fx: Fixtures) -> str:
    try:
        request = reward_pb2.EvaluateRequest.FromString(data)
    except DecodeError:
        return "decode_error"
    session = fx.session
    try:
        feeds = session.decode(list(request.inputs)) if request.model == session.name else None
    except InputError as exc:
        assert str(exc).startswith(("inputs", "output_names")), str(exc)
        feeds = None
    if feeds is not None:  # what decode accepts fits the model exactly
        for spec in session.inputs:
            a = feeds[spec.name]
            assert a.dtype == tensors.numpy_dtype(spec.dtype)
            assert a.ndim == len(spec.shape) and 1 <= a.shape[0] <= session.max_batch_size
            assert all(e in (-1, g) for e, g in zip(spec.shape, a.shape))
    try:
        reply = fx.reward.Evaluate(request, FakeContext())
    except Aborted as exc:
        return _refused(exc)
    assert feeds is not None, "Evaluate accepted what decode refused"
    batch = next(iter(feeds.values())).shape[0]
    for out in reply.outputs:
        assert tensors.from_proto(out).shape[0] == batch
        if out.name == "value":
            v = tensors.from_proto(out)
            assert np.isfinite(v).all() and (np.abs(v) <= 1.0 + 1e-6).all()
    return "OK"


def model_metadata(data: bytes, fx: Fixtures) -> str:
    try:
        request = reward_pb2.ModelMetadataRequest.FromString(data)
    except DecodeError:
        return "decode_error"
    try:
        reply = fx.reward.ModelMetadata(request, FakeContext())
    except Aborted as exc:
        return _refused(exc)
    assert reply.name == request.model
    return "OK"


# -- search_service: parse_moves, from_cells, and the whole Search handler --------------------
def parse_moves(text: str) -> str:
    try:
        pos = connect4.parse_moves(text)
    except ValueError as exc:
        assert "character" in str(exc) or "moves" in str(exc), str(exc)
        return "ValueError"
    assert int(pos.moves[0]) == len(text)
    assert connect4.popcount(pos.mask)[0] == len(text)
    # A reachable position: its board reads back as the same position.
    cells = connect4.to_cells(pos)[0]
    assert connect4.same_position(connect4.from_cells(6, 7, cells.tobytes()), pos)
    return "OK"


def from_cells(rows: int, columns: int, cells: bytes) -> str:
    try:
        pos = connect4.from_cells(rows, columns, cells)
    except ValueError as exc:
        assert str(exc)
        return "ValueError"
    assert (rows, columns, len(cells)) == (6, 7, 42)
    assert bytes(connect4.to_cells(pos)[0]) == bytes(cells)
    n1, n2 = cells.count(1), cells.count(2)
    assert n1 - n2 in (0, 1) and int(pos.moves[0]) == n1 + n2
    return "OK"


def search(data: bytes, fx: Fixtures) -> str:
    try:
        request = search_pb2.SearchRequest.FromString(data)
    except DecodeError:
        return "decode_error"
    try:
        reply = fx.search.Search(request, FakeContext())
    except Aborted as exc:
        return _refused(exc)
    # Accepted: a legal move with the whole answer filled in.
    position = connect4.from_cells(request.board.rows, request.board.columns, request.board.cells) \
        if request.HasField("board") else connect4.parse_moves(request.moves)
    assert connect4.legal_mask(position)[0][reply.action], f"illegal move {reply.action}"
    assert reply.move == str(reply.action + 1)
    assert len(reply.visit_counts) == 7
    # No simulation only when the answer had to come from the tree as it was: the deadline passed
    # during the root's evaluation, or the (kept) root is already proven.
    assert reply.simulations >= 1 or reply.deadline_reached or reply.proven, reply
    if request.simulations:
        assert reply.simulations <= request.simulations
    assert all(math.isfinite(q) for q in reply.q_values) and -1 <= reply.root_value <= 1
    return "OK"


# -- scheduler: check_register, and the servicer's Register / ReportLoad / Status --------------
def register(data: bytes, fx: Fixtures) -> str:
    try:
        request = scheduler_pb2.RegisterRequest.FromString(data)
    except DecodeError:
        return "decode_error"
    prange = cpu_only().priority_range
    try:
        check_register(request, prange)
        checked = True
    except InvalidArgument as exc:
        assert str(exc).split(":")[0].split("[")[0] in ("kind", "instance", "address", "stream_priorities"), str(exc)
        checked = False
    if checked:
        assert 0 < len(request.instance) <= MAX_INSTANCE_CHARS and request.instance.isprintable()
        assert len(request.stream_priorities) <= MAX_STREAM_PRIORITIES
        assert all(prange.contains(p) for p in request.stream_priorities)
    allowed = CLEAR_CODES | {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}
    try:
        reply = fx.scheduler.Register(request, FakeContext())
    except Aborted as exc:
        if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
            assert not checked
        return _refused(exc, allowed)
    assert checked, "Register accepted what check_register refused"
    assert reply.lease.lease_id and reply.assignment.lease_id == reply.lease.lease_id
    return "OK"


def report_load(data: bytes, fx: Fixtures) -> str:
    try:
        report = scheduler_pb2.LoadReport.FromString(data)
    except DecodeError:
        return "decode_error"
    for kind in (scheduler_pb2.SERVICE_KIND_SEARCH, scheduler_pb2.SERVICE_KIND_REWARD, 0, 77):
        u = policy.urgency(kind, report)
        assert math.isfinite(u) and u >= 0, u
    # Half the time against a live lease (a fresh registration), so the policy runs on the report.
    if len(data) % 2:
        try:
            report.lease_id = fx.scheduler.Register(scheduler_pb2.RegisterRequest(
                kind=scheduler_pb2.SERVICE_KIND_SEARCH, instance=f"load-{len(data) % 3}", address="127.0.0.1:1",
                stream_priorities=[0, -5], pid=len(data) % 4 + 1), FakeContext()).lease.lease_id
        except Aborted as exc:
            assert exc.code == grpc.StatusCode.ALREADY_EXISTS, exc
    try:
        fx.scheduler.ReportLoad(report, FakeContext())
    except Aborted as exc:
        return _refused(exc, {grpc.StatusCode.NOT_FOUND})
    status = fx.scheduler.Status(scheduler_pb2.StatusRequest(), FakeContext())
    assert all(math.isfinite(s.urgency) and s.urgency >= 0 for s in status.services)
    return "OK"
