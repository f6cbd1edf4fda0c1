"""What every benchmark shares: arguments, the search variants, timing, and
the result file.

Result file (docs/design.md, "Benchmark results"; the field names are a contract):
``bench/results/<benchmark>.json`` (or ``--out DIR``) holding
``{"benchmark", "date", "gpu", "versions", "command", "rows"}``:

* ``date``, ``gpu``, ``versions`` (commit and clean tree included) and
  ``command``: :func:`tandem.provenance.record` (its docstring gives each);
* ``rows``: one dict per measurement, units in the field names.

Timing: :func:`time_calls` runs a callable ``warmup`` times untimed, then
``repeats`` times under ``time.perf_counter``, synchronising the CUDA device
after each call where CuPy is loaded (results of the search backends are host
objects already; the sync makes sure no queued kernel is left outside the
time). Latencies are reported as the median (p50) and the 99th percentile
(``stack.stats.percentiles``: NumPy's linear interpolation; with fewer than
100 repeats, p99 lies between the two slowest calls).
"""
from __future__ import annotations

import os

# The CPU reference is measured single-threaded: keep any BLAS NumPy may touch
# on one thread (set before NumPy is imported anywhere).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Iterable, Sequence  # noqa: E402

import numpy as np  # noqa: E402

from tandem import provenance  # noqa: E402
from tandem.gpu import cupy_module  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"

CPU_VARIANT = "cpu_reference"
GPU_VARIANTS = {"gpu_global_atomic": "global_atomic", "gpu_warp_aggregated": "warp_aggregated"}
ALL_VARIANTS = (CPU_VARIANT, *GPU_VARIANTS)


# -- arguments -----------------------------------------------------------------


def make_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes:
    ``--quick``, ``--backend`` and ``--out``."""
    parser = argparse.ArgumentParser(
        description=(doc or "").strip().splitlines()[0] if doc else None,
        epilog="See bench/README.md.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes for a smoke test (seconds); the backend defaults to cpu",
    )
    parser.add_argument(
        "--backend",
        default=None,
        help="comma list of: all, cpu, gpu, " + ", ".join(ALL_VARIANTS) + " (default: all; with --quick: cpu)",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"folder for the result file (default {RESULTS_DIR})")
    return parser


def int_list(text: str) -> list[int]:
    """``"1,16,64"`` -> ``[1, 16, 64]`` (for argparse ``type=``)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def float_list(text: str) -> list[float]:
    """``"1,1.5"`` -> ``[1.0, 1.5]`` (for argparse ``type=``)."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None


def powers_of_two(lo: int, hi: int) -> list[int]:
    """``lo, 2 lo, 4 lo, ..., hi`` (lo and hi powers of two)."""
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def note(message: str) -> None:
    """A line for whoever reads the run's output (skipped rows and why)."""
    print(f"note: {message}", flush=True)


FAILED: list[str] = []  # rows that raised (see attempt); finish() exits 1 if any


