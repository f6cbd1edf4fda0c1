"""The reliability figures' schema: one dataclass per section of
docs/reliability.md, filled by the test that measures it.

A test fills its section (e.g. :class:`LimitsFigures`) and saves it with
:func:`save_figures` to ``RESULTS_DIR/<NAME>.json`` (``runs/reliability/``
unless ``TANDEM_RELIABILITY_DIR`` says otherwise), stamped with the date and
host; ``loadtest/reliability_report.py`` reads them back with
:func:`load_figures` and renders the tables.

Units are in the field names (``_ms``, ``_s``, ``_mib``); other numbers are
counts. Outcomes are gRPC status code names (``"OK"``, ``"UNAVAILABLE"``, ...)
unless a field says otherwise. A section whose parts come from separate tests
has a None for each part whose test did not run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from tandem.paths import REPO_ROOT

RESULTS_DIR = Path(os.environ.get("TANDEM_RELIABILITY_DIR", REPO_ROOT / "runs" / "reliability"))


@dataclass
class Figures:
    """A section's figures; ``NAME`` is its file's name (without ``.json``)."""

    NAME: ClassVar[str]


# -- bad input over gRPC (tests/stack/test_bad_input_properties.py) -------------------------------------
@dataclass
class RpcOutcomes:
    inputs: int  # malformed inputs sent to the RPC
    outcomes: dict[str, int]  # status code -> inputs answered with it


@dataclass
class BadInputFigures(Figures):
    NAME = "bad_input"
    examples_per_property: int  # hypothesis examples of each property
    rpcs: dict[str, RpcOutcomes]  # RPC name -> its outcomes


# -- fuzzing of request decoding (tests/stack/fuzz/) -----------------------------------------------------
@dataclass
class FuzzTargetFigures:
    target: str  # the target's name (tests/stack/fuzz/targets.py)
    code: str  # the code under test, in words
    examples: int  # inputs tried
    elapsed_s: float  # time spent on them
    outcomes: dict[str, int]  # status code, exception type or "decode_error" -> inputs


@dataclass
class FuzzFigures(Figures):
    NAME = "fuzz"
    budget_s: float  # the time budget shared by all targets
    targets: list[FuzzTargetFigures]


# -- limits (tests/stack/test_limits.py) -------------------------------------------------------------------
@dataclass
class FloodFigures:
    """Concurrent searches at a server admitting ``max_concurrent_rpcs`` RPCs."""

    search_deadline_ms: float  # each search's own deadline (its length)
    max_concurrent_rpcs: int
    max_workers: int  # the server's threads
    sent: int
    answered: int
    refused_resource_exhausted: int
    lost: int
    refused_latency_ms_max: float  # slowest refusal, from the flood's start
    answered_latency_ms_min: float
    answered_latency_ms_max: float
    health_probe_while_saturated: str  # "SERVING" or the probe's status code


@dataclass
class CancelFigures:
    """A client cancelling a search far too large to finish."""

    budget_simulations: int
    cancelled_after_ms: float  # from the search's start to the client's cancel
    stopped_after_cancel_ms: float  # from the cancel to the search's end
    simulations_done: int
    waves: int  # waves run before it stopped


@dataclass
class ClientDeadlineFigures:
    """A search with only the caller's gRPC deadline to bound it."""

    grpc_timeout_ms: int
    outcome: str  # the call's status code
    answered_after_ms: float
    search_deadline_ms: float  # the deadline the search gave itself from the gRPC one
    simulations_done: int


@dataclass
class WatchStreamsFigures:
    max_workers: int  # the scheduler's threads
    streams_admitted: int
    third_stream: str  # the status code of the next stream


@dataclass
class SessionsFigures:
    games: int  # games (sessions) played
    max_sessions: int
    kept_after_games: int  # sessions (trees) kept after them
    max_session_id_chars: int  # longer session ids are INVALID_ARGUMENT


