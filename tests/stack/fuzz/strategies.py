"""Hypothesis strategies for malformed (and, now and then, valid) requests.

Shared by the in-process fuzz harness (``tests/stack/fuzz/``) and the gRPC bad-input
suite (``tests/stack/test_bad_input_properties.py``). Structured strategies build
real messages whose fields are wrong in the ways a client gets them wrong
(wrong dtype, shape, byte length; huge, negative, NaN/Inf numbers; text that
is not a move string; impossible boards; empty and oversized batches), with
valid values often enough that later validation paths are reached too.
:func:`wire_bytes` gives raw bytes for a message type: random bytes, and valid
messages with bytes flipped, cut, spliced or given invalid UTF-8, so the
protobuf parse itself is exercised.
"""
from __future__ import annotations

import math
import struct

import numpy as np
from hypothesis import strategies as st
from tandem.v1 import reward_pb2, scheduler_pb2, search_pb2

from search_service.games import connect4

# -- numbers ------------------------------------------------------------------------
i32 = st.integers(-(2**31), 2**31 - 1)
u32 = st.integers(0, 2**32 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
f64 = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e308, -1e308, 1e-9]),
)
# Text that protobuf can hold (no lone surrogates); invalid UTF-8 comes from wire_bytes.
text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=80)
long_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=200, max_size=3000)


def mostly(valid: st.SearchStrategy, anything: st.SearchStrategy, valid_share: int = 2) -> st.SearchStrategy:
    """``valid`` ``valid_share`` times out of ``valid_share + 1``, else ``anything``."""
    return st.integers(0, valid_share).flatmap(lambda i: anything if i == valid_share else valid)


# -- search ---------------------------------------------------------------------------
def _legal_moves(draw_moves: list[int]) -> str:
    """A legal move string from arbitrary column choices (skips full columns, stops at a finished game)."""
    pos, out = connect4.empty(), []
    for c in draw_moves:
        legal = connect4.legal_mask(pos)[0]
        if not legal.any():
            break
        col = c % 7
        while not legal[col]:
            col = (col + 1) % 7
        pos = connect4.play(pos, [col])
        out.append(col)
    return connect4.moves_to_text(out)


legal_moves = st.lists(st.integers(0, 6), max_size=42).map(_legal_moves)
bad_moves = st.one_of(
    text,
    st.text(alphabet="0123456789", max_size=50),  # column 0, 8, 9; too long
    st.text(alphabet="4", min_size=7, max_size=9),  # a full column
    legal_moves.map(lambda m: m + "8"),
    st.text(alphabet="1234567٤४߄", max_size=20),  # non-ASCII digits
    long_text,
)
moves = mostly(legal_moves, bad_moves, 1)

_cells_ok = legal_moves.map(lambda m: connect4.to_cells(connect4.parse_moves(m))[0].tobytes())
cells = st.one_of(
    _cells_ok,
    st.binary(max_size=100),
    st.lists(st.integers(0, 2), min_size=42, max_size=42).map(bytes),  # floating stones, bad counts, fours
    _cells_ok.flatmap(lambda b: st.integers(0, 41).map(lambda i: b[:i] + bytes([(b[i] + 1) % 4]) + b[i + 1:])),
)
boards = st.builds(
    search_pb2.Board,
    rows=mostly(st.just(6), u32, 3),
    columns=mostly(st.just(7), u32, 3),
    cells=cells,
)


@st.composite
def search_requests(draw, max_simulations: int = 64) -> search_pb2.SearchRequest:
    """SearchRequests, wrong in some fields and within ``max_simulations`` otherwise."""
    r = search_pb2.SearchRequest(
        game=draw(mostly(st.just("connect4"), st.one_of(text, st.sampled_from(["", "Connect4", "connect4\0", "chess"])), 3)),
        moves=draw(moves),
        simulations=draw(mostly(st.integers(1, max_simulations), st.one_of(st.just(0), u32))),
        deadline_ms=draw(mostly(st.sampled_from([0.0, 0.0, 1.0, 5.0]), f64)),
        phase=draw(mostly(st.integers(0, 3), i32)),
        session_id=draw(mostly(st.sampled_from(["", "s1", "s2"]), st.one_of(text, long_text))),
        evaluator=draw(mostly(st.integers(0, 2), i32)),
        seed=draw(u64),
    )
    if draw(st.integers(0, 3)) == 0:
        r.board.CopyFrom(draw(boards))
    return r


