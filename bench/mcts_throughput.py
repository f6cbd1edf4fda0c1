"""mcts_throughput: simulations per second against parallelism, per variant.

Two sweeps, random rollouts (UCT), every tree rooted at the empty board:

1. parallel simulations in flight per tree (``parallel_sims``, virtual loss)
   64, 128, ..., 16384 at ``--sweep-trees`` trees (default one tree);
2. batch size 1, 2, 4, ..., 1024 trees at ``--batch-parallel-sims`` (256).

Each search runs ``max(--waves x parallel_sims, --min-simulations)``
simulations per tree (default max(4 K, 4096)). One warm-up call, then
``--repeats`` timed calls (device synchronised); ``sims_per_s`` = trees x
simulations / median call time (tree set-up and result included).

``l2_hit_rate`` (percent): for GPU rows of the parallel_sims sweep (``--ncu
all`` also the batch sweep), one search of the same trees and parallel_sims
(``min(simulations, max(4 K, 1024))`` simulations) run again in a child process
under ``ncu --metrics lts__t_sector_hit_rate.pct,gpu__time_duration.sum
--clock-control none --launch-count 300``; the main kernel is the kernel name
with the most GPU time among those launches (or ``--ncu-kernel REGEX``), and
the value its time-weighted mean hit rate (the kernel's name goes in
``l2_kernel``). Null for CPU rows, where ncu is missing, or where it fails (a
note says why).

CPU-reference rows are run only up to ``--cpu-max-sims`` simulations per call
(trees x simulations; default 2^18), so the sweep stays minutes long; larger
ones are skipped with a note. SearchParams caps ``parallel_sims`` (4096 in the
current code): rows past it are skipped with a note.

Row fields: variant, trees, parallel_sims, evaluator, sims_per_s, l2_hit_rate,
plus sweep (``parallel_sims`` or ``batch``), simulations (per tree),
call_ms_p50, repeats, l2_kernel.

Command (full): ``python3 -m bench.mcts_throughput``
Smoke test:     ``python3 -m bench.mcts_throughput --quick``
"""
from __future__ import annotations

import csv
import glob
import io
import os
import shutil
import subprocess
import sys

from bench import common
from stack.stats import percentiles

BENCHMARK = "mcts_throughput"
NCU_METRICS = "lts__t_sector_hit_rate.pct,gpu__time_duration.sum"
NCU_LAUNCHES = 300  # kernels profiled per row (each is replayed: keeps a row to seconds)


def measure(variant: str, trees: int, k: int, sims: int, evaluator: str, repeats: int) -> dict | None:
    """sims/s of one search of ``trees`` trees (None if the parameters are refused)."""
    kind, leaf_eval = common.evaluator_setup(evaluator)
    params = common.search_params(simulations=sims, parallel_sims=k, evaluator=kind, max_nodes=max(sims + 1, 2))
    if params is None:
        return None
    backend = common.make_backend(variant)
    roots = common.positions([""] * trees)
    ms = common.time_calls(lambda i: backend.search(roots, params, leaf_eval), repeats=repeats, warmup=1)
    p50, _ = percentiles(ms, 50, 99)
    return dict(
        variant=variant,
        trees=trees,
        parallel_sims=k,
        simulations=sims,
        evaluator=evaluator,
        sims_per_s=trees * sims / (p50 / 1e3),
        call_ms_p50=p50,
        repeats=repeats,
        l2_hit_rate=None,
        l2_kernel=None,
    )


# -- L2 hit rate through Nsight Compute ----------------------------------------


def find_ncu() -> str | None:
    """The ncu executable: on PATH, in /usr/local/cuda/bin, or under /opt/nvidia."""
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/usr/local/cuda-*/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def l2_hit_rate(
    ncu: str, variant: str, trees: int, k: int, sims: int, evaluator: str, kernel: str | None
) -> tuple[float | None, str | None]:
    """(time-weighted L2 hit rate % of the main kernel, its name) from one
    search in a child process under ncu; (None, None) with a note on failure.
    ``kernel``: a regex of the kernel names to profile (None: all)."""
    child = [sys.executable, "-m", "bench.mcts_throughput", "--ncu-child", variant, str(trees), str(k), str(sims), evaluator]
    cmd = [ncu, "--metrics", NCU_METRICS, "--clock-control", "none", "--csv", "--page", "raw"]
    cmd += ["--launch-count", str(NCU_LAUNCHES)] + (["--kernel-name", f"regex:{kernel}"] if kernel else [])
    cmd += child
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=common.REPO_ROOT, env=os.environ)
    except (OSError, subprocess.TimeoutExpired) as exc:
        common.note(f"ncu failed for {variant} trees={trees} parallel_sims={k}: {exc}")
        return None, None
    rate, kernel = parse_ncu_csv(res.stdout)
    if rate is None:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        common.note(f"ncu gave no L2 figure for {variant} trees={trees} parallel_sims={k} (rc {res.returncode}): {' | '.join(tail)}")
    return rate, kernel


