"""Quick timing of the CUDA MCTS backend (the full benchmarks live elsewhere).

Measures, with random rollouts, on the GPU this runs on:

* latency: wall-clock ms of one ``search`` call (set-up, kernels, read-back:
  what the search service sees) for 1000 simulations of one tree, per backup
  strategy and work split (parallel_sims K, sims_per_warp G), p50 / p99 of
  ``--reps`` calls after warm-up, and the waves' part (the result's phase
  times: the rollout launch and its RES rows' copy back; the rest is the
  join and the answer, the trees' copies included);
* throughput: simulations per second of a batch of B trees (B = 1024 and a
  sweep of total parallel simulations B * K from 64 to 16384).

Usage: ``python bench/gpu_smoke.py [--out DIR] [--reps N]``; prints a table and
writes ``gpu_smoke.json`` (rows as in docs/design.md, "Benchmark results": ``mcts_latency`` /
``mcts_throughput``) to DIR. ``--sanitize`` instead runs a few small searches
through every kernel with CuPy's memory pool off, for
``compute-sanitizer --tool memcheck python bench/gpu_smoke.py --sanitize``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import cupy
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from search_service.cuda import BACKUPS, CudaBackend  # noqa: E402
from search_service.games import connect4 as c4  # noqa: E402
from search_service.mcts.backend import SearchParams  # noqa: E402
from stack.stats import percentiles  # noqa: E402


def positions(count: int) -> c4.Positions:
    """``count`` middle-game positions from Pons' Test_L2_R1 (repeated as needed)."""
    with open(ROOT / "data" / "connect4" / "pons" / "Test_L2_R1.jsonl") as f:
        moves = [json.loads(line)["moves"] for line in f]
    return c4.stack([c4.parse_moves(moves[i % len(moves)]) for i in range(count)])


def waves_ms(result) -> float:
    """ms of a search's waves (its phase times: a rollout search's are all in evaluate_ms)."""
    return result.select_ms + result.expand_ms + result.evaluate_ms + result.backup_ms


def timed(backend: CudaBackend, roots, params: SearchParams, reps: int, warm: int = 3):
    for _ in range(warm):
        backend.search(roots, params)
    walls, waves = [], []
    for i in range(reps):
        p = SearchParams(**{**params.__dict__, "seed": params.seed + i})
        t = time.perf_counter()
        results, _ = backend.search(roots, p)
        walls.append((time.perf_counter() - t) * 1e3)
        waves.append(max(waves_ms(r) for r in results))
    return np.array(walls), np.array(waves), results


def sanitize_workload() -> None:
    """Small searches of every kind: rollouts one warp and many warps per
    tree, pool exhaustion, re-rooting, the value-model halves. The CuPy pool
    is off so an access past an array leaves its allocation."""
    cupy.cuda.set_allocator(None)
    roots = positions(3)

    def model(obs):
        return np.zeros(len(obs), np.float32), np.ones((len(obs), 7), np.float32)

    for backup in BACKUPS:
        for k, g, max_nodes in ((1, 1, 200_000), (16, 1, 200_000), (8, 32, 5), (16, 1, 7)):
            be = CudaBackend(backup, sims_per_warp=g)
            p = SearchParams(simulations=300, deadline_ms=None, parallel_sims=k, max_nodes=max_nodes, seed=k)
            results, trees = be.search(roots, p)
            be.reroot(trees[0], results[0].principal_variation[:2])
        CudaBackend(backup, sims_per_warp=4).search(
            roots, SearchParams(simulations=64, deadline_ms=None, parallel_sims=8, evaluator="value_model"), model
        )
    cupy.cuda.Device().synchronize()
    print("sanitize workload done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sanitize", action="store_true", help="run the small memcheck workload and exit")
    args = ap.parse_args()
    if args.sanitize:
        sanitize_workload()
        return
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rows, table = [], []

    # -- latency: 1000 simulations of one tree ---------------------------------------------
    one = c4.stack([c4.parse_moves(""), positions(1)])
    for root_name, roots in (("empty board", c4.take(one, 0)), ("Test_L2_R1[0]", c4.take(one, 1))):
        for backup in BACKUPS:
            for k, g in ((1, 1), (8, 1), (16, 1), (32, 1), (64, 1), (128, 1), (16, 16), (32, 32), (64, 8)):
                be = CudaBackend(backup, sims_per_warp=g)
                p = SearchParams(simulations=1000, deadline_ms=None, parallel_sims=k, seed=1)
                wall, waves, res = timed(be, roots, p, args.reps)
                (wall_p50, wall_p99), (waves_p50,) = percentiles(wall, 50, 99), percentiles(waves, 50)
                row = dict(
                    variant=f"gpu_{backup}", trees=1, parallel_sims=k, sims_per_warp=g, simulations=1000,
                    evaluator="rollout", root=root_name, latency_ms_p50=wall_p50,
                    latency_ms_p99=wall_p99, waves_ms_p50=waves_p50,
                    tree_nodes=res[0].tree_nodes, max_depth=res[0].max_depth,
                )
                rows.append({"benchmark": "mcts_latency", **row})
                table.append(
                    f"latency  {root_name:14s} {backup:15s} K={k:<4d} G={g:<3d} p50 {row['latency_ms_p50']:7.3f} ms"
                    f"  p99 {row['latency_ms_p99']:7.3f}  waves {row['waves_ms_p50']:7.3f}"
                )
                print(table[-1], flush=True)

    # -- throughput --------------------------------------------------------------------------
    def throughput(b: int, k: int, g: int, backup: str, sims: int, reps: int = 5):
        roots = positions(b)
        be = CudaBackend(backup, sims_per_warp=g)
        p = SearchParams(simulations=sims, deadline_ms=None, parallel_sims=k, seed=3)
        wall, waves, _ = timed(be, roots, p, reps, warm=1)
        (wall_p50,), (waves_p50,) = percentiles(wall, 50), percentiles(waves, 50)
        rate = b * sims / (wall_p50 / 1e3)
        waves_rate = b * sims / (waves_p50 / 1e3)
        rows.append(
            dict(
                benchmark="mcts_throughput", variant=f"gpu_{backup}", trees=b, parallel_sims=k, sims_per_warp=g,
                simulations=sims, evaluator="rollout", sims_per_s=float(rate), waves_sims_per_s=float(waves_rate),
                wall_ms_p50=wall_p50, l2_hit_rate=None,
            )
        )
        table.append(
            f"through  B={b:<5d} K={k:<3d} G={g:<3d} {backup:15s} total={b * k:<6d} sims={sims:<5d} "
            f"{rate / 1e6:8.1f} M sims/s (waves {waves_rate / 1e6:8.1f})  wall {wall_p50:8.2f} ms"
        )
        print(table[-1], flush=True)

    for backup in BACKUPS:
        for k, g in ((1, 1), (4, 1), (16, 1), (16, 16), (32, 32)):
            throughput(1024, k, g, backup, 1000)
    for total in (64, 256, 1024, 4096, 16384):
        throughput(max(total // 16, 1), 16, 1, "warp_aggregated", 2048)
        throughput(total, 1, 1, "warp_aggregated", 512)

    args.out.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "gpu_smoke",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "versions": {"cupy": cupy.__version__, "numpy": np.__version__},
        "command": "python bench/gpu_smoke.py",
        "rows": rows,
    }
    (args.out / "gpu_smoke.json").write_text(json.dumps(out, indent=1))
    print("\n".join(["", f"== gpu_smoke on {gpu} =="] + table))


if __name__ == "__main__":
    main()
