"""``tandem play``: the sample game engine.

For ``frames`` frames at ``fps`` it sends, per frame, one ``Search`` of a real
labelled Connect Four position (the frame budget as the search deadline) and
one ``Evaluate`` of the same position by the value model, both at once, and
then scores the answers against the solver. With ``game`` another game the
search service serves (``tandem play --game othello``), the positions are
that game folder's position set (search_service/games/positions.py) or
another of its files (``--positions endgames.jsonl``), each frame is its
``Search`` alone (the game has no value model), and the answers are scored
where the set carries an exact solver's labels (a folder's endgames,
search_service/games/endgames.py); else the report has the frame figures,
the simulations and the proven results. With ``agents`` > 1 the frame's
search is one ``SearchBatch`` of that many positions (an engine with many
NPCs), each scored, and the Evaluate values the first:

* ``optimal_move_rate``: over positions the side to move does not lose, the
  share of searches whose move keeps the solver's result (a win stays a win,
  a draw a draw);
* ``best_score_move_rate``: over all positions, the share whose move has
  exactly the solver's best score;
* ``value_sign_agreement``: over all positions, the share where the value
  model's outcome (win if v > 1/3, loss if v < -1/3, else draw) is the
  solver's.

Frame latency runs from the frame's start (its Search leaving) to the later
of the two answers; a frame is missed when that exceeds ``1000 / fps`` ms.
Each call's gRPC deadline is the frame's end (the budget from the frame's
start, which is when its calls leave), as an engine sets it (the
search service fits the search into the time left; a call that cannot make
it fails DEADLINE_EXCEEDED, a missed frame); ``late_answers`` waits longer
instead, to see how late the answers come.
``request_latency_ms`` splits it by request (``search`` or ``search_batch``,
``evaluate``: sent to answered, answered frames), and ``search_phases_ms``
gives the search service's own select, expand, evaluate and backup ms per
search (its waves only, not its wait to join them). The pacing, requests
and timing are the engine's frame loop, stack/frame_loop.py.
"""
from __future__ import annotations

import json
import platform
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tandem.v1 import search_pb2

from stack import frame_loop, interrupt
from stack.frame_loop import FrameClient, SentFrame
from stack.stats import percentiles, summary
from search_service.games import connect4
from search_service.games.metadata import GameError, read_metadata
from search_service.games.positions import read_records
from tandem import provenance, tensors
from tandem.config import resolve_path
from tandem.positions import DEFAULT_SETS, LabelledPosition

DRAW_BAND = 1.0 / 3.0  # |value| below this reads as a draw
# The search's own deadline leaves this share of the frame for the RPCs and Evaluate.
SEARCH_SHARE_OF_FRAME = 0.6
INTERRUPT_POLL_S = 0.1  # how often a frame's wait looks for a Ctrl-C (s)

_REASON_CHARS = 100  # a failure reason is counted by its first characters, its times as "#"
_TIME = re.compile(r"(?<![\w.:])-?\d+(?:\.\d+)?(?= ?m?s\b)")  # "0.4 ms", "24.3 ms", "2 s"; not "host:50051"


def _reason(message: str) -> str:
    """A failure message as the report counts it: its times (the ms left, a
    wave's expected ms) as "#", so one cause is one count whatever the
    timing; its first characters."""
    return _TIME.sub("#", message)[:_REASON_CHARS]


@dataclass
class PlayOptions:
    search_address: str
    reward_address: str
    frames: int = 600
    fps: float = 60.0
    position_sets: tuple[str, ...] = DEFAULT_SETS
    simulations: int = 0  # 0: deadline only
    evaluator: str = "auto"  # "auto" (the search service's default), "rollout" or "value_model"
    model: str = "connect4_value"
    seed: int = 1
    session_id: str = ""
    agents: int = 1  # positions searched per frame; > 1: in one SearchBatch call
    game: str = connect4.NAME  # the game searched; another than Connect Four: position_sets is its set's file
    # False: each call's gRPC deadline is the frame's end (the budget from its send), as an engine sets
    # it: the server fits the search into what is left, a late call fails DEADLINE_EXCEEDED and the
    # loop goes on. True: calls wait up to ten frames (at least 1 s), to see how late answers come.
    late_answers: bool = False
    # The first frame's start, as a Unix time (s): engines started together begin their frames in
    # step, after every one's start-up (a game server's shared tick); None or past: at once.
    start_at: float | None = None


