"""Reference game-engine client: docs/engine_integration.md as code, small
enough to port (C++, C#, Rust...). It uses only gRPC and the tandem.v1
messages, no other tandem module.

What it shows:

* one long-lived channel per server, with keepalive pings spaced above the
  server's ``keepalive_min_ping_interval_ms`` and gRPC's own reconnect backoff;
* a Handshake after connecting: the API version and revision it was written
  for, and the capabilities it needs;
* a deadline on every call: a frame's search gets the frame budget as its
  gRPC deadline and a search deadline a little shorter, so the server answers
  with its best move so far before the engine stops waiting;
* what to do on each status code (:data:`ACTIONS`): use the answer; fall back
  to the engine's own move for this frame; back off before calling again; or
  stop, because the request or the configuration is wrong.

Run it against a stack: ``python -m tandem.engine_client --search
127.0.0.1:50052 --frames 30 --fps 60``.
"""
from __future__ import annotations

import argparse
import enum
import random
import sys
import time
from dataclasses import dataclass

import grpc
import numpy as np
from tandem.v1 import contract_pb2, contract_pb2_grpc, reward_pb2, reward_pb2_grpc, search_pb2, search_pb2_grpc

from tandem.failover import Failover

API_VERSION = "tandem.v1"
API_REVISION = 4  # the tandem.v1 revision this client is written against (HandshakeResponse.api_revision)
KEEPALIVE_TIME_MS = 30_000  # a ping on an idle connection every 30 s (servers allow one per 10 s by default)
SEARCH_SHARE = 0.8  # of the frame budget, for the search itself; the rest is transport and margin
DEFAULT_SEARCH_ADDRESS = "127.0.0.1:50052"  # the search service's address in tandem's bundled config

#: What each tandem.v1 service is called in messages.
SERVICE_NAMES = {"tandem.v1.SearchService": "search service", "tandem.v1.RewardService": "reward service",
                 "tandem.v1.Scheduler": "scheduler"}


class Action(enum.Enum):
    USE = "use the answer"
    FALLBACK = "use the engine's own move for this frame; do not retry the frame"
    BACK_OFF = "fall back, and call again only after a backoff"
    FIX_REQUEST = "a bug in the request: log it and stop sending it"
    FIX_CONFIG = "a configuration problem (token, TLS, address): stop and report"


#: What an engine does on each status code (the table in docs/engine_integration.md).
ACTIONS = {
    grpc.StatusCode.OK: Action.USE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Action.FALLBACK,  # the frame's time ran out
    grpc.StatusCode.CANCELLED: Action.FALLBACK,  # the engine cancelled it itself
    grpc.StatusCode.UNAVAILABLE: Action.BACK_OFF,  # not reachable, restarting or stopping
    grpc.StatusCode.RESOURCE_EXHAUSTED: Action.BACK_OFF,  # queue or memory pool full: shed load
    grpc.StatusCode.ABORTED: Action.BACK_OFF,
    grpc.StatusCode.INTERNAL: Action.BACK_OFF,  # the server failed this one; it keeps serving
    grpc.StatusCode.UNKNOWN: Action.BACK_OFF,
    grpc.StatusCode.DATA_LOSS: Action.BACK_OFF,
    grpc.StatusCode.INVALID_ARGUMENT: Action.FIX_REQUEST,  # the message names the field
    grpc.StatusCode.NOT_FOUND: Action.FIX_REQUEST,  # unknown game, model or region
    grpc.StatusCode.FAILED_PRECONDITION: Action.FIX_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: Action.FIX_REQUEST,
    grpc.StatusCode.ALREADY_EXISTS: Action.FIX_REQUEST,
    grpc.StatusCode.UNIMPLEMENTED: Action.FIX_CONFIG,  # an older server: check the handshake's revision
    grpc.StatusCode.UNAUTHENTICATED: Action.FIX_CONFIG,
    grpc.StatusCode.PERMISSION_DENIED: Action.FIX_CONFIG,
}