# -- reward -----------------------------------------------------------------------------
DTYPES = list(reward_pb2.DataType.values())
_ITEMSIZE = {reward_pb2.DATA_TYPE_BOOL: 1, reward_pb2.DATA_TYPE_UINT8: 1, reward_pb2.DATA_TYPE_INT8: 1,
             reward_pb2.DATA_TYPE_INT32: 4, reward_pb2.DATA_TYPE_INT64: 8, reward_pb2.DATA_TYPE_FLOAT16: 2,
             reward_pb2.DATA_TYPE_FLOAT32: 4, reward_pb2.DATA_TYPE_FLOAT64: 8}
MAX_FUZZ_BYTES = 200_000  # keeps one example's tensor data small


def _nonfinite(dtype: int, count: int, draw) -> bytes:
    fmt = {reward_pb2.DATA_TYPE_FLOAT16: "<e", reward_pb2.DATA_TYPE_FLOAT32: "<f", reward_pb2.DATA_TYPE_FLOAT64: "<d"}[dtype]
    values = [draw(st.sampled_from([0.0, 1.0, math.nan, math.inf, -math.inf])) for _ in range(min(count, 8))]
    values += [0.0] * (count - len(values))
    return b"".join(struct.pack(fmt, v) for v in values)


@st.composite
def tensors(draw, name: str = "board", spec_shape: tuple[int, ...] = (2, 6, 7), dtype: int = reward_pb2.DATA_TYPE_UINT8,
            max_batch: int = 1024) -> reward_pb2.Tensor:
    """Tensors near a model input (``name``, [batch, *spec_shape], ``dtype``) and far from it."""
    t_name = draw(mostly(st.just(name), st.one_of(text, st.just(""), st.just(name + " ")), 3))
    t_dtype = draw(mostly(st.just(dtype), st.one_of(st.sampled_from(DTYPES), i32)))
    batch = draw(st.one_of(st.integers(1, 4), st.sampled_from([0, -1, max_batch, max_batch + 1, 2**31, -(2**63)])))
    shape = [batch, *spec_shape]
    if draw(st.integers(0, 2)) == 0:  # a wrong rank or dimension
        shape = draw(st.one_of(st.lists(i64, max_size=6), st.lists(st.integers(-2, 9), max_size=6)))
    item = _ITEMSIZE.get(t_dtype, 1)
    n = int(np.prod(shape, dtype=object)) if shape else 1
    right = n * item if 0 <= n * item <= MAX_FUZZ_BYTES else None
    how = draw(st.integers(0, 3))
    if right is not None and how <= 1:
        if t_dtype in (reward_pb2.DATA_TYPE_FLOAT16, reward_pb2.DATA_TYPE_FLOAT32, reward_pb2.DATA_TYPE_FLOAT64) and how == 1:
            data = _nonfinite(t_dtype, n, draw)
        else:
            data = bytes(draw(st.binary(min_size=min(right, 64), max_size=min(right, 64)))).ljust(right, b"\1")
    elif right is not None and how == 2:  # one byte short or long
        data = b"\0" * max(right + draw(st.sampled_from([-1, 1, item])), 0)
    else:
        data = draw(st.binary(max_size=300))
    return reward_pb2.Tensor(name=t_name, dtype=t_dtype, shape=shape, data=data)