@dataclass(frozen=True)
class GamePosition:
    """A position of a game folder's set: its move string, no solver's label."""

    moves: str
    source: str
    score = None  # unlabelled: nothing is scored against a solver


def game_positions_file(games: tuple[str, ...], name: str) -> str:
    """The position set file of game ``name``, one of the folders ``games``
    (the config's ``search.games``).

    Raises:
        RuntimeError: no folder of ``games`` holds that game, or its game.yaml
            names no positions file (one line: what is there instead).
    """
    found = []
    for folder in games:
        try:
            meta = read_metadata(resolve_path(folder))
        except GameError:
            continue  # the search service refuses it at its start; here it only is not this game
        found.append(meta.name)
        if meta.name == name:
            if meta.positions is None:
                raise RuntimeError(f"game {meta.label}: its game.yaml names no positions file to play")
            return str(meta.positions)
    raise RuntimeError(f"--game {name}: not a game of search.games in the config "
                       f"(games: {', '.join([connect4.NAME, *found])})")


def _outcome(x: float) -> int:
    return 1 if x > DRAW_BAND else (-1 if x < -DRAW_BAND else 0)


@dataclass
class _Tally:
    """What the frames so far add up to: timings (ms), scores and failures."""

    frame_ms: list[float] = field(default_factory=list)  # answered frames only
    search_ms: list[float] = field(default_factory=list)  # the search service's own total
    phases_ms: list[tuple[float, float, float, float]] = field(default_factory=list)  # its select, expand, evaluate, backup
    request_ms: dict[str, list[float]] = field(default_factory=dict)  # answered frames' requests by kind: sent to answer
    simulations: list[int] = field(default_factory=list)
    not_lost: int = 0  # positions the side to move does not lose
    kept: int = 0  # ... whose move keeps the solver's result
    scored: int = 0  # searches scored against the solver (positions with its label)
    best: int = 0  # ... whose move has the solver's best score
    agree: int = 0  # value-model outcomes that are the solver's
    errors: dict[str, int] = field(default_factory=dict)  # failed frames by the first failure's code
    error_reasons: dict[str, int] = field(default_factory=dict)  # ... by "CODE: its message's first characters"
    backends: set[str] = field(default_factory=set)
    evaluators: set[str] = field(default_factory=set)
    handoffs: dict[str, int] = field(default_factory=dict)  # value-model frames by how the leaves went ("in_process" | "leaf_channel" | "grpc")
    model_simulations: list[int] = field(default_factory=list)  # of simulations, those the value model valued
    model_failures: int = 0  # searches whose value model failed (answered from the tree or with rollouts)
    failure_reasons: dict[str, int] = field(default_factory=dict)  # those searches by their failure's first words
    evaluated: int = 0  # frames whose Evaluate was answered (a game with a value model)
    proven: int = 0  # searches whose root the solver proved
    proven_right: int = 0  # ... with the solver's result (win, loss or draw)
    played: int = 0  # frames sent and waited for
    by_standby: int = 0  # answered frames whose Evaluate the reward service's standby answered
    interrupted: bool = False  # Ctrl-C ended the frames early: the report covers ``played``

    def score(self, positions: list[LabelledPosition], frame: SentFrame) -> bool:
        """Adds one frame's answers (or its failure); True if it was answered.
        ``positions``: the frame's, one per agent (its first: the Evaluate's)."""
        failed = frame.failed()
        if failed is not None:
            code = failed.code
            self.errors[code] = self.errors.get(code, 0) + 1
            reason = f"{code} ({failed.kind}): {_reason(failed.detail)}"
            self.error_reasons[reason] = self.error_reasons.get(reason, 0) + 1
            return False
        reply, *e_reply = frame.replies()
        self.frame_ms.append(frame_loop.frame_latency_ms(frame.records, since=frame.records[0].sent))
        for r in frame.records:
            self.request_ms.setdefault(r.kind, []).append((r.done - r.sent) * 1e3)
        for pos, s_reply in zip(positions, getattr(reply, "results", [reply])):
            self._score_search(pos, s_reply)
        if e_reply:  # the Evaluate, where the game has a value model
            value = float(tensors.from_proto(e_reply[0].outputs[0]).reshape(-1)[0])
            self.agree += _outcome(value) == int(np.sign(positions[0].score))
            self.evaluated += 1
        self.by_standby += any(r.server == "standby" for r in frame.records)
        return True

    def _score_search(self, pos: LabelledPosition, s_reply) -> None:
        """One agent's search answer, against the solver."""
        self.simulations.append(s_reply.simulations)
        self.search_ms.append(s_reply.latency.total_ms)
        lat = s_reply.latency
        self.phases_ms.append((lat.select_ms, lat.expand_ms, lat.evaluate_ms, lat.backup_ms))
        self.backends.add(s_reply.backend)
        self.evaluators.add(search_pb2.Evaluator.Name(s_reply.evaluator))
        self.model_simulations.append(s_reply.model_simulations)
        if s_reply.handoff:
            self.handoffs[s_reply.handoff] = self.handoffs.get(s_reply.handoff, 0) + 1
        if s_reply.evaluation_failure:
            self.model_failures += 1
            reason = _reason(s_reply.evaluation_failure)
            self.failure_reasons[reason] = self.failure_reasons.get(reason, 0) + 1
        self.proven += bool(s_reply.proven)
        if pos.score is None:  # unlabelled: no solver to score against
            return
        self.scored += 1
        if s_reply.proven:
            self.proven_right += _PROVEN_SIGN[s_reply.proven] == int(np.sign(pos.score))
        if pos.score >= 0:
            self.not_lost += 1
            self.kept += pos.keeps_result(s_reply.action)
        self.best += pos.is_best(s_reply.action)


