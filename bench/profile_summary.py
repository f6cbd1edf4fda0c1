"""profile_summary: where a server's interpreter time goes, from a py-spy
profile (``py-spy record -f raw``): each function's share of the samples
(inclusive: the function or anything it calls), commonest first.

With ``py-spy record --gil`` the samples are the moments a thread held the
interpreter lock, so the shares say what the one interpreter spends itself
on: the figure that bounds a Python service's calls a second.

Command: ``python3 -m bench.profile_summary FILE.raw [--top 40]``
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path


def shares(path: Path) -> tuple[int, list[tuple[str, float]]]:
    """(samples, [(function, share of the samples it appears in)]), largest first."""
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        for frame in set(stack.split(";")):
            inclusive[frame] += int(count)
    return total, [(f, n / total) for f, n in inclusive.most_common()] if total else []


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    for path in args.files:
        total, rows = shares(path)
        print(f"== {path} ({total} samples)")
        for frame, share in [r for r in rows if "threading.py" not in r[0]][: args.top]:
            print(f"{100 * share:5.1f} %  {frame}")


if __name__ == "__main__":
    main()