@dataclass
class LimitsFigures(Figures):
    NAME = "limits"
    flood: FloodFigures | None = None
    cancel: CancelFigures | None = None
    client_deadline: ClientDeadlineFigures | None = None
    watch_streams: WatchStreamsFigures | None = None
    sessions: SessionsFigures | None = None


# -- faults (tests/stack/test_faults.py) ---------------------------------------------------------------------
@dataclass
class LoadFigures:
    """The open-loop load a test ran (loadtest/generator.py)."""

    engines: int
    fps: float
    simulations: int  # per search
    evaluator: str  # the searches' evaluator: "rollout" | "value_model"
    timeout_s: float  # every call's gRPC deadline
    duration_s: float


@dataclass
class RequestCounts:
    """One kind of request's outcomes; empty / None where the test did not record them."""

    sent: int
    answered: int
    refused: dict[str, int] = field(default_factory=dict)  # status code -> requests
    lost: int | None = None  # no answer past the deadline + 1 s
    evaluators: dict[str, int] = field(default_factory=dict)  # searches: evaluator used -> answers


@dataclass
class FaultFigures:
    killed: str  # the server SIGKILLed: "scheduler" | "reward" | "search"
    while_down: dict[str, RequestCounts]  # "search" / "evaluate" -> outcomes while it was down
    recovery_s: dict[str, float]  # milestone after the restart (e.g. "restart_to_serving") -> s


@dataclass
class FaultsFigures(Figures):
    NAME = "faults"
    outage_s: float  # how long each server stayed down
    load: LoadFigures
    faults: list[FaultFigures]
    totals: dict[str, RequestCounts]  # "search" / "evaluate" -> outcomes over the whole run


# -- soak (tests/stack/test_soak.py, loadtest/soak.py) ----------------------------------------------------------
@dataclass
class LatencyMs:
    """A latency distribution (``stack.stats.summary``), ms; None without samples."""

    p50: float | None
    p99: float | None
    max: float | None
    mean: float | None


@dataclass
class SoakRequests:
    """One kind of request over the soak (the generator's report, loadtest/generator.py)."""

    sent: int
    answered: int
    refused: dict[str, int]  # status code -> requests
    lost: int
    in_flight: int
    latency_from_schedule_ms: LatencyMs


@dataclass
class ServerSoakFigures:
    """One server process over the soak (loadtest/soak.py's sampler)."""

    rss_mib_start: float
    rss_mib_after_warmup: float
    rss_mib_end: float
    rss_mib_max: float
    rss_growth_mib: float  # end - after the warm-up
    rss_slope_mib_per_min: float  # least squares over the samples after the warm-up
    fds_after_warmup: int
    fds_end: int
    fds_max: int
    fds_growth: int
    threads_after_warmup: int
    threads_end: int
    threads_growth: int
    samples: int
    gpu_mib_after_warmup: float | None = None  # device memory, where NVML sees it
    gpu_mib_end: float | None = None
    gpu_mib_growth: float | None = None


@dataclass
class SoakFigures(Figures):
    NAME = "soak"
    duration_s: float
    warmup_s: float  # left out of the growth figures
    engines: int
    fps: float
    simulations: int  # per search
    evaluator: str  # "rollout" | "value_model"
    frames: bool  # Evaluate of a rendered 224x224 frame instead of the board
    stack_startup_s: float
    requests: dict[str, SoakRequests]  # "search" / "evaluate"
    servers: dict[str, ServerSoakFigures]  # server name -> its process
    server_exited_during_soak: str | None  # the server that exited early, if one did
    exit_codes: dict[str, int | None]  # server name -> exit code after the stop

    @classmethod
    def from_report(cls, report: dict) -> SoakFigures:
        """The figures of a ``loadtest.soak.run_soak`` report.

        Raises:
            KeyError / TypeError: ``report`` lacks a figure.
        """
        return from_json(cls, {**report, "duration_s": report["seconds"], "requests": report["load"]["requests"]})


