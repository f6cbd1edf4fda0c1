"""SearchService: MCTS over gRPC.

One ``Search`` validates the request (game, position, budget), takes the
session's tree if the position continues that session's game, runs the
backend on a batch of one tree, and answers with the chosen action, root visit
counts, Q-values, root value, principal variation and a latency breakdown.

The games served are Connect Four and every folder of ``search.games``
(search_service/game_registry.py), all at once; each is searched by the
configured backend where it can (the CUDA kernels hold Connect Four's rules
only), else by the CPU reference (search_service/backends.py GameBackends),
and ListGames says which.

Each search launches on the CuPy stream of the stream priority the scheduler last
assigned (search_service/streams.py; taken at the start of the search, kept
to its end). A search that needs more device memory than the fixed pool
(``search.memory_pool_bytes``) fails with RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Gauge, Histogram
from tandem.v1 import scheduler_pb2, search_pb2, search_pb2_grpc

from search_service.backends import GameBackends, make_backend
from search_service import budget
from search_service.budget import search_deadline, search_deadline_ms
from search_service.evaluators import HANDOFF_GRPC, HandoffEvaluator
from search_service.game_registry import load_games
from search_service.leaf_cache import CachedEvaluator, EvaluationCache
from search_service.mcts import tree as tr
from search_service.mcts.backend import SearchParams
from search_service.sessions import Owners, SessionStore
from search_service.streams import StreamSet
from search_service.wave_loop import REFUSED, Job, Refused, Stopping, WaveLoop
from tandem import gpu, multiprocess_metrics, pools, workers
from tandem.workers import WorkerPlace
from tandem.config import TandemConfig
from tandem.deadline import Deadline
from tandem.errors import quote
from tandem.gpu import cupy_module, host_fact
from tandem.server import LATENCY_BUCKETS_S, channel
from tandem.service import Service, start_service
from tandem.startup import Phases

log = logging.getLogger(__name__)

SIMULATIONS = Histogram(
    "tandem_search_simulations", "Simulations per search (the bucket 0: answered from the root alone).",
    buckets=(0, 1, 10, 100, 300, 1e3, 3e3, 1e4, 1e5, 1e6)
)
STEP_SECONDS = Histogram(
    "tandem_search_step_seconds", "Time per search in each step (s).", ["step"], buckets=LATENCY_BUCKETS_S
)
# Under workers (tandem/workers.py) a gauge merges as its multiprocess_mode says: livesum for what the workers
# hold between them, liveall (a series a worker, label pid) for what the scheduler assigns each.
STREAM_PRIORITY = Gauge("tandem_search_stream_priority", "CUDA stream priority assigned by the scheduler.",
                        multiprocess_mode="liveall")
ACTIVE_STREAM_PRIORITY = Gauge("tandem_search_stream_priority_active", "CUDA stream priority searches launch on.",
                               multiprocess_mode="liveall")
POOL_BYTES = Gauge("tandem_search_pool_bytes", "CuPy memory pool: bytes in use and the fixed limit (0 = none).",
                   ["what"], multiprocess_mode="livesum")
EXHAUSTED = Counter("tandem_search_pool_exhausted", "Searches refused because the memory pool was full.")
SESSIONS = Gauge("tandem_search_sessions", "Sessions kept: with their trees, or bound while a search holds the tree.",
                 multiprocess_mode="livesum")
SESSION_CONFLICTS = Counter("tandem_search_session_conflicts_total",
                            "Searches naming a session bound to another open connection of the same user "
                            "(answered from a fresh tree, not kept).")
SESSION_BYTES = Gauge("tandem_search_session_bytes", "Bytes the trees kept for reuse hold (search.max_session_bytes).",
                      multiprocess_mode="livesum")
CANCELLED = Counter(
    "tandem_search_cancelled", "Searches stopped early because their caller went away (cancel or deadline)."
)
# Each step's histogram child, looked up once (labels() costs µs a call, four a search).
_STEPS = [(f"{step}_ms", STEP_SECONDS.labels(step)) for step in ("select", "expand", "evaluate", "backup")]

MAX_SESSION_ID_CHARS = 256  # session ids are kept (max_sessions of them): bound their size

_EVALUATORS = {
    search_pb2.EVALUATOR_ROLLOUT: "rollout",
    search_pb2.EVALUATOR_VALUE_MODEL: "value_model",
}
_EVALUATOR_CODES = {v: k for k, v in _EVALUATORS.items()}
_PROVEN = {  # tree codes of a root's known result -> the response's
    tr.NOT_TERMINAL: search_pb2.PROVEN_RESULT_UNSPECIFIED,
    tr.PROVEN_WIN: search_pb2.PROVEN_RESULT_WIN,
    tr.PROVEN_LOSS: search_pb2.PROVEN_RESULT_LOSS,
    tr.PROVEN_DRAW: search_pb2.PROVEN_RESULT_DRAW,
}


ANSWER_GRACE_S = 10.0  # past its deadline, how long a caller waits for the wave loop before INTERNAL


@dataclass(eq=False)
class _Item:
    """One validated search of a call: its request, game, root position (Positions [1]),
    params, whether it continues its session's tree, that session's store key
    ((owner, session id), set with the tree where the caller's connection
    holds the session; None: no session to keep), that tree once taken, and
    its deadline once bound by the caller's (search_service/budget.py)."""

    request: search_pb2.SearchRequest
    game: object  # a SearchGame (search_service/mcts/games.py)
    position: object
    params: SearchParams
    reuse: bool
    session: tuple | None = None
    tree: object = None
    deadline: Deadline | None = None


