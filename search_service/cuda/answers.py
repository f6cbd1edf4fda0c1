"""A wave's leaves to the value model and a search's RES rows to answers:
the host side of the CUDA batches of trees (tree_batch.py, game_batch.py)."""
from __future__ import annotations

from typing import Callable

import cupy
import numpy as np

from search_service.cuda import abi
from search_service.games import connect4
from search_service.games.connect4 import Positions
from search_service.mcts import tree as tr
from search_service.mcts.backend import best_action, model_answer
from tandem import nvtx

_RES_OFFSET = {f.name: f.offset for f in abi.RESULT.fields}  # RES field -> its first word
_RES_COUNTERS = ("nodes", "max_depth", "done", "exhausted", "deadline", "pv_length")  # one word each, in this order
_RES_NODES = _RES_OFFSET["nodes"]
assert [_RES_OFFSET[f] for f in _RES_COUNTERS] == list(range(_RES_NODES, _RES_NODES + len(_RES_COUNTERS)))


def model_values(evaluator, vin: np.ndarray, planes: np.ndarray, obs_dev, open_: np.ndarray, leader: np.ndarray,
                 wants_cupy: bool, roots: tuple[np.ndarray, np.ndarray] | None = None,
                 ) -> tuple[bool, np.ndarray | None]:
    """Fills the EVAL rows ``vin`` (abi.EVAL.dtype [n]) of a wave's open
    leaves (``open_`` bool [n]) from one call of ``evaluator`` (each distinct
    leaf once: its leader's row, ``leader`` int [n]; observations from
    ``planes`` uint8 [n, 2, 6, 7] on the host, or the OBS rows ``obs_dev`` on
    the device where ``wants_cupy``), which also values ``roots`` (current,
    mask: uint64 [R] each, positions waiting for their priors) after them.
    Returns has_priors and the roots' priors (float32 [R, A]; None: none
    given, or no roots).

    Raises:
        EvaluationFailed: the evaluator could not value the leaves.
    """
    n = len(vin)
    rows = np.flatnonzero(open_ & (leader == np.arange(n)))
    r = 0 if roots is None else len(roots[0])
    if rows.size + r == 0:
        return False, None
    obs = obs_dev[cupy.asarray(rows)].reshape(-1, 2, connect4.ROWS, connect4.COLUMNS) if wants_cupy else planes[rows]
    top = planes[rows, :, -1, :]  # uint8 [M, 2, A]: the top row of both stone planes
    legal = (top[:, 0] | top[:, 1]) == 0
    if r:
        root_obs = connect4.observation(Positions(roots[0], roots[1], connect4.popcount(roots[1])))
        obs = (cupy.concatenate([obs, cupy.asarray(root_obs)]) if wants_cupy
               else np.concatenate([obs, root_obs]))
        legal = np.concatenate([legal, connect4.legal_bits(roots[1])])
    with nvtx.span("search.evaluate"):
        values, priors = _model_answer(evaluator, obs, legal)
    m = rows.size
    by_slot = np.zeros(n, np.float32)
    by_slot[rows] = values[:m]
    vin["value"][open_] = by_slot[leader[open_]]
    root_priors = None if priors is None or not r else priors[m:]
    if priors is None or not m:
        return False, root_priors
    vin["priors"][rows] = priors[:m]
    return True, root_priors


def result_fields(res: np.ndarray, currents: np.ndarray, masks: np.ndarray,
                  root_priors: Callable[[np.ndarray], np.ndarray | None]) -> list[tuple[dict, bool]]:
    """The :class:`SearchResult` fields that M Connect Four trees' RES rows
    give (``res``: abi.RESULT.dtype [M]; ``currents``, ``masks``: uint64 [M],
    the roots' side to move's stones and occupied cells; ``root_priors(total)``:
    the roots' priors float32 [M, A] where a tree has no root visit at all,
    given the roots' visits int64 [M], else None), with whether its deadline
    stopped a warp of the tree, one pair per tree (:func:`game_result_fields`)."""
    return game_result_fields(res, connect4.legal_bits(masks), connect4.loses_at_once_bits(currents, masks),
                              root_priors)