def parse_ncu_csv(text: str) -> tuple[float | None, str | None]:
    """Main kernel's time-weighted hit rate from ``ncu --csv --page raw`` output."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"') and '"Kernel Name"' in line), None)
    if start is None:
        return None, None
    reader = csv.DictReader(io.StringIO("\n".join(line for line in lines[start:] if line.startswith('"'))))
    by_kernel: dict[str, list[float]] = {}  # name -> [time, time x hit rate]
    for rec in reader:
        try:
            t = float(rec["gpu__time_duration.sum"].replace(",", ""))
            hit = float(rec["lts__t_sector_hit_rate.pct"].replace(",", ""))
        except (KeyError, ValueError, AttributeError):
            continue  # the units row, or a kernel without the metric
        acc = by_kernel.setdefault(rec.get("Kernel Name", "?"), [0.0, 0.0])
        acc[0] += t
        acc[1] += t * hit
    if not by_kernel:
        return None, None
    name, (t, th) = max(by_kernel.items(), key=lambda kv: kv[1][0])
    return (th / t if t > 0 else None), name


def ncu_child(argv: list[str]) -> None:
    """The search that runs under ncu: one call, no output."""
    variant, trees, k, sims, evaluator = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    kind, leaf_eval = common.evaluator_setup(evaluator)
    params = common.search_params(simulations=sims, parallel_sims=k, evaluator=kind, max_nodes=max(sims + 1, 2))
    common.make_backend(variant).search(common.positions([""] * trees), params, leaf_eval)
    common.sync_cuda()


# -- the sweeps ----------------------------------------------------------------


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ncu-child"]:
        ncu_child(argv[1:])
        return []
    parser = common.make_parser(__doc__)
    parser.add_argument("--parallel-sweep", type=common.int_list, default=None, help="parallel_sims values (default 64..16384)")
    parser.add_argument("--sweep-trees", type=common.int_list, default=[1], help="trees for the parallel_sims sweep")
    parser.add_argument("--batch-sweep", type=common.int_list, default=None, help="tree counts (default 1..1024)")
    parser.add_argument("--batch-parallel-sims", type=int, default=None, help="parallel_sims of the batch sweep (256)")
    parser.add_argument("--waves", type=int, default=4, help="simulations per tree = max(waves x parallel_sims, --min-simulations)")
    parser.add_argument("--min-simulations", type=int, default=None, help="default 4096 (quick 64)")
    parser.add_argument("--evaluator", default="rollout", choices=["rollout", "zero"])
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 5; quick 2)")
    parser.add_argument("--cpu-max-sims", type=int, default=1 << 18, help="largest trees x simulations per CPU call")
    parser.add_argument("--ncu", choices=["none", "parallel", "all"], default=None, help="rows given an L2 hit rate (default parallel; quick none)")
    parser.add_argument("--ncu-kernel", default=None, help="regex of the kernel to read the L2 hit rate of (default: the one with most GPU time)")
    args = parser.parse_args(argv)
    q = args.quick
    par_sweep = args.parallel_sweep or (common.powers_of_two(4, 16) if q else common.powers_of_two(64, 16384))
    batch_sweep = args.batch_sweep or (common.powers_of_two(1, 4) if q else common.powers_of_two(1, 1024))
    batch_k = args.batch_parallel_sims or (8 if q else 256)
    min_sims = args.min_simulations or (64 if q else 4096)
    repeats = args.repeats or (2 if q else 5)
    ncu_mode = args.ncu or ("none" if q else "parallel")
    ncu = find_ncu() if ncu_mode != "none" else None
    if ncu_mode != "none" and ncu is None:
        common.note("ncu not found: l2_hit_rate is null")

    plan = [("parallel_sims", t, k) for t in args.sweep_trees for k in par_sweep]
    plan += [("batch", t, batch_k) for t in batch_sweep]
    rows = []
    for variant in common.chosen_variants(args.backend, q):
        cpu = variant == common.CPU_VARIANT
        for sweep, trees, k in plan:
            sims = max(args.waves * k, min_sims)
            if cpu and trees * sims > args.cpu_max_sims:
                common.note(f"{variant} trees={trees} parallel_sims={k}: {trees * sims} simulations per call > --cpu-max-sims, skipped")
                continue
            row = common.attempt(f"{variant} trees={trees} parallel_sims={k}", measure, variant, trees, k, sims, args.evaluator, repeats)
            if row is None:
                continue
            row = {"sweep": sweep, **row}
            if ncu and not cpu and (ncu_mode == "all" or sweep == "parallel_sims"):
                ncu_sims = min(sims, max(4 * k, 1024))
                row["l2_hit_rate"], row["l2_kernel"] = l2_hit_rate(ncu, variant, trees, k, ncu_sims, args.evaluator, args.ncu_kernel)
            common.progress(row)
            rows.append(row)
    common.finish(BENCHMARK, rows, args.out, ["variant", "sweep", "trees", "parallel_sims", "simulations", "sims_per_s", "l2_hit_rate"])
    return rows


if __name__ == "__main__":
    main()
