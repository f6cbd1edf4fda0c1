"""Build the Connect Four position files shipped in ``data/connect4/``.

Three jobs, one subcommand each (run from the repository root, with the
project's Python, which has ``bitbully`` and ``bitbully-databases``)::

    # (a) copy-check and re-label Pascal Pons' raw test sets -> pons/*.jsonl
    python data/make_positions.py pons [--source DIR]
    # (b) compress the UCI compact CSV and copy its .names file -> uci/
    python data/make_positions.py uci --source DIR
    # (c) generate solver-labelled middle/end-game positions -> solver/
    python data/make_positions.py solver [--count 28000] [--seed 20261130]
    # (d) generate solver-labelled positions from the empty board -> walks/
    python data/make_positions.py walks --stones 5-11 --count 50000 \
        --seed 20261201 --out walks_05-11.jsonl.gz   (see data/README.md)

``DIR`` is a folder laid out like the public originals (``DIR/pons/Test_*``,
``DIR/uci/connect-4.shared90.csv``, ``DIR/uci/connect-4.names``); see
``data/README.md`` for where they come from. Nothing here reads outside the
repository unless ``--source`` is given. ``pons`` without ``--source`` re-labels
the raw files already in ``data/connect4/pons/``; ``solver`` reads only shipped
files (the compressed UCI CSV and the Pons JSONL files), so it can be re-run on
any checkout and gives the same bytes for the same seed and count.

Conventions (as in the source README): columns are 1-indexed (1..7) in move
strings, ``move_scores`` keys and ``best_moves``; scores follow Pascal Pons'
convention (for the side to move: ``22 - n`` when it wins with its n-th stone,
0 for a draw, ``n - 22`` when the opponent wins with its n-th stone).
``bitbully`` uses 0-indexed columns and the same score convention, so column
``c`` here is ``c - 1`` there.

Errors: every check that fails raises ``SystemExit`` with a message naming the
file and line (wrong checksum, a label that disagrees with the file, a move
string that does not replay).
"""
from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import io
import json
import random
import shutil
import sys
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_DIR / "data" / "connect4"
PONS_DIR = DATA_DIR / "pons"
UCI_DIR = DATA_DIR / "uci"
SOLVER_DIR = DATA_DIR / "solver"
WALKS_DIR = DATA_DIR / "walks"

# sha256 of the public originals (from the source README): a copy that differs
# is refused, so the shipped files always match the cited sources.
PONS_SHA256 = {
    "Test_L3_R1": "fae47639d993cc91f074d0b642a5f2bb251d31b15cea9df496d672c01fb2efec",
    "Test_L2_R1": "52b9ee96ab6e92fd755ca4c545792c07c548a5a994fd32beec2775939d071b3c",
    "Test_L1_R1": "003b7f5cc2b9b2d07ee2663cf92dfe99a50d7f4f57c556b6f35048e1bfaedb68",
    "Test_L1_R2": "ba3df3282804270661239d0fc357761a5c7cc31bbd581f3c502222abffa31113",
}
UCI_NAMES_SHA256 = "fd1c60618855cf6c5f4c2c05983707566ab414353d4ccc237b8fa372022ba009"
UCI_CSV = "connect-4.shared90.csv"
UCI_NAMES = "connect-4.names"
UCI_ROWS = 60801

SOLVER_FILE = "uci_random_walks.jsonl.gz"
SOLVER_MIN_STONES, SOLVER_MAX_STONES = 10, 38
SOLVER_COUNT = 28000
SOLVER_SEED = 20261130

ROWS, COLS = 6, 7


# ---------------------------------------------------------------- helpers

def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_gzip_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) gzip-compressed with no name and mtime 0, so the
    same text always gives the same bytes."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(text.encode("utf-8"))
    path.write_bytes(buf.getvalue())


def board_key(moves: str) -> str:
    """42-character key of the position reached by a 1-indexed move string.

    Cells in UCI attribute order (column-major, bottom row first): 'x' for the
    first player, 'o' for the second, 'b' for empty. Raises ValueError on an
    illegal move string (bad digit or full column)."""
    cols = [[] for _ in range(COLS)]
    for i, ch in enumerate(moves):
        c = int(ch) - 1
        if not 0 <= c < COLS or len(cols[c]) == ROWS:
            raise ValueError(f"illegal move {ch!r} at ply {i + 1} of {moves!r}")
        cols[c].append("x" if i % 2 == 0 else "o")
    return "".join("".join(col) + "b" * (ROWS - len(col)) for col in cols)