def _response(item: _Item, r, handoff: str, backend: str, total_ms: float) -> search_pb2.SearchResponse:
    """The answer to one search: its result ``r`` in the request's game's notation."""
    game = item.game
    return search_pb2.SearchResponse(
        action=r.action,
        move=game.move_to_text(r.action),
        visit_counts=[int(v) for v in r.visit_counts],
        q_values=[float(q) for q in r.q_values],
        root_value=float(r.root_value),
        principal_variation=list(r.principal_variation),
        principal_variation_moves="".join(game.move_to_text(a) for a in r.principal_variation),
        simulations=r.simulations,
        latency=search_pb2.LatencyBreakdown(
            select_ms=r.select_ms, expand_ms=r.expand_ms, evaluate_ms=r.evaluate_ms,
            backup_ms=r.backup_ms, total_ms=total_ms,
        ),
        backend=backend,
        evaluator=_EVALUATOR_CODES[_evaluator_used(item.params, r)],
        max_depth=r.max_depth,
        tree_nodes=r.tree_nodes,
        tree_reused=r.tree_reused,
        pool_exhausted=r.pool_exhausted,
        deadline_reached=r.deadline_reached,
        model_simulations=r.model_simulations,
        handoff=handoff,
        evaluation_failure=r.evaluation_failure,
        proven=_PROVEN[r.proven],
    )


def _evaluator_used(params: SearchParams, r) -> str:
    """What valued the leaves: the value model if it valued any (``model_simulations``
    says how many), rollouts if it valued none."""
    return "value_model" if params.evaluator == "value_model" and r.model_simulations else "rollout"


