"""value_search_quality: a value network judged by the moves the search plays with it.

The search with the value model (PUCT, ``evaluator="value_model"``) at equal
simulations, on the CPU: the NumPy reference with the network in ONNX
Runtime's CPU provider. The served GPU search selects a wave's simulations in
order on one warp (``search.value_model_sims_per_warp: 32``, waves of 32),
the reference's order, so these rows stand for the GPU's moves at the same
number of simulations (at 16 ms per position it runs ~450-700 on the H200:
``neural_search``'s quality rows) -- up to the precision: the GPU serves the
network with an FP16 body, this runs it in FP32, so a value differs in its
third or fourth digit and a close choice may differ. The rows do not depend
on the machine's speed.

Sets: the validation openings (``data/connect4/validation``: held-out random
walks, see ``training/validation_openings.py``; choose networks by these) and
the four Pons sets (the test sets: report them, never choose by them). Only
positions not lost for the side to move count; ``optimal_move_rate`` is the
share whose move keeps the solver's result, as in ``search_quality``. Each
set is searched as one batch of trees, one model call per wave.

``--models a.onnx,b.onnx`` runs several networks in one run (rows per model;
compare them as differences of the same positions); ``--simulations`` and
``--c-puct`` take lists (a row per value). Row fields: model, model_sha256
(first 16 hex digits), backend (``cpu_reference``), provider (ONNX
Runtime's: ``cpu``, or ``cuda`` with ``--provider cuda``), position_set,
simulations, parallel_sims, c_puct, positions, optimal_move_rate, misses
(positions whose move gives the result away), missed (their move strings),
seconds.

Command (results): ``python3 -m bench.value_search_quality``
Smoke test:        ``python3 -m bench.value_search_quality --quick``
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np

from bench import common
from bench.search_quality import missed, rate
from search_service.mcts.backend import SearchParams
from training.connect4_data import BENCHMARK_PONS, TRAIN_PONS

BENCHMARK = "value_search_quality"
COLUMNS = ("model", "position_set", "simulations", "c_puct", "positions", "optimal_move_rate", "misses", "seconds")
MODEL = common.REPO_ROOT / "reward_service" / "models" / "connect4_value.onnx"
VALIDATION = common.REPO_ROOT / "data" / "connect4" / "validation" / "openings_05-14.jsonl"
PONS = (*TRAIN_PONS, *BENCHMARK_PONS)  # Test_L1_R1, Test_L1_R2, Test_L2_R1, Test_L3_R1


PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


def onnx_evaluator(path: Path, threads: int, provider: str = "cpu"):
    """A leaf evaluator (``search_service.mcts.backend.LeafEvaluator``) running
    the ONNX file ``path`` in ONNX Runtime (``provider`` "cpu" on ``threads``
    threads, or "cuda": the CUDA execution provider, FP32, for networks too
    large for a CPU): values float32 [N] and the policy's softmax as priors
    float32 [N, 7] (``search_service.evaluators.values_and_priors``, as the
    service).

    Raises:
        RuntimeError: "cuda" asked for and ONNX Runtime has no CUDA provider."""
    import onnxruntime as ort

    from search_service.evaluators import values_and_priors

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=PROVIDERS[provider])
    if session.get_providers()[0] != PROVIDERS[provider][0]:
        raise RuntimeError(f"ONNX Runtime {ort.__version__} has no {PROVIDERS[provider][0]} here")
    names = [o.name for o in session.get_outputs()]
    feed = session.get_inputs()[0].name

    def evaluate(obs: np.ndarray):
        return values_and_priors(dict(zip(names, session.run(None, {feed: obs}))))

    return evaluate


def quality_row(model: Path, sha256: str, provider: str, evaluate, set_name: str, recs, simulations: int,
                parallel_sims: int, c_puct: float) -> dict:
    """One row: every position of ``recs`` searched in one batched call
    (``sha256``: the first 16 hex digits of the model file's)."""
    from search_service.mcts.cpu_reference import CpuReferenceBackend

    params = SearchParams(simulations=simulations, deadline_ms=None, parallel_sims=parallel_sims,
                          evaluator="value_model", c_puct=c_puct, max_nodes=simulations + 1)
    t = time.perf_counter()
    results, _ = CpuReferenceBackend().search(common.positions([r.moves for r in recs]), params, evaluate)
    actions = [x.action for x in results]
    lost = missed(recs, actions)
    return dict(
        model=model.name,
        model_sha256=sha256,
        backend=common.CPU_VARIANT,
        provider=provider,
        position_set=set_name,
        simulations=simulations,
        parallel_sims=parallel_sims,
        c_puct=c_puct,
        positions=len(recs),
        optimal_move_rate=rate(recs, actions),
        misses=len(lost),
        missed=lost,
        seconds=time.perf_counter() - t,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    from tandem.config import DEFAULT_CONFIG, load_config
    from tandem.positions import load_set

    parser = common.make_parser(__doc__)
    parser.add_argument("--models", default=str(MODEL), help="comma list of ONNX files (default the shipped network)")
    parser.add_argument("--sets", default=",".join((str(VALIDATION), *PONS)),
                        help="comma list of labelled sets: bundled Pons names or JSONL paths")
    parser.add_argument("--simulations", type=common.int_list, default=[600], help="simulations per position")
    parser.add_argument("--parallel-sims", type=int, default=32, help="simulations per wave (the served 32)")
    parser.add_argument("--c-puct", type=common.float_list, default=None,
                        help="PUCT constants (default: the shipped config's search.c_puct)")
    parser.add_argument("--limit", type=int, default=None, help="first N scored positions per set (quick: 8)")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads")
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu",
                        help="where ONNX Runtime runs the network (the search stays the CPU reference)")
    args = parser.parse_args(argv)
    c_pucts = args.c_puct or [load_config(DEFAULT_CONFIG).search.c_puct]
    limit = 8 if args.quick and args.limit is None else args.limit
    sims = [50] if args.quick else args.simulations
    rows = []
    for model in map(Path, args.models.split(",")):
        evaluate = onnx_evaluator(model, args.threads, args.provider)
        sha256 = hashlib.sha256(model.read_bytes()).hexdigest()[:16]
        for set_name in args.sets.split(","):
            recs = [r for r in load_set(set_name) if r.score >= 0][:limit]
            label = Path(set_name).stem
            for n in sims:
                for c in c_pucts:
                    row = common.attempt(f"{model.name} {label} {n} {c}", quality_row, model, sha256, args.provider,
                                         evaluate, label, recs, n, args.parallel_sims, c)
                    if row:
                        common.progress(row)
                        rows.append(row)
    common.finish(BENCHMARK, rows, args.out, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