_PROVEN_SIGN = {search_pb2.PROVEN_RESULT_WIN: 1, search_pb2.PROVEN_RESULT_LOSS: -1, search_pb2.PROVEN_RESULT_DRAW: 0}


def play(opts: PlayOptions, cfg=None, log=print) -> dict:
    """Plays ``opts.frames`` frames and returns the report (see module docstring).

    Raises:
        grpc.RpcError: ModelMetadata failed before the first frame.
        ValueError: ``opts.evaluator`` is none of "auto", "rollout" and "value_model";
            a position set file that is not one.
    """
    value_model_game = opts.game == connect4.NAME  # the value model's game, with solver-labelled sets
    if value_model_game:
        positions = frame_loop.shuffled_positions(opts.position_sets, opts.seed)
    else:
        positions = [_game_position(r, f"{path}:{i}") for path in opts.position_sets
                     for i, r in enumerate(read_records(path), 1)]
        random.Random(opts.seed).shuffle(positions)
    client = FrameClient(opts.search_address, opts.reward_address, cfg, model=opts.model)
    try:
        provider = (client.metadata().execution_provider if value_model_game
                    else "none (the game has no value model)")
        tally = _play_frames(opts, client, positions, log)
    finally:
        client.close()
    return _report(opts, tally, provider, solver=all(p.score is not None for p in positions))


def call_timeout_s(budget_ms: float, late_answers: bool = False) -> float:
    """A frame's calls' gRPC deadline (s from their send): the frame's budget,
    or, with ``late_answers``, ten frames and at least 1 s (PlayOptions)."""
    return max(10 * budget_ms / 1000.0, 1.0) if late_answers else budget_ms / 1000.0


def first_frame(start_at: float | None) -> float | None:
    """The first frame's start on the monotonic clock (s) for ``start_at``, a
    Unix time (s): now for a time already past; None (at once) for None."""
    if start_at is None:
        return None
    now = time.monotonic()
    return max(now + (start_at - time.time()), now)


def _game_position(record: dict, source: str) -> GamePosition | LabelledPosition:
    """A game folder set's record: labelled by an exact solver (endgames) or not."""
    if "score" in record:
        return LabelledPosition(record["moves"], record["score"], record["move_scores"], source)
    return GamePosition(record["moves"], source)


def _play_frames(opts: PlayOptions, client: FrameClient, positions: list[LabelledPosition], log) -> _Tally:
    """The frames at ``opts.fps``, each waited for before the next (a closed loop:
    a late frame starts at once); ``log`` (None: quiet) gets the p50 ten times."""
    budget_ms = frame_loop.frame_budget_ms(opts.fps)
    tally = _Tally()
    try:
        _frames(opts, client, positions, log, budget_ms, tally)
    except KeyboardInterrupt:  # Ctrl-C: the frames played so far still make a report
        tally.interrupted = True
    return tally


