"""``tandem play``: the sample game engine.

For ``frames`` frames at ``fps`` it sends, per frame, one ``Search`` of a real
labelled Connect Four position (the frame budget as the search deadline) and
one ``Evaluate`` of the same position by the value model, both at once, and
then scores the answers against the solver:

* ``optimal_move_rate``: over positions the side to move does not lose, the
  share of searches whose move keeps the solver's result (a win stays a win,
  a draw a draw);
* ``best_score_move_rate``: over all positions, the share whose move has
  exactly the solver's best score;
* ``value_sign_agreement``: over all positions, the share where the value
  model's outcome (win if v > 1/3, loss if v < -1/3, else draw) is the
  solver's.

Frame latency runs from the frame's start to the later of the two answers; a
frame is missed when that exceeds ``1000 / fps`` ms.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from tandem.v1 import reward_pb2, reward_pb2_grpc, search_pb2, search_pb2_grpc

from search_service.games import connect4
from tandem import tensors
from tandem.positions import DEFAULT_SETS, LabelledPosition, load_set
from tandem.server import channel

DRAW_BAND = 1.0 / 3.0  # |value| below this reads as a draw
# The search's own deadline leaves this share of the frame for the RPCs and Evaluate.
SEARCH_SHARE_OF_FRAME = 0.6


@dataclass
class PlayOptions:
    search_address: str
    reward_address: str
    frames: int = 600
    fps: float = 60.0
    position_sets: tuple[str, ...] = DEFAULT_SETS
    simulations: int = 0  # 0: deadline only
    evaluator: str = "rollout"
    model: str = "connect4_value"
    seed: int = 1
    session_id: str = ""


def _outcome(x: float) -> int:
    return 1 if x > DRAW_BAND else (-1 if x < -DRAW_BAND else 0)


def _percentiles(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"p50": None, "p99": None, "mean": None, "max": None}
    return {
        "p50": round(float(np.percentile(a, 50)), 3),
        "p99": round(float(np.percentile(a, 99)), 3),
        "mean": round(float(a.mean()), 3),
        "max": round(float(a.max()), 3),
    }


def _phase(stones: int) -> int:
    if stones < 12:
        return search_pb2.GAME_PHASE_EARLY
    return search_pb2.GAME_PHASE_MID if stones < 28 else search_pb2.GAME_PHASE_LATE


def play(opts: PlayOptions, cfg=None, log=print) -> dict:
    """Plays ``opts.frames`` frames and returns the report (see module docstring).

    Raises:
        grpc.RpcError: ModelMetadata / ListGames failed before the first frame.
    """
    positions: list[LabelledPosition] = [p for name in opts.position_sets for p in load_set(name)]
    random.Random(opts.seed).shuffle(positions)
    budget_ms = 1000.0 / opts.fps
    evaluator = {"rollout": search_pb2.EVALUATOR_ROLLOUT, "value_model": search_pb2.EVALUATOR_VALUE_MODEL}[
        opts.evaluator
    ]
    search_ch, reward_ch = channel(opts.search_address, cfg), channel(opts.reward_address, cfg)
    search = search_pb2_grpc.SearchServiceStub(search_ch)
    reward = reward_pb2_grpc.RewardServiceStub(reward_ch)
    meta = reward.ModelMetadata(reward_pb2.ModelMetadataRequest(model=opts.model), timeout=10)
    input_name = meta.inputs[0].name

    latencies, sims, search_ms = [], [], []
    kept = not_lost = best = agree = 0
    errors: dict[str, int] = {}
    backends: set[str] = set()
    evaluators: set[str] = set()
    start = time.perf_counter()
    for k in range(opts.frames):
        # Frames are scheduled at a fixed rate; a late frame starts at once.
        delay = start + k * budget_ms / 1000.0 - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        pos = positions[k % len(positions)]
        obs = connect4.observation(connect4.parse_moves(pos.moves))
        t0 = time.perf_counter()
        s_call = search.Search.future(
            search_pb2.SearchRequest(
                game="connect4",
                moves=pos.moves,
                simulations=opts.simulations,
                deadline_ms=budget_ms * SEARCH_SHARE_OF_FRAME,
                phase=_phase(len(pos.moves)),
                evaluator=evaluator,
                seed=opts.seed * 1_000_003 + k + 1,
                session_id=opts.session_id,
            ),
            timeout=max(10 * budget_ms / 1000.0, 1.0),
        )
        e_call = reward.Evaluate.future(
            reward_pb2.EvaluateRequest(
                model=opts.model,
                inputs=[tensors.to_proto(input_name, obs)],
                output_names=["value"],
                request_class=reward_pb2.REQUEST_CLASS_CRITICAL,
            ),
            timeout=max(10 * budget_ms / 1000.0, 1.0),
        )
        try:
            s_reply, e_reply = s_call.result(), e_call.result()
        except grpc.RpcError as exc:
            errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
            continue
        latencies.append((time.perf_counter() - t0) * 1e3)
        sims.append(s_reply.simulations)
        search_ms.append(s_reply.latency.total_ms)
        backends.add(s_reply.backend)
        evaluators.add(search_pb2.Evaluator.Name(s_reply.evaluator))
        if pos.score >= 0:
            not_lost += 1
            kept += pos.keeps_result(s_reply.action)
        best += pos.is_best(s_reply.action)
        value = float(tensors.from_proto(e_reply.outputs[0]).reshape(-1)[0])
        agree += _outcome(value) == int(np.sign(pos.score))
        if log and (k + 1) % max(opts.frames // 10, 1) == 0:
            log(f"frame {k + 1}/{opts.frames}: p50 {np.percentile(latencies, 50):.2f} ms")
    search_ch.close()
    reward_ch.close()
    answered = len(latencies)
    return {
        "frames": opts.frames,
        "frames_answered": answered,
        "fps_target": opts.fps,
        "frame_budget_ms": round(budget_ms, 3),
        "positions": list(opts.position_sets),
        "optimal_move_rate": round(kept / not_lost, 4) if not_lost else None,
        "positions_not_lost": not_lost,
        "best_score_move_rate": round(best / answered, 4) if answered else None,
        "value_sign_agreement": round(agree / answered, 4) if answered else None,
        "frame_latency_ms": _percentiles(latencies),
        "search_latency_ms": _percentiles(search_ms),
        "missed_frames": int(sum(x > budget_ms for x in latencies)) + sum(errors.values()),
        "simulations_per_frame": {
            "mean": round(float(np.mean(sims)), 1) if sims else None,
            "p50": float(np.percentile(sims, 50)) if sims else None,
            "min": int(min(sims)) if sims else None,
        },
        "errors": errors,
        "backends": {
            "search": sorted(backends),
            "evaluator": sorted(evaluators),
            "reward_execution_provider": meta.execution_provider,
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def print_report(report: dict) -> None:
    lat = report["frame_latency_ms"]
    print(
        "\n".join(
            [
                f"frames                 {report['frames']} at {report['fps_target']:g} FPS "
                f"({report['frame_budget_ms']} ms budget), {report['frames_answered']} answered",
                f"optimal_move_rate      {report['optimal_move_rate']}  (over {report['positions_not_lost']} positions not lost)",
                f"best_score_move_rate   {report['best_score_move_rate']}",
                f"value_sign_agreement   {report['value_sign_agreement']}",
                f"frame_latency_ms       p50 {lat['p50']}  p99 {lat['p99']}  mean {lat['mean']}  max {lat['max']}",
                f"missed_frames          {report['missed_frames']}",
                f"simulations per frame  mean {report['simulations_per_frame']['mean']}  min {report['simulations_per_frame']['min']}",
                f"backends               search {', '.join(report['backends']['search'])} "
                f"({', '.join(report['backends']['evaluator'])}), reward {report['backends']['reward_execution_provider']}",
                f"errors                 {report['errors'] or 'none'}",
            ]
        )
    )


def write_report(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