def mirror_key(key: str) -> str:
    """Key of the left-right mirrored position."""
    return "".join(key[ROWS * c: ROWS * (c + 1)] for c in reversed(range(COLS)))


def canonical_key(moves: str) -> str:
    """The smaller of a position's key and its mirror's: equal for mirror twins."""
    key = board_key(moves)
    return min(key, mirror_key(key))


def label(agent, moves: str) -> dict:
    """Solve one position with bitbully and return its JSONL record.

    ``moves`` is a 1-indexed move string of a position that is not finished.
    Returns ``{"moves", "score", "move_scores", "best_moves"}`` as in the Pons
    JSONL files: ``move_scores`` has keys "1".."7" (None for a full column),
    ``score`` is their maximum and ``best_moves`` the columns reaching it."""
    from bitbully import Board

    scores = agent.score_all_moves(Board([int(ch) - 1 for ch in moves]))
    if not scores:
        raise ValueError(f"no legal move in {moves!r}")
    move_scores = {str(c + 1): scores.get(c) for c in range(COLS)}
    best = max(scores.values())
    best_moves = [c + 1 for c in range(COLS) if scores.get(c) == best]
    return {"moves": moves, "score": best, "move_scores": move_scores, "best_moves": best_moves}


def outcome_counts(scores) -> tuple[int, int, int]:
    """(win, draw, loss) counts of scores for the side to move."""
    scores = list(scores)
    return (sum(s > 0 for s in scores), sum(s == 0 for s in scores), sum(s < 0 for s in scores))


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file, gzip-compressed when the name ends in .gz."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def show(path: Path) -> str:
    """A path for messages: relative to the repository root when inside it."""
    try:
        return str(path.resolve().relative_to(REPO_DIR))
    except ValueError:
        return str(path)


def fail(msg: str) -> None:
    raise SystemExit(f"make_positions: {msg}")


# ---------------------------------------------------------------- (a) pons

def cmd_pons(args) -> None:
    """Check each raw Pons file's checksum, solve every line with bitbully, check
    the solver agrees with the file's score, and write ``<name>.jsonl``."""
    from bitbully import BitBully

    src = Path(args.source) / "pons" if args.source else PONS_DIR
    PONS_DIR.mkdir(parents=True, exist_ok=True)
    agent = BitBully()
    for name, digest in PONS_SHA256.items():
        raw = src / name
        if sha256_of(raw) != digest:
            fail(f"{raw}: sha256 differs from the published file")
        if raw.resolve() != (PONS_DIR / name).resolve():
            shutil.copyfile(raw, PONS_DIR / name)
        t0 = time.perf_counter()
        lines = []
        for n, line in enumerate(raw.read_text().splitlines(), 1):
            moves, score = line.split()
            rec = label(agent, moves)
            if rec["score"] != int(score):
                fail(f"{raw}:{n}: solver score {rec['score']} != file score {score}")
            lines.append(json.dumps(rec) + "\n")
        out = PONS_DIR / f"{name}.jsonl"
        text = "".join(lines)
        same = out.exists() and out.read_text() == text
        out.write_text(text)
        w, d, l = outcome_counts(json.loads(x)["score"] for x in lines)
        print(f"{show(out)}: {len(lines)} positions, win/draw/loss "
              f"{w}/{d}/{l}, {time.perf_counter() - t0:.1f} s"
              f"{' (unchanged)' if same else ' (written)'}")


# ---------------------------------------------------------------- (b) uci