class ContractError(RuntimeError):
    """The server does not speak what this client needs, or the call can never
    succeed as sent (FIX_REQUEST / FIX_CONFIG); the message says which."""


class WrongService(ContractError):
    """The server at the address serves other tandem services than the one asked for."""


class Backoff:
    """Exponential backoff with full jitter: after the n-th failure in a row,
    wait a random time in [0, min(max_s, initial_s * 2**n)] (seconds)."""

    def __init__(self, initial_s: float = 0.05, max_s: float = 5.0, rng: random.Random | None = None):
        self.initial_s, self.max_s, self._failures = initial_s, max_s, 0
        self._rng = rng or random.Random()
        self.until = 0.0  # time.monotonic() before which no call is made

    def failed(self) -> float:
        """Records a failure; returns the wait (s) before the next call."""
        wait = self._rng.uniform(0, min(self.max_s, self.initial_s * 2 ** self._failures))
        self._failures += 1
        self.until = time.monotonic() + wait
        return wait

    def succeeded(self) -> None:
        self._failures, self.until = 0, 0.0

    def waiting(self) -> bool:
        return time.monotonic() < self.until


@dataclass
class FrameMove:
    """One frame's answer: ``move`` (the game's notation) or None, which means
    the engine plays its own fallback; ``code`` is the call's status (OK also
    for a fallback taken without a call, during a backoff)."""

    move: str | None
    code: grpc.StatusCode
    called: bool  # False: skipped while backing off


def open_channel(address: str, token: str = "", root_certificates: bytes | None = None) -> grpc.Channel:
    """A channel with keepalive and reconnect backoff; TLS when
    ``root_certificates`` (PEM) are given, the bearer token on every call."""
    options = [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 5_000),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    if root_certificates is None:
        if token:
            raise ContractError("a token needs TLS: give root_certificates")
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(address, creds, options=options)


def handshake(ch: grpc.Channel, service: str, capabilities: tuple[str, ...] = (), timeout_s: float = 5.0,
              client: str = "tandem-reference-engine/1") -> contract_pb2.HandshakeResponse:
    """Checks that the server speaks tandem.v1 at revision >= API_REVISION,
    serves ``service`` and offers ``capabilities``, and that this client's
    keepalive is allowed.

    Raises:
        ContractError: any of those does not hold, or the call can never succeed (token, TLS).
        grpc.RpcError: UNAVAILABLE or DEADLINE_EXCEEDED (try again later).
    """
    try:
        reply = contract_pb2_grpc.ContractServiceStub(ch).Handshake(
            contract_pb2.HandshakeRequest(client=client), timeout=timeout_s, wait_for_ready=True)
    except grpc.RpcError as exc:
        if ACTIONS.get(exc.code()) in (Action.FIX_CONFIG, Action.FIX_REQUEST):
            raise ContractError(f"Handshake: {exc.code().name}: {exc.details()}") from None
        raise
    if reply.api_version != API_VERSION or reply.api_revision < API_REVISION:
        raise ContractError(f"server speaks {reply.api_version} revision {reply.api_revision}; "
                            f"this client needs {API_VERSION} revision >= {API_REVISION}")
    if service not in reply.services:
        found = [SERVICE_NAMES[s] for s in reply.services if s in SERVICE_NAMES] or list(reply.services)
        raise WrongService(f"found the {' and the '.join(found)} there, not the {SERVICE_NAMES.get(service, service)}")
    missing = [c for c in capabilities if c not in (*reply.services, *reply.capabilities)]
    if missing:
        raise ContractError(f"server lacks {missing} (services {list(reply.services)}, "
                            f"capabilities {list(reply.capabilities)})")
    if reply.keepalive_min_ping_interval_ms > KEEPALIVE_TIME_MS:
        raise ContractError(f"keepalive every {KEEPALIVE_TIME_MS} ms is closer than the server allows "
                            f"({reply.keepalive_min_ping_interval_ms} ms)")
    return reply