@st.composite
def evaluate_requests(draw, model: str = "connect4_value", input_name: str = "board",
                      spec_shape: tuple[int, ...] = (2, 6, 7), dtype: int = reward_pb2.DATA_TYPE_UINT8,
                      max_batch: int = 1024, outputs: tuple[str, ...] = ("value", "policy_logits"),
                      other_models: tuple[str, ...] = ()) -> reward_pb2.EvaluateRequest:
    """EvaluateRequests for ``model`` (one input ``input_name`` of [batch, *spec_shape] ``dtype``)."""
    one = tensors(name=input_name, spec_shape=spec_shape, dtype=dtype, max_batch=max_batch)
    inputs = draw(st.one_of(
        st.lists(one, min_size=1, max_size=1),
        st.lists(one, max_size=3),  # none, or the input twice
    ))
    return reward_pb2.EvaluateRequest(
        model=draw(mostly(st.sampled_from((model, *other_models)), st.one_of(text, st.just("")), 3)),
        inputs=inputs,
        request_class=draw(mostly(st.integers(0, 2), i32)),
        output_names=draw(mostly(st.sampled_from([[], list(outputs[:1]), list(outputs)]),
                                 st.lists(st.one_of(text, st.sampled_from(outputs)), max_size=4))),
    )


# -- scheduler -----------------------------------------------------------------------------
SEARCH_KIND, REWARD_KIND = scheduler_pb2.SERVICE_KIND_SEARCH, scheduler_pb2.SERVICE_KIND_REWARD


@st.composite
def register_requests(draw) -> scheduler_pb2.RegisterRequest:
    return scheduler_pb2.RegisterRequest(
        kind=draw(mostly(st.sampled_from([SEARCH_KIND, REWARD_KIND]), i32)),
        instance=draw(mostly(st.sampled_from(["fuzz-0", "fuzz-1"]), st.one_of(text, long_text, st.just("a\nb")))),
        address=draw(mostly(st.sampled_from(["127.0.0.1:50052", "[::1]:9", "host-1:65535"]),
                            st.one_of(text, st.sampled_from(["127.0.0.1:0", "127.0.0.1:65536", ":80", "h:٣", "h:-1"])))),
        stream_priorities=draw(mostly(st.lists(st.integers(-5, 0), max_size=6), st.lists(i32, max_size=80))),
        memory_bytes=draw(mostly(st.integers(0, 1 << 20), u64)),
        pid=draw(u32),
    )


@st.composite
def load_reports(draw, lease_ids: st.SearchStrategy = text) -> scheduler_pb2.LoadReport:
    return scheduler_pb2.LoadReport(
        lease_id=draw(lease_ids), phase=draw(i32), search_depth=draw(u32), deadline_slack_ms=draw(f64),
        queue_age_ms=draw(f64), queue_depth=draw(u32), requests_per_s=draw(f64), memory_used_bytes=draw(u64),
    )


# -- raw wire bytes ---------------------------------------------------------------------------
@st.composite
def _mutate(draw, valid: bytes) -> bytes:
    b = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.integers(0, 4))
        i = draw(st.integers(0, len(b))) if b else 0
        if op == 0 and b:  # flip a byte
            i = min(i, len(b) - 1)
            b[i] ^= draw(st.integers(1, 255))
        elif op == 1:  # cut
            b = b[:i]
        elif op == 2:  # insert junk
            b[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == 3:  # a string/bytes field (any field number) holding invalid UTF-8
            field = draw(st.integers(1, 9))
            junk = draw(st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"a\xfe"]))
            b[i:i] = bytes([(field << 3) | 2, len(junk)]) + junk
        else:  # a length prefix that runs past the end
            b[i:i] = bytes([(draw(st.integers(1, 9)) << 3) | 2, 0x7F])
    return bytes(b)


def wire_bytes(structured: st.SearchStrategy) -> st.SearchStrategy:
    """Raw request bytes: valid messages from ``structured``, mutated; or any bytes."""
    valid = structured.map(lambda m: m.SerializeToString())
    return st.one_of(valid.flatmap(_mutate), st.binary(max_size=200), valid)