def check_uci_rows(text: str) -> list[dict]:
    """Parse the compact UCI CSV text and check each row is self-consistent.

    Checks: the move string replays to the row's board; the score is the max
    of the move scores; the score's sign matches the UCI label. Returns the
    rows as dicts (CSV header names)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    want = {"win": 1, "draw": 0, "loss": -1}
    for r in rows:
        if board_key(r["moves"]) != r["board"]:
            fail(f"UCI line {r['line']}: moves {r['moves']} do not give the board")
        move_scores = [int(r[f"s{c}"]) for c in range(1, 8) if r[f"s{c}"] != ""]
        score = int(r["score"])
        if score != max(move_scores) or (score > 0) - (score < 0) != want[r["label"]]:
            fail(f"UCI line {r['line']}: score/label inconsistent")
    return rows


def cmd_uci(args) -> None:
    """Copy ``connect-4.names`` unchanged and gzip the compact CSV."""
    src = Path(args.source) / "uci"
    names = src / UCI_NAMES
    if sha256_of(names) != UCI_NAMES_SHA256:
        fail(f"{names}: sha256 differs from the published file")
    text = (src / UCI_CSV).read_text(encoding="utf-8")
    rows = check_uci_rows(text)
    if len(rows) != UCI_ROWS:
        fail(f"{src / UCI_CSV}: {len(rows)} rows, expected {UCI_ROWS}")
    UCI_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(names, UCI_DIR / UCI_NAMES)
    out = UCI_DIR / f"{UCI_CSV}.gz"
    write_gzip_text(out, text)
    w, d, l = outcome_counts(int(r["score"]) for r in rows)
    print(f"{show(out)}: {len(rows)} rows, win/draw/loss {w}/{d}/{l}, "
          f"{out.stat().st_size} bytes (csv sha256 {hashlib.sha256(text.encode()).hexdigest()})")


# ---------------------------------------------------------------- (c) solver

def random_walk(rng: random.Random, start: str, stones: int) -> str | None:
    """Extend a 1-indexed move string with uniformly random legal moves until
    the board holds ``stones`` stones. Returns None when a move ends the game
    (a four-in-a-row; the board cannot fill before 42 stones), so callers get
    only unfinished positions."""
    from bitbully import Board

    board = Board([int(ch) - 1 for ch in start])
    moves = list(start)
    while len(moves) < stones:
        col = rng.choice(board.legal_moves())
        if board.can_win_next(col):
            return None
        board.play(col)
        moves.append(str(col + 1))
    return "".join(moves)


def generate(agent, rng: random.Random, count: int, stones: tuple[int, int], start,
             excluded: set, max_tries: int = 0) -> tuple[list[dict], int, int, float]:
    """Draw ``count`` new positions by random walks and label them with ``agent``.

    For each position: draw a target stone count uniformly in ``stones``
    (inclusive), then draw a start (``start(rng)``, a move string) and walk
    until one walk reaches the target without ending the game and gives a
    position that is neither in ``excluded`` nor already drawn (canonical
    keys: mirror images count as the same position). With ``max_tries`` > 0 a
    target that gives no new position in that many walks is drawn again (the
    few positions with 5-6 stones run out). Returns (records, walks,
    skipped, seconds spent labelling)."""
    records, seen = [], set()
    walks = skipped = 0
    t_solve, t0 = 0.0, time.perf_counter()
    while len(records) < count:
        target = rng.randint(*stones)
        tries = 0
        while True:
            walks += 1
            tries += 1
            if max_tries and tries > max_tries:
                moves = None
                break
            moves = random_walk(rng, start(rng), target)
            if moves is None:
                continue
            key = canonical_key(moves)
            if key in excluded or key in seen:
                skipped += 1
                continue
            break
        if moves is None:
            continue
        seen.add(key)
        t = time.perf_counter()
        records.append(label(agent, moves))
        t_solve += time.perf_counter() - t
        if len(records) % 2000 == 0:
            print(f"  {len(records)} positions, {time.perf_counter() - t0:.0f} s", flush=True)
    return records, walks, skipped, t_solve


def pons_keys() -> set:
    """Canonical keys of every Pons position; SystemExit if none are shipped."""
    keys = set()
    for path in sorted(PONS_DIR.glob("*.jsonl")):
        keys.update(canonical_key(r["moves"]) for r in read_jsonl(path))
    if not keys:
        fail(f"no Pons JSONL files in {PONS_DIR}: run the pons step first")
    return keys


def read_uci_rows() -> list[dict]:
    """Rows of the shipped compressed UCI CSV (header names as keys)."""
    return list(csv.DictReader(io.StringIO(
        gzip.decompress((UCI_DIR / f"{UCI_CSV}.gz").read_bytes()).decode("utf-8"))))


def write_records(out: Path, records: list[dict], walks: int, skipped: int, t_solve: float,
                  t0: float) -> None:
    """Write labelled records as deterministic gzip JSONL and print a summary."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_gzip_text(out, "".join(json.dumps(r) + "\n" for r in records))
    w, d, l = outcome_counts(r["score"] for r in records)
    print(f"{show(out)}: {len(records)} positions, win/draw/loss "
          f"{w}/{d}/{l}; {walks} walks, {skipped} duplicates or excluded positions skipped; "
          f"labelling {1000 * t_solve / max(len(records), 1):.2f} ms/position "
          f"({t_solve:.0f} s), total {time.perf_counter() - t0:.0f} s")