class SearchServicer(search_pb2_grpc.SearchServiceServicer):
    """Thread safety: requests run concurrently; the backend is stateless per
    call, ``SessionStore`` guards its own table, and ``_lock`` guards the load
    figures reported to the scheduler."""

    def __init__(self, cfg: TandemConfig, backend, evaluator, streams: StreamSet | None = None, handoff=None,
                 games: dict | None = None):
        self.cfg = cfg.search
        self.games = games if games is not None else load_games(cfg.search.games)  # name -> SearchGame
        self.default_evaluator = default_evaluator(cfg.search.evaluator, backend.name)  # a request naming none
        # What reports the hand-off of the value model's leaves (``handoff``: "in_process" | "leaf_channel" | "grpc"):
        # the HandoffEvaluator inside the cache.
        self.handoff = handoff
        self.streams = streams or StreamSet(cfg.search.stream_priorities)
        self.loop = None
        self.evaluator = evaluator
        self.backend = backend  # and the wave loop, where it batches trees
        self.sessions = SessionStore(cfg.search.max_sessions, cfg.search.session_ttl_ms, cfg.search.max_session_bytes)
        self.owners = Owners()  # who a caller is, for its sessions
        self._lock = threading.Lock()
        self._load = {"phase": 0, "search_depth": 0, "deadline_slack_ms": 0.0, "served": 0}  # guarded by _lock
        self._since = time.monotonic()  # guarded by _lock
        self.cancelled = 0  # searches stopped because the caller went away (tests read it)

    @property
    def backend(self):
        """The search backend (one that batches trees across searches:
        ``open_batch``); setting it starts a wave loop for it."""
        return self._backend

    @backend.setter
    def backend(self, backend) -> None:
        self._backend = backend
        self.backends = GameBackends(backend, self.cfg.rollout_slice_ms or None)  # each game's
        if self.loop is not None:
            self.loop.close()
        # Every search in flight as one batch of trees; a value-model wave's leaves by a device
        # channel lent for it where the hand-off has one (HandoffEvaluator.lend).
        self.loop = WaveLoop(backend, self.evaluator, self.cfg.max_trees, self.cfg.wave_target_ms or None,
                             self.streams.launching, getattr(self.handoff, "lend", None),
                             backend_for=self.backends.for_game)

    @property
    def evaluator(self):
        """The leaf evaluator of value-model searches (the wave loop's too)."""
        return self._evaluator

    @evaluator.setter
    def evaluator(self, evaluator) -> None:
        self._evaluator = evaluator
        if getattr(self, "loop", None) is not None:
            self.loop.evaluator = evaluator

    def close(self) -> None:
        """Stops the wave loop (searches still in it fail)."""
        self.loop.close()

    # -- validation -------------------------------------------------------
    def _position(self, request, game, context, where: str = ""):
        """The request's position, a batch of one of ``game``'s; aborts
        INVALID_ARGUMENT naming the game and the cause where it is illegal."""
        try:
            position = game.parse_moves(request.moves)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}moves: not a legal {game.name} move string: {exc}")
        if request.HasField("board"):
            b = request.board
            try:
                from_board = game.from_cells(b.rows, b.columns, b.cells)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}board: {exc}")
            if request.moves and not game.same_position(position, from_board):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}board: does not match the position of moves")
            position = from_board
        if bool(game.is_terminal(position)[0]):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{where}position: the game is already over (won or drawn): a finished {game.name} position")
        return position

    def _params(self, request, game, context, where: str = "") -> SearchParams:
        cfg = self.cfg
        sims, deadline = request.simulations, request.deadline_ms
        if not math.isfinite(deadline) or deadline < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{where}deadline_ms: must be a finite number >= 0, got {deadline}")
        if sims == 0 and deadline == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}simulations, deadline_ms: set at least one budget")
        if sims > cfg.max_simulations:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{where}simulations: {sims} exceeds the limit of {cfg.max_simulations}"
            )
        if deadline > cfg.max_deadline_ms:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}deadline_ms: {deadline} exceeds the limit of {cfg.max_deadline_ms}"
            )
        # Never open-ended (search_service/budget.py); the caller's gRPC deadline bounds the
        # search's own Deadline, made in _answer from the instant the call was received.
        deadline = search_deadline_ms(deadline, None, cfg.max_deadline_ms)
        if request.evaluator not in (search_pb2.EVALUATOR_UNSPECIFIED, *_EVALUATORS):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}evaluator: unknown value {request.evaluator}")
        evaluator = _EVALUATORS.get(request.evaluator, self.default_evaluator)
        if evaluator == "value_model" and not game.value_model:
            if request.evaluator == search_pb2.EVALUATOR_VALUE_MODEL:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{where}evaluator: game {game.name} has no value model; ask for EVALUATOR_ROLLOUT "
                              f"or leave it unspecified")
            evaluator = "rollout"  # the default, for a game without a model
        return SearchParams(
            simulations=sims or None,
            deadline_ms=deadline,
            parallel_sims=cfg.value_model_parallel_sims if evaluator == "value_model" else cfg.parallel_sims,
            evaluator=evaluator,
            c_uct=cfg.c_uct,
            c_puct=cfg.c_puct,
            max_nodes=cfg.max_nodes,
            seed=request.seed or int.from_bytes(os.urandom(8), "little"),
            game=game,
        )

    def _prepare(self, request, context, where: str = "") -> _Item:
        """A validated request (``where``: its place in a batch call, for the messages); aborts otherwise."""
        game = self.games.get(request.game)
        if game is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"{where}game: unknown game {quote(request.game)} (games: {sorted(self.games)})")
        if len(request.session_id) > MAX_SESSION_ID_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{where}session_id: longer than {MAX_SESSION_ID_CHARS} characters")
        position = self._position(request, game, context, where)
        params = self._params(request, game, context, where)
        reuse = bool(request.session_id and request.moves and not request.HasField("board"))
        return _Item(request, game, position, params, reuse)

    # -- RPCs -------------------------------------------------------------
    def Search(self, request, context):
        received = time.monotonic()
        self._refuse_spent(context)
        return self._answer([self._prepare(request, context)], context, received)[0]

    def SearchBatch(self, request, context):
        received = time.monotonic()
        self._refuse_spent(context, max(len(request.searches), 1))
        searches, limit = request.searches, self.cfg.max_batch_searches
        if not searches:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"searches: empty; send 1 to {limit} positions")
        if len(searches) > limit:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"searches: {len(searches)} positions exceed the limit of {limit} (search.max_batch_searches)")
        games = sorted({s.game for s in searches})
        if len(games) > 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"searches: one game per call, got {', '.join(quote(g) for g in games)}")
        first: dict[str, int] = {}
        for i, s in enumerate(searches):
            if s.session_id and first.setdefault(s.session_id, i) != i:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"searches[{i}].session_id: {quote(s.session_id[:64])} is also searches"
                              f"[{first[s.session_id]}]'s (one search per session in a call)")
        items = [self._prepare(s, context, f"searches[{i}].") for i, s in enumerate(searches)]
        return search_pb2.SearchBatchResponse(results=self._answer(items, context, received))

    def _refuse_spent(self, context, searches: int = 1) -> None:
        """Aborts RESOURCE_EXHAUSTED, before the request is validated, a call
        (of ``searches`` searches) that arrives with no time left for a search
        (its gRPC deadline all reply margin: search_service/budget.py) while
        the service has searches in flight, of any game: its one wave would
        end past the caller's deadline, and admission would refuse it anyway
        where its own group is busy, after its positions were parsed and its
        trees taken; under overload most calls arrive so. With nothing in
        flight it goes on (a lone search gets its one wave). An invalid call
        so refused gets its INVALID_ARGUMENT only when sent with time left."""
        remaining = context.time_remaining()
        if remaining is None or not budget.spent(remaining):
            return
        busy = self.loop.in_flight()
        if busy:
            REFUSED.labels("spent").inc(searches)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the search service is at capacity: the call arrived with {max(remaining * 1e3, 0):.1f} ms "
                          f"left of its gRPC deadline, no more than its answer needs to travel back, with searches in "
                          f"flight ({busy}); send it with a longer deadline or fewer searches")

    def _answer(self, items: list[_Item], context, received: float) -> list:
        """Searches the validated ``items`` (their sessions' trees taken now,
        every deadline bound by the caller's and counted from ``received``,
        ``time.monotonic()`` s) and answers them in order."""
        caller = Deadline.of_grpc(context)
        # Sessions are the caller's own: another user naming the same id gets a session of its
        # own (a fresh tree), exactly as for an id nobody holds, and another open connection of
        # the same user naming it gets a fresh tree that is not kept (search_service/sessions.py).
        # Not an error status: an unknown id is no error, so any refusal would tell that the id
        # is someone's, and a refusal would let a client claim a predictable id ("engine-0")
        # before its user does and lock them out -- or lock out an engine that reconnected while
        # its old connection lingers. The search is answered either way.
        reuse = any(item.reuse for item in items)
        connection = context.peer() if reuse else ""  # only sessions ask (a few µs a call)
        who = self.owners(connection) if reuse else None
        for item in items:
            # The params carry the same budget, in ms from the receipt (what a backend's own search takes).
            budget_ms, item.deadline = search_deadline(item.params.deadline_ms, caller, self.cfg.max_deadline_ms,
                                                       received)
            item.params = dataclasses.replace(item.params, deadline_ms=budget_ms)
            if item.reuse:
                req = item.request
                key = (who, item.game.name, req.session_id)
                item.tree, holds = self.sessions.take(key, req.moves, self._rerooter(item), connection,
                                                      self.owners.gone)
                if holds:
                    item.session = key
                else:
                    SESSION_CONFLICTS.inc()
                    log.debug("session %s is bound to another open connection: a fresh tree, not kept",
                              quote(req.session_id))
        outs = self._run_in_loop(items, context)
        if not context.is_active():
            # Nobody is waiting for these answers: keep no tree, say why in the log.
            with self._lock:
                self.cancelled += len(items)
            CANCELLED.inc(len(items))
            log.debug("%d search(es) cancelled by the caller after %s simulations", len(items),
                      [r.simulations for r, _, _ in outs])
            context.abort(grpc.StatusCode.CANCELLED, "the caller went away")
        responses = []
        for item, (r, tree, handoff) in zip(items, outs):
            if r.evaluation_failure:
                # A wave cut off by the deadline is the anytime search working (debug); a model
                # that failed while time was left is worth a warning.
                (log.debug if r.deadline_reached else log.warning)(
                    "value model stopped after %d of %d simulations (%s): %s", r.model_simulations, r.simulations,
                    r.evaluation_failure, "answered from the tree" if r.deadline_reached else "went on with rollouts")
            if item.session is not None:
                if not self.sessions.put(item.session, item.request.moves, tree, connection):
                    log.debug("session tree not kept: larger than search.max_session_bytes, or the session "
                              "was bound to another connection meanwhile")
            total_ms = (time.monotonic() - received) * 1e3
            self._observe(item.request, r, total_ms)
            responses.append(_response(item, r, handoff, self.backends.for_game(item.game).name, total_ms))
        SESSIONS.set(len(self.sessions))
        SESSION_BYTES.set(self.sessions.nbytes)
        return responses

    def _rerooter(self, item: _Item):
        """``reroot(tree, extra)`` for the session of ``item``: along the
        actions of the extra moves where the game's notation splits them
        (``SearchGame.split_moves``), else at the item's position."""
        backend = self.backends.for_game(item.game)

        def reroot(tree, extra: str):
            actions = item.game.split_moves(extra)
            return backend.reroot(tree, actions) if actions is not None else backend.reroot_to(tree, item.position)

        return reroot

    def _run_in_loop(self, items: list[_Item], context) -> list[tuple]:
        """The items as jobs of the wave loop (one batch of trees with every search in flight)."""
        stop = lambda: not context.is_active()  # noqa: E731 - one callable: asked once a wave for all
        jobs = [Job(item.position, item.tree, item.params, stop, keep_tree=item.reuse, deadline=item.deadline)
                for item in items]
        try:
            self.loop.submit(jobs)
        except Stopping as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Refused as exc:
            for item in items:  # refused, not accepted: the sessions keep their trees
                if item.session is not None and item.tree is not None:
                    self.sessions.put(item.session, item.request.moves, item.tree, context.peer())
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        outs = []
        for job in jobs:
            wait_s = job.deadline.wait_s() + ANSWER_GRACE_S
            if not job.done.wait(wait_s):
                context.abort(grpc.StatusCode.INTERNAL, f"the wave loop gave no answer within {wait_s:.1f} s")
            if job.error is not None:
                self._abort_on(job.error, context)
            handoff = ""
            if job.params.evaluator == "value_model":
                handoff = getattr(self.handoff, "handoff", HANDOFF_GRPC)
            outs.append((job.result, job.out_tree, handoff))
        return outs

    def _abort_on(self, exc: BaseException, context) -> None:
        """Aborts with the status a search's failure maps to (RESOURCE_EXHAUSTED: the
        memory pool is full; UNAVAILABLE: the service is stopping); re-raises any
        other failure (INTERNAL)."""
        if isinstance(exc, Stopping):
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if not pools.is_out_of_memory(exc):
            raise exc
        EXHAUSTED.inc()
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"search memory pool full ({self.cfg.memory_pool_bytes or 'no'} byte limit): {exc}")

    def ListGames(self, request, context):
        return search_pb2.ListGamesResponse(games=[self.game_info(g) for _, g in sorted(self.games.items())])

    def game_info(self, game) -> search_pb2.GameInfo:
        """What ListGames says of ``game``: its shape, evaluators and backend."""
        evaluators = [search_pb2.EVALUATOR_ROLLOUT] + ([search_pb2.EVALUATOR_VALUE_MODEL] if game.value_model else [])
        return search_pb2.GameInfo(
            name=game.name, num_actions=game.num_actions, rows=game.rows, columns=game.columns,
            evaluators=evaluators, value_model=game.value_model, backend=self.backends.for_game(game).name,
            backend_note=self.backends.why_not_primary(game) or "", boards=game.boards,
        )

    # -- load for the scheduler --------------------------------------------
    def _observe(self, request, r, total_ms: float) -> None:
        SIMULATIONS.observe(r.simulations)
        for step, seconds in _STEPS:
            seconds.observe(getattr(r, step) / 1e3)
        with self._lock:
            self._load["phase"] = request.phase
            self._load["search_depth"] = r.max_depth
            if request.deadline_ms:
                self._load["deadline_slack_ms"] = request.deadline_ms - total_ms
            self._load["served"] += 1

    def set_stream_priority(self, stream_priority: int) -> int:
        """The scheduler's assignment: later searches launch on the held
        stream :meth:`StreamSet.assign` picks for ``stream_priority``.
        Returns the stream priority now in use."""
        active = self.streams.assign(stream_priority)
        STREAM_PRIORITY.set(stream_priority)
        ACTIVE_STREAM_PRIORITY.set(active)
        return active

    def load(self) -> dict:
        """LoadReport fields for the scheduler."""
        with self._lock:
            now = time.monotonic()
            served, self._load["served"] = self._load["served"], 0
            rate, self._since = served / max(now - self._since, 1e-3), now
            return {
                "phase": self._load["phase"],
                "search_depth": self._load["search_depth"],
                "deadline_slack_ms": self._load["deadline_slack_ms"],
                "requests_per_s": rate,
                "memory_used_bytes": pools.cupy_pool_use(self.streams.cupy)[0],
            }