def _frames(opts: PlayOptions, client: FrameClient, positions: list[LabelledPosition], log, budget_ms: float,
            tally: _Tally) -> None:
    for tick in frame_loop.paced(opts.fps, frames=opts.frames, start=first_frame(opts.start_at)):
        interrupt.raise_if_interrupted()  # a Ctrl-C whose KeyboardInterrupt gRPC swallowed
        agents = [positions[(tick.frame * opts.agents + j) % len(positions)] for j in range(opts.agents)]
        evaluate = None
        if opts.game == connect4.NAME:  # the value model's game: its Evaluate beside the Search
            obs = frame_loop.board_observation(agents[0].moves)
            evaluate = lambda: obs  # noqa: E731
        moves = agents[0].moves if opts.agents == 1 else [p.moves for p in agents]
        frame = client.send(tick, moves, simulations=opts.simulations, evaluator=opts.evaluator,
                            seed=opts.seed * 1_000_003 + tick.frame + 1, session_id=opts.session_id,
                            deadline_ms=budget_ms * SEARCH_SHARE_OF_FRAME,
                            timeout_s=call_timeout_s(budget_ms, opts.late_answers), evaluate=evaluate,
                            game=opts.game)
        while not frame.wait(INTERRUPT_POLL_S):  # a Ctrl-C lost inside a gRPC callback still stops the wait
            interrupt.raise_if_interrupted()
        tally.score(agents, frame)
        tally.played += 1
        if log and (tick.frame + 1) % max(opts.frames // 10, 1) == 0:
            p50 = f"p50 {percentiles(tally.frame_ms, 50)[0]:.2f} ms" if tally.frame_ms else "none answered yet"
            log(f"frame {tick.frame + 1}/{opts.frames}: {p50}")


def _report(opts: PlayOptions, t: _Tally, reward_execution_provider: str, solver: bool) -> dict:
    """The report's figures (see the module docstring) from the frames' tally;
    ``solver``: every position carries a solver's labels."""
    budget_ms = frame_loop.frame_budget_ms(opts.fps)
    answered = len(t.frame_ms)
    return {
        **provenance.record(),  # date, gpu, versions (commit, clean tree), command: the run's provenance first
        "host": platform.node(),
        "game": opts.game,
        "solver": solver,
        "frames": t.played,
        "interrupted": t.interrupted,  # by Ctrl-C, after ``frames`` of the ``--frames`` asked for
        "frames_answered": answered,
        "fps_target": opts.fps,
        "frame_budget_ms": round(budget_ms, 3),
        "positions": list(opts.position_sets),
        "optimal_move_rate": round(t.kept / t.not_lost, 4) if t.not_lost else None,
        "positions_not_lost": t.not_lost,
        "agents": opts.agents,
        "best_score_move_rate": round(t.best / t.scored, 4) if t.scored else None,
        "value_sign_agreement": round(t.agree / t.evaluated, 4) if t.evaluated else None,
        "frame_latency_ms": summary(t.frame_ms),
        "search_latency_ms": summary(t.search_ms),
        "request_latency_ms": {kind: summary(ms) for kind, ms in sorted(t.request_ms.items())},
        "search_phases_ms": {name: summary(col) for name, col in
                             zip(("select", "expand", "evaluate", "backup"), zip(*t.phases_ms))} if t.phases_ms else {},
        "missed_frames": frame_loop.missed_frames(t.frame_ms, budget_ms) + sum(t.errors.values()),
        "simulations_per_frame": {
            "mean": round(float(np.mean(t.simulations)), 1) if t.simulations else None,
            "p50": percentiles(t.simulations, 50)[0],
            "min": int(min(t.simulations)) if t.simulations else None,
        },
        "model_simulations_per_frame": round(float(np.mean(t.model_simulations)), 1) if t.model_simulations else None,
        "value_model_failures": t.model_failures,
        "value_model_failure_reasons": t.failure_reasons,
        "proven": {"frames": t.proven, "solver_agrees": t.proven_right if solver else None},
        "errors": t.errors,
        "error_reasons": t.error_reasons,
        "backends": {
            "search": sorted(t.backends),
            "evaluator": sorted(t.evaluators),
            "handoff": t.handoffs,
            "evaluate_by_standby": t.by_standby,
            "reward_execution_provider": reward_execution_provider,
        },
    }


def _counts(by_name: dict[str, int]) -> str:
    return ", ".join(f"{name} ({n} frames)" for name, n in sorted(by_name.items()))


NO_SOLVER = "no solver's labels in this position set"


def _scores(report: dict) -> list[str]:
    """The lines that compare the answers with the solver's, or one line saying there is none."""
    if not report["frames_answered"]:
        return ["scores                 none answered"]
    if not report.get("solver", True):
        return [f"scores                 none: {NO_SOLVER} (optimal_move_rate, best_score_move_rate and "
                f"value_sign_agreement are None)"]
    return [f"optimal_move_rate      {report['optimal_move_rate']}  (over {report['positions_not_lost']} positions not lost)",
            f"best_score_move_rate   {report['best_score_move_rate']}",
            f"value_sign_agreement   {report['value_sign_agreement']}"]


def _proven(report: dict) -> str:
    proven = report["proven"]
    if proven["solver_agrees"] is None:
        return f"proven by the search   {proven['frames']} of the frames ({NO_SOLVER} to check them against)"
    return f"proven by the search   {proven['frames']} of the frames, {proven['solver_agrees']} as the solver"


def print_report(report: dict) -> None:
    lat = report["frame_latency_ms"]
    answered = report["frames_answered"] > 0
    none = "none answered"
    print(
        "\n".join(
            [
                f"game                   {report.get('game', connect4.NAME)}",
                f"frames                 {report['frames']} at {report['fps_target']:g} FPS "
                f"({report['frame_budget_ms']} ms budget), {report['frames_answered']} answered",
                *_scores(report),
                f"frame_latency_ms       p50 {lat['p50']}  p99 {lat['p99']}  mean {lat['mean']}  max {lat['max']}"
                if answered else f"frame_latency_ms       {none}",
                f"missed_frames          {report['missed_frames']}",
                f"simulations per frame  mean {report['simulations_per_frame']['mean']}  min {report['simulations_per_frame']['min']}"
                f"  (value model: {report['model_simulations_per_frame']}; its failures {report['value_model_failures']})"
                if answered else f"simulations per frame  {none}",
                _proven(report),
                f"backends               search "
                + (f"{', '.join(report['backends']['search'])} ({', '.join(report['backends']['evaluator'])})"
                   if report["backends"]["search"] else none)
                + f", reward {report['backends']['reward_execution_provider']}"
                + (f", leaves by {_counts(report['backends']['handoff'])}" if report["backends"]["handoff"] else "")
                + (f"; Evaluate by the standby in {report['backends']['evaluate_by_standby']} frames"
                   if report["backends"].get("evaluate_by_standby") else ""),
                f"errors                 {_counts(report['errors']) if report['errors'] else 'none'}",
                *([f"most common reason     {max(report['error_reasons'].items(), key=lambda kv: kv[1])[0]}"]
                  if report.get("error_reasons") else []),
            ] + _notes(report)
        )
    )


REPORT_DOC = "docs/report.md"  # where each line of the report is explained


def _notes(report: dict) -> list[str]:
    """Lines under the figures: why a CPU run misses frames, and where each line is explained."""
    notes = []
    # With no search answered the backends are unknown: this host having no GPU is the best guess there
    # (an engine on another host than the stack's may have none).
    on_cpu = (report["backends"]["reward_execution_provider"] == "CPUExecutionProvider"
              or "cpu_reference" in report["backends"]["search"]
              or (not report["backends"]["search"] and not report.get("gpu")))
    if report["missed_frames"] and on_cpu:
        notes.append("note: on the CPU some missed frames are expected: the search, the model and this engine share "
                     "the host's cores; the frame figures tandem is built for are measured on a GPU (README, Figures)")
    if report.get("interrupted"):
        notes.append(f"note: interrupted (Ctrl-C) after {report['frames']} frames; the figures cover those")
    return notes + [f"(each line is explained in {REPORT_DOC})"]


def write_report(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