def attempt(label: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, or None when it raises: the error is printed
    (with its traceback) and remembered, so one failing row costs only itself
    and the other rows of an expensive run are still written."""
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported, and turned into the exit status
        traceback.print_exc()
        note(f"row FAILED, not written: {label}")
        FAILED.append(label)
        return None


def finish(benchmark: str, rows: list[dict], out_dir: Path | None, columns: Sequence[str]) -> None:
    """Writes the result file, prints the short table, and exits with status 1
    if any row failed."""
    write_results(benchmark, rows, out_dir)
    print_rows(rows, columns)
    if FAILED:
        print(f"{len(FAILED)} row(s) failed: {'; '.join(FAILED)}", flush=True)
        sys.exit(1)


# -- search variants -----------------------------------------------------------


def chosen_variants(backend: str | None, quick: bool) -> list[str]:
    """The variant names ``--backend`` asks for, in the order of ALL_VARIANTS,
    less the GPU ones where the CUDA backend cannot run here (a note says why).

    Raises:
        SystemExit: an unknown name.
    """
    names = set()
    for part in (backend or ("cpu" if quick else "all")).split(","):
        part = part.strip()
        if part == "all":
            names.update(ALL_VARIANTS)
        elif part == "cpu":
            names.add(CPU_VARIANT)
        elif part == "gpu":
            names.update(GPU_VARIANTS)
        elif part in ALL_VARIANTS:
            names.add(part)
        else:
            raise SystemExit(f"--backend: unknown {part!r}; use all, cpu, gpu or one of {', '.join(ALL_VARIANTS)}")
    wanted = [v for v in ALL_VARIANTS if v in names]
    if any(v in GPU_VARIANTS for v in wanted):
        from search_service.backends import cuda_available

        reason = cuda_available()
        if reason is not None:
            skipped = [v for v in wanted if v in GPU_VARIANTS]
            note(f"GPU rows skipped ({', '.join(skipped)}): {reason}")
            wanted = [v for v in wanted if v not in GPU_VARIANTS]
    return wanted


def make_backend(variant: str, sims_per_warp: int = 1):
    """A search backend for a variant name (see ALL_VARIANTS); a GPU variant
    runs ``sims_per_warp`` simulations of a wave per warp (the CPU reference
    always runs a tree's wave in order, as one warp)."""
    if variant == CPU_VARIANT:
        from search_service.mcts.cpu_reference import CpuReferenceBackend

        return CpuReferenceBackend()
    cuda = importlib.import_module("search_service.cuda")
    return cuda.CudaBackend(backup=GPU_VARIANTS[variant], sims_per_warp=sims_per_warp)


def search_params(**kwargs):
    """``SearchParams(**kwargs)``, or None with a note when the parameters are
    out of the range SearchParams accepts (e.g. parallel_sims past its limit)."""
    from search_service.mcts.backend import SearchParams

    kwargs.setdefault("deadline_ms", None)
    try:
        return SearchParams(**kwargs)
    except ValueError as exc:
        note(f"row skipped: SearchParams({', '.join(f'{k}={v}' for k, v in kwargs.items())}): {exc}")
        return None


def zero_evaluator(observations: np.ndarray) -> tuple[np.ndarray, None]:
    """A leaf evaluator that returns value 0 for every leaf and no priors
    (uniform): the search's own cost, with no model behind it."""
    return np.zeros(len(observations), np.float32), None


def evaluator_setup(name: str) -> tuple[str, Callable | None]:
    """``(SearchParams.evaluator, leaf evaluator)`` for a benchmark evaluator
    name: ``rollout`` (random rollouts, UCT) or ``zero`` (the value-model path,
    PUCT, with :func:`zero_evaluator`)."""
    if name == "rollout":
        return "rollout", None
    if name == "zero":
        return "value_model", zero_evaluator
    raise ValueError(f"unknown evaluator {name!r}: use rollout or zero")


def positions(moves: Sequence[str]):
    """A batch of Connect Four positions from move strings (``""`` = empty board)."""
    from search_service.games import connect4

    return connect4.stack([connect4.parse_moves(m) for m in moves])


# -- timing --------------------------------------------------------------------


def sync_cuda() -> None:
    """Waits for the CUDA device if CuPy is in use in this process and sees a GPU (else nothing)."""
    if "cupy" in sys.modules and _cupy_sees_a_gpu():
        sys.modules["cupy"].cuda.runtime.deviceSynchronize()


@functools.cache
def _cupy_sees_a_gpu() -> bool:
    """Asked once: sync_cuda runs inside timed regions (time_calls)."""
    return cupy_module() is not None


def time_calls(fn: Callable[[int], object], repeats: int, warmup: int = 1, sync: Callable[[], None] = sync_cuda) -> np.ndarray:
    """float64 [repeats]: wall-clock ms of ``fn(i)``, i = 0..repeats-1, after
    ``warmup`` untimed calls (i = -1, -2, ...), each followed by ``sync()``."""
    for w in range(warmup):
        fn(-1 - w)
        sync()
    out = np.empty(repeats)
    for i in range(repeats):
        t = time.perf_counter()
        fn(i)
        sync()
        out[i] = (time.perf_counter() - t) * 1e3
    return out


# -- the result file -------------------------------------------------------------


# The result's provenance (date, GPU, versions, commit) is tandem.provenance's: reports of
# `tandem play` and the soak record the same fields.
gpu_info, versions = provenance.gpu_info, provenance.versions


def write_results(benchmark: str, rows: list[dict], out_dir: Path | None = None, summary: dict | None = None) -> Path:
    """Writes ``<out_dir>/<benchmark>.json`` (see the module docstring; with
    ``summary``, figures over the rows) and returns its path."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": benchmark,
        **provenance.record(),
        "rows": rows,
        **({"summary": summary} if summary else {}),
    }
    path = out_dir / f"{benchmark}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path} ({len(rows)} rows)", flush=True)
    return path


def progress(row: dict) -> None:
    """One line per measured row, as it is measured."""
    print("  ".join(f"{k}={format_value(v)}" for k, v in row.items()), flush=True)


def print_rows(rows: Iterable[dict], columns: Sequence[str]) -> None:
    """A plain aligned table of ``columns`` of ``rows`` on stdout."""
    rows = list(rows)
    cells = [[format_value(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)), flush=True)


def format_value(v) -> str:
    """A short text for a table cell (floats to 3-4 significant digits)."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.3g}"
        if abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.4g}"
    return str(v)
