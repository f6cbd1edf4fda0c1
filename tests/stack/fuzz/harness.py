"""Runs the fuzz targets for a bounded time with hypothesis.

Each target gets a strategy (raw wire bytes built from valid messages by
flipping, cutting, splicing and invalid UTF-8, plus arbitrary bytes; or move
strings and boards for the game rules) and is run in batches of examples
until its time share is spent. Hypothesis shrinks any failure to a minimal
input and prints it; add that input to ``REGRESSIONS`` once fixed.
"""
from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tandem.v1 import reward_pb2, scheduler_pb2, search_pb2

from loadtest.reliability_figures import FuzzTargetFigures

from . import strategies as S
from . import targets as T

DEFAULT_SECONDS = 20.0  # all targets together, in CI
BATCH = 40  # examples per hypothesis run; the time budget is checked between runs


@dataclass(frozen=True)
class Target:
    name: str
    what: str  # the code under test
    strategy: st.SearchStrategy
    call: Callable[[Any], str]  # returns an outcome label; raises on a contract violation


def all_targets() -> list[Target]:
    fx = T.fixtures()
    return [
        Target("tensor_from_proto", "tandem.tensors.from_proto (Tensor parse + decode)",
               S.wire_bytes(S.tensors()), T.tensor_from_proto),
        Target("evaluate", "EvaluateRequest parse + ModelSession.decode + run (RewardServicer.Evaluate)",
               S.wire_bytes(S.evaluate_requests(max_batch=64)), lambda b: T.evaluate(b, fx)),
        Target("model_metadata", "ModelMetadataRequest parse + RewardServicer.ModelMetadata",
               S.wire_bytes(st.builds(reward_pb2.ModelMetadataRequest, model=S.mostly(st.just("connect4_value"), S.text))),
               lambda b: T.model_metadata(b, fx)),
        Target("parse_moves", "search_service.games.connect4.parse_moves",
               S.moves, T.parse_moves),
        Target("from_cells", "search_service.games.connect4.from_cells",
               S.boards, lambda b: T.from_cells(b.rows, b.columns, b.cells)),
        Target("search", "SearchRequest parse + SearchServicer.Search (validation, session, search, answer)",
               S.wire_bytes(S.search_requests(max_simulations=T.MAX_SIMULATIONS)), lambda b: T.search(b, fx)),
        Target("register", "RegisterRequest parse + scheduler.server.check_register + Register",
               S.wire_bytes(S.register_requests()), lambda b: T.register(b, fx)),
        Target("report_load", "LoadReport parse + policy.urgency + ReportLoad + Status",
               S.wire_bytes(S.load_reports()), lambda b: T.report_load(b, fx)),
    ]


# Inputs that once broke a target, or sit on an edge; each is run before the random ones.
REGRESSIONS: dict[str, list[Any]] = {
    "tensor_from_proto": [
        reward_pb2.Tensor(dtype=reward_pb2.DATA_TYPE_UINT8, shape=[2**62, 4]).SerializeToString(),  # product wraps to 0
        reward_pb2.Tensor(dtype=reward_pb2.DATA_TYPE_INT64, shape=[2**61, 8]).SerializeToString(),
        reward_pb2.Tensor(dtype=reward_pb2.DATA_TYPE_FLOAT32, shape=[]).SerializeToString(),
        reward_pb2.Tensor(dtype=99, shape=[1], data=b"\0").SerializeToString(),
        b"\x0a\x01\xff",  # name: invalid UTF-8
    ],
    "parse_moves": ["", "4" * 43, "٤", "0", "8", "44444444", "1212121", "4\0"],
    "register": [scheduler_pb2.RegisterRequest(kind=1, instance="x", address="h:٣").SerializeToString()],
}


def _moves_from_bytes(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _board_from_bytes(data: bytes) -> search_pb2.Board:
    rows, columns = (data[0], data[1]) if len(data) >= 2 else (6, 7)
    return search_pb2.Board(rows=rows, columns=columns, cells=data[2:])


#: How a bytes-only engine (atheris) feeds the targets that do not take bytes.
BYTES_ADAPTERS: dict[str, Callable[[bytes], Any]] = {"parse_moves": _moves_from_bytes, "from_cells": _board_from_bytes}


def seconds_budget() -> float:
    return float(os.environ.get("TANDEM_FUZZ_SECONDS", DEFAULT_SECONDS))


def run_target(target: Target, seconds: float) -> FuzzTargetFigures:
    """Runs ``target`` for about ``seconds``; returns its figures. Raises on a contract violation."""
    outcomes: collections.Counter = collections.Counter()

    def check(x):
        outcomes[target.call(x)] += 1

    for x in REGRESSIONS.get(target.name, []):
        check(x)

    @settings(max_examples=BATCH, deadline=None, database=None, derandomize=False,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck))
    @given(target.strategy)
    def batch(x):
        check(x)

    start = time.monotonic()
    runs = 0
    while True:
        batch()
        runs += 1
        if time.monotonic() - start >= seconds:
            break
    return FuzzTargetFigures(target=target.name, code=target.what, examples=sum(outcomes.values()),
                             elapsed_s=round(time.monotonic() - start, 2), outcomes=dict(sorted(outcomes.items())))


def run_all(seconds: float | None = None, names: list[str] | None = None) -> list[FuzzTargetFigures]:
    targets = [t for t in all_targets() if not names or t.name in names]
    share = (seconds_budget() if seconds is None else seconds) / max(len(targets), 1)
    return [run_target(t, share) for t in targets]
