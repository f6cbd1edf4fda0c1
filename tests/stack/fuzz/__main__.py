"""``python -m tests.stack.fuzz [--seconds S] [--target NAME ...] [--out PATH]``: a longer
fuzzing run than CI's, outside pytest (from the repository root).

``--engine atheris --target NAME``: the same target under atheris (libFuzzer,
coverage-guided) instead of hypothesis, where atheris is installed (``pip
install atheris``; optional, not needed by CI); extra arguments after ``--``
go to libFuzzer (e.g. ``-- corpus_dir -jobs=4``).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path

from .harness import BYTES_ADAPTERS, all_targets, run_all


def _atheris(name: str, seconds: float, libfuzzer_args: list[str]) -> int:
    import atheris  # optional

    target = next(t for t in all_targets() if t.name == name)
    adapt = BYTES_ADAPTERS.get(name, lambda data: data)
    atheris.instrument_all()  # coverage of everything loaded: our decoding and validation paths

    def one_input(data: bytes) -> None:
        target.call(adapt(data))

    # Seed corpus: valid messages from the target's strategy, so coverage starts past the parse.
    corpus = Path(tempfile.mkdtemp(prefix=f"tandem-fuzz-{name}-"))
    if name not in BYTES_ADAPTERS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(64):
                (corpus / f"seed{i}").write_bytes(target.strategy.example())
    atheris.Setup([sys.argv[0], f"-max_total_time={int(seconds)}", *libfuzzer_args, str(corpus)], one_input)
    atheris.Fuzz()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m tests.stack.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=None, help="total time (default: TANDEM_FUZZ_SECONDS or 20)")
    ap.add_argument("--target", action="append", choices=[t.name for t in all_targets()])
    ap.add_argument("--engine", choices=("hypothesis", "atheris"), default="hypothesis")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # lease expiries etc. are expected by the thousand
    if args.engine == "atheris":
        if not args.target or len(args.target) != 1:
            ap.error("--engine atheris fuzzes one --target per process")
        return _atheris(args.target[0], args.seconds or 60, extra)
    results = run_all(args.seconds, args.target)
    for r in results:
        print(f"{r.target:<18} {r.examples:>7} examples in {r.elapsed_s:>6.1f} s  {r.outcomes}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