# -- access (tests/stack/test_access.py) ----------------------------------------------------------------------
@dataclass
class LoopbackFigures:
    config: str  # the shipped config's path, from the repository root
    grpc_listeners: list[str]  # local addresses, hex as in /proc/net/tcp*
    metrics_listeners: list[str]


@dataclass
class MutualTlsFigures:
    outcomes: dict[str, str]  # client (certificate) -> status code
    search_to_reward: str  # the evaluator the search used over mutual TLS
    services_registered_with_scheduler: int


@dataclass
class TokenFigures:
    calls: dict[str, str]  # "RPC/token" (token "none" | "wrong" | "right") -> status code
    health_without_token: str  # the health check's status


@dataclass
class NoPickleFigures:
    files_checked: int  # serving code files
    hits: list[str]  # "path:what" of each pickle / eval / torch.load found


@dataclass
class KeepaliveFigures:
    server_min_ping_interval_ms: int
    flooder_ping_ms: int  # the flooding client's ping interval
    polite_ping_ms: int
    flooder_outcome: str  # "CODE: details" the flooder's stream ended with
    flooder_cut_after_s: float
    polite_connected_after_s: float


@dataclass
class AccessFigures(Figures):
    NAME = "access"
    loopback: LoopbackFigures | None = None
    tls: dict[str, str] | None = None  # client -> status code
    mutual_tls: MutualTlsFigures | None = None
    token: TokenFigures | None = None
    no_pickle_eval: NoPickleFigures | None = None
    keepalive: KeepaliveFigures | None = None


# -- files -------------------------------------------------------------------------------------------------------
@dataclass
class Host:
    cpus: int | None
    python: str  # version
    machine: str  # e.g. "x86_64"


@dataclass
class Stamp:
    """When and where a figures file was written."""

    date: str  # UTC, ISO 8601
    host: Host


F = TypeVar("F", bound=Figures)


def save_figures(figures: Figures) -> Path:
    """Writes ``figures`` with a :class:`Stamp` (now, this host) to
    ``RESULTS_DIR/<figures.NAME>.json``; returns the path.

    Raises:
        OSError: the directory or file could not be written.
    """
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{figures.NAME}.json"
    stamp = Stamp(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  Host(os.cpu_count(), platform.python_version(), platform.machine()))
    path.write_text(json.dumps({"name": figures.NAME, **asdict(stamp), **asdict(figures)}, indent=2) + "\n")
    return path


def load_figures(cls: type[F], directory: Path | None = None) -> tuple[Stamp, F] | None:
    """The stamp and figures of ``cls`` from ``directory`` (default ``RESULTS_DIR``);
    None when there is no such file.

    Raises:
        json.JSONDecodeError: the file is not JSON.
        KeyError / TypeError: it lacks a figure of the schema.
    """
    path = (RESULTS_DIR if directory is None else directory) / f"{cls.NAME}.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    return from_json(Stamp, doc), from_json(cls, doc)


def from_json(tp: Any, value: Any) -> Any:
    """``value`` (parsed JSON) as type ``tp``: dataclasses field by field (keys
    that are not fields are ignored), ``list[X]``, ``dict[str, X]`` and ``X | None``
    element by element; anything else as it is.

    Raises:
        KeyError: a dataclass field without a default is missing.
        TypeError: ``value`` is not a JSON object where a dataclass is expected.
    """
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{tp.__name__}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        fields = [f for f in dataclasses.fields(tp) if f.init]
        missing = [f.name for f in fields if f.name not in value
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise KeyError(f"{tp.__name__}: missing {', '.join(missing)}")
        return tp(**{f.name: from_json(hints[f.name], value[f.name]) for f in fields if f.name in value})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):  # X | None: value is not None here
        inner = [a for a in args if a is not type(None)]
        return from_json(inner[0], value) if len(inner) == 1 else value
    if origin is list:
        return [from_json(args[0], v) for v in value]
    if origin is dict:
        return {k: from_json(args[1], v) for k, v in value.items()}
    return value