def cmd_solver(args) -> None:
    """Generate ``count`` distinct positions (10..38 stones) by random walks
    from UCI openings and label them with bitbully; none is a Pons position."""
    from bitbully import BitBully

    uci_rows = read_uci_rows()
    t0 = time.perf_counter()
    records, walks, skipped, t_solve = generate(
        BitBully(), random.Random(args.seed), args.count, (SOLVER_MIN_STONES, SOLVER_MAX_STONES),
        lambda rng: rng.choice(uci_rows)["moves"], pons_keys())
    write_records(SOLVER_DIR / args.out, records, walks, skipped, t_solve, t0)


def parse_range(text: str) -> tuple[int, int]:
    """'A-B' -> (A, B) with 1 <= A <= B <= 41; argparse.ArgumentTypeError otherwise."""
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"stone range must look like 12-17, got {text!r}") from None
    if not 1 <= lo <= hi <= 41:
        raise argparse.ArgumentTypeError(f"stone range must lie in 1-41, got {text!r}")
    return lo, hi


def cmd_walks(args) -> None:
    """Generate ``count`` positions with a stone count in ``--stones`` by random
    walks from the empty board, label them with bitbully, write
    ``walks/<out>``. Excluded: every Pons position (the test sets), every UCI
    opening, every position of ``solver/*.jsonl.gz`` and of the
    ``walks/*.jsonl.gz`` files whose names sort before ``out`` (so no two files
    overlap and the bytes depend only on those files; mirror images count as
    the same position)."""
    from bitbully import BitBully

    out = WALKS_DIR / args.out
    excluded = pons_keys()
    excluded.update(canonical_key(r["moves"]) for r in read_uci_rows())
    earlier = sorted(SOLVER_DIR.glob("*.jsonl.gz")) + [
        path for path in sorted(WALKS_DIR.glob("*.jsonl.gz")) if path.name < out.name]
    for path in earlier:
        excluded.update(canonical_key(r["moves"]) for r in read_jsonl(path))
    t0 = time.perf_counter()
    records, walks, skipped, t_solve = generate(
        BitBully(), random.Random(args.seed), args.count, args.stones, lambda rng: "", excluded,
        max_tries=200)
    write_records(out, records, walks, skipped, t_solve, t0)


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pons", help="re-label raw Pons files and write pons/*.jsonl")
    p.add_argument("--source", help="folder with pons/Test_* (default: data/connect4/pons)")
    p.set_defaults(func=cmd_pons)
    p = sub.add_parser("uci", help="write uci/connect-4.shared90.csv.gz and connect-4.names")
    p.add_argument("--source", required=True, help="folder with uci/connect-4.shared90.csv")
    p.set_defaults(func=cmd_uci)
    p = sub.add_parser("solver", help="generate solver/uci_random_walks.jsonl.gz")
    p.add_argument("--count", type=int, default=SOLVER_COUNT)
    p.add_argument("--seed", type=int, default=SOLVER_SEED)
    p.add_argument("--out", default=SOLVER_FILE, help="file name inside data/connect4/solver/")
    p.set_defaults(func=cmd_solver)
    p = sub.add_parser("walks", help="generate walks/<out> from random walks from the empty board")
    p.add_argument("--stones", type=parse_range, required=True, help="stone-count range, e.g. 12-17")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out", required=True, help="file name inside data/connect4/walks/ (*.jsonl.gz)")
    p.set_defaults(func=cmd_walks)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