def game_result_fields(res: np.ndarray, legal: np.ndarray, loses_at_once: np.ndarray | None,
                       root_priors: Callable[[np.ndarray], np.ndarray | None]) -> list[tuple[dict, bool]]:
    """As :func:`result_fields`, for any game's RES rows (``res``: a RES
    dtype [M], Connect Four's :mod:`.abi` or a game module's
    :class:`~.game_abi.GameAbi`), given the roots' legal actions (bool [M, A])
    and the actions that lose at once (bool [M, A], or None where the game
    does not say). Whole-batch arrays and lists first, in as few NumPy calls
    as may be: each costs the host a few µs while the caller waits for its
    answer, whatever M (docs/benchmarks.md)."""
    m = len(res)
    offset = {name: res.dtype.fields[name][1] // 4 for name in ("nodes", "pv")}
    words = res.view(np.int32).reshape(m, res.dtype.itemsize // 4)  # the RES rows as words
    visits = res["visits"].astype(np.int64)  # [M, A]
    value = res["value_sum"].astype(np.float64)
    q = np.where(visits > 0, value / np.maximum(visits, 1), 0.0)
    q32 = q.astype(np.float32)
    total = visits.sum(axis=1)  # [M]: the roots' completed simulations
    outcome = res["outcome"].astype(np.int8)  # [M, 1 + A]: the root's known result, then its children's
    proven = outcome[:, 0]
    root_value = np.where(proven != tr.NOT_TERMINAL, tr.OUTCOME_VALUE[proven],
                          value.sum(axis=1) / np.maximum(total, 1)).tolist()
    action = best_action(visits, q, legal, outcome[:, 1:], root_priors(total), loses_at_once).tolist()
    counters = words[:, offset["nodes"] : offset["nodes"] + len(_RES_COUNTERS)].tolist()  # [M][6]: _RES_COUNTERS
    pv = words[:, offset["pv"] : offset["pv"] + res.dtype.fields["pv"][0].shape[0]].tolist()
    proven = proven.tolist()
    return [
        (dict(action=action[i], visit_counts=visits[i], q_values=q32[i], root_value=root_value[i],
              principal_variation=pv[i][:pv_len], simulations=done, max_depth=depth, pool_exhausted=exhausted != 0,
              proven=proven[i]), deadline != 0)
        for i, (_, depth, done, exhausted, deadline, pv_len) in enumerate(counters)
    ]


def wave_slots(meta: np.ndarray, in_wave: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From a wave's META rows ([n]) and which slots are in it (bool [n]): the
    slots that ran a simulation (bool [n]), the trees whose root is not proven
    (bool [B]) and the slots whose leaf is unfinished (bool [n])."""
    terminal = meta["terminal"]
    ran = in_wave & (terminal != abi.NO_SIMULATION)
    return ran, ran.reshape(b, -1)[:, 0], ran & (terminal == tr.NOT_TERMINAL)


def _model_answer(evaluator, obs, legal: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Calls the evaluator on observations (uint8 [M, 2, 6, 7], NumPy or CuPy)
    and applies :func:`model_answer` (the reference's rules; ``legal`` bool
    [M, A]) to its answer, brought to the host.

    Raises:
        EvaluationFailed: the evaluator failed, or answered the wrong shape.
    """
    values, priors = evaluator(obs)
    return model_answer(cupy.asnumpy(values) if isinstance(values, cupy.ndarray) else values,
                        cupy.asnumpy(priors) if isinstance(priors, cupy.ndarray) else priors, legal)


def call_model(evaluator, current: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The model's answer for positions given as bitboards (fresh roots)."""
    pos = Positions(current, mask, connect4.popcount(mask))
    obs = connect4.observation(pos)
    if getattr(evaluator, "accepts_cupy", False):
        obs = cupy.asarray(obs)
    return _model_answer(evaluator, obs, connect4.legal_bits(mask))