class EngineClient:
    """A game engine's side: one move per frame from the search service, and
    reward evaluations, with the policy of the module's docstring.

    Not thread-safe: one per game thread (channels may be shared by passing them in).
    """

    def __init__(self, search: grpc.Channel, reward: grpc.Channel | None = None, game: str = "connect4",
                 standby: grpc.Channel | None = None):
        """``standby``: a channel to the reward service's standby (the address in its
        ``ModelMetadata.runtime["standby_server"]``): evaluations go there while the
        reward service is down (tandem/failover.py)."""
        self._search = search_pb2_grpc.SearchServiceStub(search)
        self._reward = reward_pb2_grpc.RewardServiceStub(reward) if reward is not None else None
        self._evaluate = None if self._reward is None else Failover(
            self._reward.Evaluate.future,
            reward_pb2_grpc.RewardServiceStub(standby).Evaluate.future if standby is not None else None)
        self.game = game
        self.backoff = Backoff()

    def best_move(self, moves: str, frame_budget_ms: float, session_id: str = "") -> FrameMove:
        """The search's move for the position after ``moves`` within one frame.

        Raises:
            ContractError: FIX_REQUEST / FIX_CONFIG statuses (e.g. an illegal move sequence).
        """
        if self.backoff.waiting():
            return FrameMove(None, grpc.StatusCode.OK, called=False)
        request = search_pb2.SearchRequest(game=self.game, moves=moves, deadline_ms=frame_budget_ms * SEARCH_SHARE,
                                           session_id=session_id)
        try:
            reply = self._search.Search(request, timeout=frame_budget_ms / 1000.0)
        except grpc.RpcError as exc:
            self._on_failure("Search", exc)
            return FrameMove(None, exc.code(), called=True)
        self.backoff.succeeded()
        return FrameMove(reply.move, grpc.StatusCode.OK, called=True)

    def evaluate(self, model: str, inputs: dict[str, np.ndarray], timeout_s: float,
                 critical: bool = True) -> dict[str, np.ndarray] | None:
        """The model's outputs (name -> array) for a batch, or None to fall back.

        ``inputs``: input name -> array (first dimension the batch; a dtype the
        model takes, e.g. uint8 boards). Raises ContractError as :meth:`best_move`.
        """
        if self._reward is None:
            raise ContractError("no reward channel given")
        if self.backoff.waiting():
            return None
        request = reward_pb2.EvaluateRequest(
            model=model, inputs=[_tensor(name, a) for name, a in inputs.items()],
            request_class=reward_pb2.REQUEST_CLASS_CRITICAL if critical else reward_pb2.REQUEST_CLASS_BULK)
        try:
            reply = self._evaluate.future(request, timeout=timeout_s).result()
        except grpc.RpcError as exc:
            self._on_failure("Evaluate", exc)
            return None
        self.backoff.succeeded()
        return {t.name: np.frombuffer(t.data, _DTYPES[t.dtype]).reshape(tuple(t.shape)) for t in reply.outputs}

    def _on_failure(self, call: str, exc: grpc.RpcError) -> None:
        action = ACTIONS.get(exc.code(), Action.BACK_OFF)
        if action in (Action.FIX_REQUEST, Action.FIX_CONFIG):
            raise ContractError(f"{call}: {exc.code().name}: {exc.details()} ({action.value})") from None
        if action is Action.BACK_OFF:
            self.backoff.failed()


_DTYPES = {reward_pb2.DATA_TYPE_BOOL: np.bool_, reward_pb2.DATA_TYPE_UINT8: np.uint8, reward_pb2.DATA_TYPE_INT8: np.int8,
           reward_pb2.DATA_TYPE_INT32: "<i4", reward_pb2.DATA_TYPE_INT64: "<i8", reward_pb2.DATA_TYPE_FLOAT16: "<f2",
           reward_pb2.DATA_TYPE_FLOAT32: "<f4", reward_pb2.DATA_TYPE_FLOAT64: "<f8"}