def default_evaluator(choice: str, backend: str) -> str:
    """The evaluator of a request that names none: ``search.evaluator``
    (``choice``), whose ``auto`` is the value model where the search runs on
    the CUDA backend (``backend``: its name), which at a frame's 16 ms plays at
    least as well as rollouts on every bundled position set there
    (docs/benchmarks.md, "Where the targets stand"), and rollouts on the CPU,
    where the model values too few leaves in a frame."""
    if choice != "auto":
        return choice
    return "value_model" if backend.startswith("cuda") else "rollout"


def _warm_up(backends: GameBackends, games: dict, cfg: TandemConfig) -> None:
    """One short deadline search per game, on its backend, before SERVING:
    kernels compile and pools are allocated now, not in the first frame, and
    a game whose rules fail in a search stops the start here.

    Raises:
        RuntimeError: a game's first search failed (one line: the game and why).
    """
    for game in games.values():
        params = SearchParams(simulations=None, deadline_ms=5.0, parallel_sims=cfg.search.parallel_sims,
                              max_nodes=cfg.search.max_nodes, game=game)
        try:
            backends.for_game(game).search(game.parse_moves(""), params, None, [None])
        except Exception as exc:
            raise RuntimeError(f"game {game.label}: its first search failed: {type(exc).__name__}: {exc}") from exc