def _tensor(name: str, array: np.ndarray) -> reward_pb2.Tensor:
    array = np.ascontiguousarray(array)
    code = next((c for c, d in _DTYPES.items() if np.dtype(d) == array.dtype.newbyteorder("<")), None)
    if code is None:
        raise ContractError(f"inputs[{name!r}]: dtype {array.dtype} has no tandem.v1 DataType")
    return reward_pb2.Tensor(name=name, dtype=code, shape=array.shape, data=array.astype(np.dtype(_DTYPES[code])).tobytes())


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line on stderr and exit code 2, as the tandem commands do."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def address_type(service: str, default: str):
    """An argparse type: HOST:PORT, a port in 1..65535 (``default``: ``service``'s
    address in the bundled config, for the message). The `tandem` commands take
    addresses through it too."""
    def parse(text: str) -> str:
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"the address needs HOST:PORT (the {service}'s default: {default}), "
                                             f"got {text[:200]!r}")
        return text
    return parse


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    """Plays --frames frames at --fps against the search service: each frame asks
    it for a move (the search's deadline: 80 % of the frame) and prints, at the
    end, how many frames fell back to the engine's own move."""
    p = _Parser(prog="python -m tandem.engine_client", description=main.__doc__)
    p.add_argument("--search", required=True, type=address_type("search service", DEFAULT_SEARCH_ADDRESS),
                   help=f"search service HOST:PORT (tandem up's default: {DEFAULT_SEARCH_ADDRESS})")
    p.add_argument("--game", default="connect4", help="a game the search service serves (ListGames; default connect4)")
    p.add_argument("--frames", type=_positive(int), default=30, help="frames to play, one Search each (default 30)")
    p.add_argument("--fps", type=_positive(float), default=60.0,
                   help="frame rate: a frame's budget is 1000 / fps ms, the Search's gRPC deadline (default 60)")
    args = p.parse_args(argv)
    try:
        return _play(args.search, args.frames, args.fps, args.game)
    except WrongService as exc:  # e.g. the reward service's port
        print(f"{p.prog}: {args.search}: {exc} (the search service's default address: {DEFAULT_SEARCH_ADDRESS})",
              file=sys.stderr)
    except ContractError as exc:  # one line, as the tandem commands print theirs; exit 1
        print(f"{p.prog}: {exc}", file=sys.stderr)
    except grpc.RpcError as exc:
        hint = " (is the search service running at that address?)" if exc.code() in (
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else ""
        print(f"{p.prog}: {args.search}: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
    return 1


def _play(address: str, frames: int, fps: float, game: str = "connect4") -> int:
    budget_ms = 1000.0 / fps
    with open_channel(address) as ch:
        reply = handshake(ch, "tandem.v1.SearchService")
        print(f"server {reply.server_version}: {reply.api_version} revision {reply.api_revision}; "
              f"capabilities {', '.join(reply.capabilities)}")
        client, fallbacks, played, line = EngineClient(ch, game=game), 0, [], []
        for frame in range(frames):
            start = time.monotonic()
            # A stand-in for the engine's game, in any game's notation: the search plays itself
            # for 6 moves, from the start again every 7th frame (no game is over that soon).
            if frame % 7 == 0:
                line = []
            moves = "".join(line)
            answer = client.best_move(moves, budget_ms)
            if answer.move is None:
                fallbacks += 1  # the engine would play its own move this frame
                line = []
            else:
                played.append(f"{moves or '-'}:{answer.move}")
                line.append(answer.move)
            time.sleep(max(0.0, budget_ms / 1000.0 - (time.monotonic() - start)))
        print(f"{frames} frames, {fallbacks} fallbacks; position:move {' '.join(played[:7])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