def start(cfg: TandemConfig, follow_scheduler: bool = True, place: WorkerPlace = WorkerPlace()) -> Service:
    """Starts the search service on ``cfg.search.address``, as process
    ``place`` of its workers (tandem/workers.py).

    Raises:
        RuntimeError: a folder of ``search.games`` does not load or its first
            search fails (one line naming the folder and the cause),
            ``backend: cuda`` cannot run here, or the address cannot be bound.
    """
    phases = Phases(log)
    gpu.set_host_wait(cfg.search.host_wait)  # before CuPy makes the device's context
    with phases.phase("games"):
        games = load_games(cfg.search.games)
    with phases.phase(f"search backend {cfg.search.backend}"):
        backend = make_backend(cfg.search.backend, cfg.search.rollout_slice_ms or None,
                               value_sims_per_warp=cfg.search.value_model_sims_per_warp)
    fact = host_fact(log)
    fact("search service: backend %s, default evaluator %s (search.evaluator: %s)", backend.name,
         default_evaluator(cfg.search.evaluator, backend.name), cfg.search.evaluator)
    # Streams and the pool limit only where the backend launches CUDA kernels.
    cupy = cupy_module() if backend.name.startswith("cuda") else None
    fact("search service: %s", pools.limit_cupy_pool(cupy, cfg.search.memory_pool_bytes))
    backends = GameBackends(backend, cfg.search.rollout_slice_ms or None)
    for game in games.values():
        why = backends.why_not_primary(game)
        fact("search service: game %s on %s%s%s", game.label, backends.for_game(game).name,
             f" ({why})" if why else "", "" if game.value_model else ", rollouts only (no value model)")
    with phases.phase("a first search per game (kernels, pools)"):
        _warm_up(backends, games, cfg)
    reward_address = cfg.search.reward_address or cfg.reward.address
    reward_channel = channel(reward_address, cfg)
    streams = StreamSet(cfg.search.stream_priorities, cupy)
    # Leaves: the cache answers what it can; a wave's rest (every tree of its batch) goes in one call.
    handoff = HandoffEvaluator(reward_channel, cfg.search.value_model, cfg.search.handoff,
                               max_rows=cfg.reward.leaf_channel.max_rows,
                               device_channels=cfg.search.device_channels, address=reward_address)
    evaluator = CachedEvaluator(handoff, EvaluationCache(cfg.search.evaluation_cache_bytes))
    servicer = SearchServicer(cfg, backend, evaluator, streams, handoff, games)
    multiprocess_metrics.set_function(POOL_BYTES.labels("used"), lambda: pools.cupy_pool_use(cupy)[0])
    multiprocess_metrics.set_function(POOL_BYTES.labels("limit"), lambda: pools.cupy_pool_use(cupy)[1])

    def register(server):
        search_pb2_grpc.add_SearchServiceServicer_to_server(servicer, server)
        return search_pb2.DESCRIPTOR.services_by_name["SearchService"].full_name

    service = start_service(
        cfg,
        kind=scheduler_pb2.SERVICE_KIND_SEARCH,
        address=cfg.search.address,
        metrics_port=cfg.search.metrics_port,
        server_cfg=cfg.search.server,
        register=[register],
        load_fn=servicer.load,
        on_assignment=lambda a: servicer.set_stream_priority(a.stream_priority),
        stream_priorities=list(streams.held),
        memory_bytes=cfg.search.memory_pool_bytes,
        follow_scheduler=follow_scheduler,
        capabilities=("search.sessions", "search.batch", "search.evaluator.rollout", "search.evaluator.value_model",
                      f"search.backend.{servicer.backend.name}"),
        place=place,
    )
    service.servicer = servicer
    servicer.owners.local_port = service.port  # from now on a caller's uid is one netlink lookup (tandem/peer.py)
    service.on_close = lambda: (servicer.close(), handoff.close(), reward_channel.close())
    return service


def serve(cfg: TandemConfig) -> None:
    """Runs the search service until SIGINT/SIGTERM, as ``search.workers``
    processes sharing its address (tandem/workers.py)."""
    workers.serve(cfg, cfg.search.workers, cfg.search.address, cfg.search.server.grace_period_ms,
                  "search_service.server:start")
