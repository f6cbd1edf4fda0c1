"""Train the Connect Four value/policy network, export it to ONNX, write its card.

    python -m training.train_connect4_value \
        --out reward_service/models/connect4_value.onnx

Steps: load the shipped solver-labelled positions (``connect4_data``, with the
random walks from the empty board); hold out a seeded 10 % of the training
sources and all four Pons test sets (the search benchmark sets, never trained
on; ``--train-pons`` puts Test_L1_* back into training); train a small residual CNN
(``connect4_model``) on CPU with left-right mirroring; export ONNX (opset 17,
dynamic batch); check the file with ``onnx.checker`` and against the torch
outputs in ONNX Runtime; evaluate the exported file on every held-out set;
write the model card beside it (``<out>.md`` with the ``.onnx`` suffix
replaced). With ``--compare PREVIOUS.onnx`` the card also compares the new file
with the previous model on the positions neither trained on.

Metrics (computed with ONNX Runtime on the shipped file):
  value accuracy    the value's outcome class equals the solver's: v >= 1/3
                    reads as a win, v <= -1/3 as a loss, anything between as a
                    draw;
  good-move rate    the policy's top legal column keeps the solver's result
                    (for a lost position: is one of the slowest losses);
  best-move rate    the top legal column is one of the solver's best_moves.

Needs torch and onnx (the ``train`` extra) besides NumPy and ONNX Runtime.
Exits non-zero if the export check fails or a benchmark position leaks into
the training set.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

from .connect4_data import (
    BENCHMARK_PONS,
    TRAIN_PONS,
    PositionSet,
    canonical_keys,
    child_values,
    heldout_mask,
    load_sources,
)
from .connect4_encoding import mirror
from .onnx_export import OPSET, export_onnx

DRAW_BAND = 1.0 / 3.0  # |v| below this reads as a draw


# ---------------------------------------------------------------- data

def split_sources(sources: dict, seed: int, train_names: tuple = ("uci", "solver"),
                  train_pons: tuple = TRAIN_PONS) -> tuple:
    """(train PositionSet, source name per training row, {held-out name: PositionSet}).

    Training sources are ``train_names`` (keys of ``sources``) and the Pons
    sets ``train_pons``, each minus its seeded held-out 10 %; every other Pons
    set is held out whole. A training position (or its mirror) that is in a
    held-out Test_L1 set is dropped from training (the UCI rows hold some
    8-stone L1 positions), and so is one that is a move after a held-out
    position: its label is that move's score, what a search of the held-out
    position is judged by (the random walks hold a few hundred children of
    each Test_L1 set). Raises SystemExit if a benchmark position
    (Test_L2_R1, Test_L3_R1) is in the training set: no source may hold one."""
    train_parts, train_source, held = [], [], {}
    for name in tuple(train_names) + tuple(train_pons):
        s = sources[name]
        mask = heldout_mask(s.boards, seed)
        train_parts.append(s.subset(~mask))
        train_source += [name] * int((~mask).sum())
        held[f"{name} (held-out 10 %)"] = s.subset(mask)
    train = PositionSet.concat(train_parts)
    train_source = np.array(train_source)
    train_keys = canonical_keys(train.boards)
    dropped = set()
    for name in TRAIN_PONS:
        if name not in train_pons:
            dropped.update(canonical_keys(sources[name].boards))
            held[name] = sources[name]
    train_key_set = set(train_keys)
    for name in BENCHMARK_PONS:
        if train_key_set.intersection(canonical_keys(sources[name].boards)):
            raise SystemExit(f"benchmark set {name} overlaps the training set")
        held[name] = sources[name]
    for s in held.values():  # the positions a search of a held-out one values first
        dropped.update(canonical_keys(child_values(s)[0]))
    keep = np.array([k not in dropped for k in train_keys])
    return train.subset(keep), train_source[keep], held


def by_stones(s: PositionSet, ranges: tuple) -> dict:
    """{"A-B stones": subset} of ``s`` for each inclusive (A, B) in ``ranges``."""
    stones = np.array([len(m) for m in s.moves])
    return {f"{lo}-{hi} stones": s.subset((stones >= lo) & (stones <= hi)) for lo, hi in ranges}


# ---------------------------------------------------------------- training

def train_model(train: PositionSet, *, channels: int, blocks: int, epochs: int,
                batch: int, lr: float, seed: int, repeat=None, wdl: bool = False,
                device: str = "cpu", log=print):
    """Train a Connect4Net on ``train``; returns the model in eval mode.

    Loss = MSE(value, sign of score) + cross-entropy(policy, uniform over good
    moves); with ``wdl`` the value term is the cross-entropy of the WDL head's
    logits against the solver's outcome (win / draw / loss). Each sample is
    mirrored left-right with probability 1/2.
    ``repeat`` (int [N], optional) is how many times each position is visited
    per epoch (default once). ``device`` is a torch device ("cpu", "cuda"): the
    training set is copied there once (boards uint8, about 84 bytes a
    position) and the returned model is on the CPU, for export."""
    import torch
    from torch.nn import functional as F

    from .connect4_model import Connect4Net

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = Connect4Net(channels=channels, blocks=blocks, wdl=wdl).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    base = np.repeat(np.arange(len(train)), 1 if repeat is None else repeat)
    steps = epochs * ((len(base) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15)

    def on_device(a: np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    boards, values = on_device(train.boards), on_device(train.value_target)
    policies = on_device(train.policy_target)
    mirrored_boards, mirrored_policies = on_device(mirror(train.boards)), on_device(mirror(train.policy_target))
    for epoch in range(epochs):
        model.train()
        t0, total, seen = time.perf_counter(), 0.0, 0
        order = on_device(rng.permutation(base))  # one copy an epoch, sliced per step
        flips = on_device(rng.random(len(order)) < 0.5)
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            flip = flips[start:start + batch][:, None, None, None]
            x = torch.where(flip, mirrored_boards[idx], boards[idx])
            p = torch.where(flip[:, :, 0, 0], mirrored_policies[idx], policies[idx])
            v = values[idx][:, None]
            pv, logits = model.raw_heads(x)
            if wdl:  # class 0 win, 1 draw, 2 loss
                value_loss = F.cross_entropy(pv, (1 - v[:, 0]).long())
            else:
                value_loss = F.mse_loss(pv, v)
            loss = value_loss + F.cross_entropy(logits, p)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.detach() * len(idx)  # summed on the device: no sync per step
            seen += len(idx)
        log(f"epoch {epoch + 1}/{epochs}: loss {float(total) / seen:.4f}, {time.perf_counter() - t0:.0f} s")
    return model.cpu().eval()


# ---------------------------------------------------------------- export

# ---------------------------------------------------------------- evaluation

def run_onnx(path: Path, boards: np.ndarray, batch: int = 1024) -> tuple:
    """(value float32 [N], policy_logits float32 [N, 7]) from ONNX Runtime (CPU)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    vs, ps = [], []
    for start in range(0, len(boards), batch):
        v, p = sess.run(None, {"board": boards[start:start + batch]})
        vs.append(v[:, 0])
        ps.append(p)
    return np.concatenate(vs), np.concatenate(ps)


def outcome_class(value: np.ndarray) -> np.ndarray:
    """int [N]: +1 win (v >= 1/3), -1 loss (v <= -1/3), 0 draw otherwise."""
    return np.where(value >= DRAW_BAND, 1, np.where(value <= -DRAW_BAND, -1, 0))


def evaluate(value: np.ndarray, logits: np.ndarray, s: PositionSet) -> dict:
    """Metrics of model outputs on labelled positions (see module docstring)."""
    truth = np.sign(s.score)
    pred = outcome_class(value)
    top = np.where(s.legal, logits, -np.inf).argmax(axis=1)
    rows = np.arange(len(s))
    out = {
        "positions": len(s),
        "stones": f"{min(map(len, s.moves))}-{max(map(len, s.moves))}",
        "win/draw/loss": "/".join(str(int((truth == k).sum())) for k in (1, 0, -1)),
        "value_accuracy": float((pred == truth).mean()),
        "good_move_rate": float(s.good[rows, top].mean()),
        "best_move_rate": float(s.best[rows, top].mean()),
    }
    for k, name in ((1, "win"), (0, "draw"), (-1, "loss")):
        sel = truth == k
        out[f"value_accuracy_{name}"] = float((pred[sel] == k).mean()) if sel.any() else None
    return out


PREVIOUS_REV = "PREVIOUS"  # stands in the card for --compare-rev's revision (documents cite no commit)
PREVIOUS_SEED = 1995  # the previous model's split seed (its held-out 10 % of the L1 sets)


def compare(previous: Path, current: Path, held: dict, previous_pons: tuple = (),
            seed: int = PREVIOUS_SEED) -> dict:
    """{set name: (previous metrics, current metrics)} on the positions neither
    model trained on.

    ``previous_pons``: the Pons sets the previous model trained on (90 % of
    each, split by the same keyed hash with ``seed``; the model of
    2026-11-30 trained on Test_L1_R1 and Test_L1_R2): of those only its
    held-out 10 % count. Every other held-out set here is unseen by both."""
    out = {}
    for name, s in held.items():
        if name in previous_pons:
            s = s.subset(heldout_mask(s.boards, seed))
            name = f"{name} (the 10 % both never saw)"
        if len(s) == 0:
            continue
        out[name] = tuple(evaluate(*run_onnx(path, s.boards), s) for path in (previous, current))
    return out


# ---------------------------------------------------------------- model card

def pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def metric_rows(metrics: dict) -> str:
    """Markdown rows of the held-out metrics table."""
    return "\n".join(
        f"| {name} | {m['positions']} | {m['stones']} | {m['win/draw/loss']} | "
        f"{pct(m['value_accuracy'])} | {pct(m['value_accuracy_win'])} | "
        f"{pct(m['value_accuracy_draw'])} | {pct(m['value_accuracy_loss'])} | "
        f"{pct(m['good_move_rate'])} | {pct(m['best_move_rate'])} |"
        for name, m in metrics.items())


def comparison_section(comparison: dict | None, previous: str, previous_pons: tuple = ()) -> str:
    """The card's previous-vs-new section ('' without a comparison)."""
    if not comparison:
        return ""
    l1_note = (f" (on {' / '.join(previous_pons)}, which the previous model trained on: its held-out 10 %)"
               if previous_pons else "")
    rows = "\n".join(
        f"| {name} | {old['positions']} | {pct(old['value_accuracy'])} → {pct(new['value_accuracy'])} | "
        f"{pct(old['value_accuracy_draw'])} → {pct(new['value_accuracy_draw'])} | "
        f"{pct(old['good_move_rate'])} → {pct(new['good_move_rate'])} | "
        f"{pct(old['best_move_rate'])} → {pct(new['best_move_rate'])} |"
        for name, (old, new) in comparison.items())
    return f"""
## Against the previous model

The previous file ({previous}) against this one, on the held-out positions
neither trained on{l1_note}. Previous → new:

| held-out set | positions | value acc. | on draws | good move | best move |
| --- | --- | --- | --- | --- | --- |
{rows}
"""


def write_card(path: Path, *, command: str, params: int, config: dict, args, counts: dict, dropped: int,
               metrics: dict, diff: float, size: int, train_s: float,
               comparison: dict | None = None, previous: str = "") -> None:
    """Write the Markdown model card."""
    train_rows = "\n".join(f"| {k} | {v} |" for k, v in counts.items())
    pons_note = (", ".join(args.train_pons) + " (90 % each) are trained on; the other Pons sets are"
                 if args.train_pons else "All four Pons sets are")
    import onnxruntime
    import torch
    wdl = config.get("wdl", False)
    value_out = ("linear →3: win/draw/loss logits; value = P(win) − P(loss) of their softmax" if wdl
                 else "linear →1, tanh")
    value_loss = ("cross-entropy(WDL logits, the solver's outcome)" if wdl else "MSE(value)")
    if args.device == "cpu":
        trained_on, gpu_caveat = f"on a shared CPU ({torch.get_num_threads()} thread(s))", ""
    else:
        trained_on = f"on {torch.cuda.get_device_name()} ({args.device})"
        gpu_caveat = " (cuDNN's convolutions on a GPU need not be deterministic)"
    value_meaning = "P(win) − P(loss)" if wdl else "tanh"
    # The card names no commit: the previous model's revision is a placeholder, found in git's history.
    previous_line = (f"git show {PREVIOUS_REV}:reward_service/models/connect4_value.onnx > {args.compare}   "
                     f"# the previous model, for --compare; {PREVIOUS_REV}: a revision holding the model this one "
                     "replaced (git log -- reward_service/models/connect4_value.onnx)\n"
                     if args.compare and args.compare_rev else "")
    if args.compare_rev:
        command = command.replace(args.compare_rev, PREVIOUS_REV)
    text = f"""# connect4_value.onnx — Connect Four value and policy network

A small residual CNN that estimates, for a Connect Four position, the game's
theoretical outcome for the side to move and a prior over columns. The search
service uses it to evaluate leaves (AlphaZero style). Trained on exact solver
labels; generated by `training/train_connect4_value.py` (do not
edit by hand: re-run the command below).

## Interface (contract)

| name | dtype | shape | meaning |
| --- | --- | --- | --- |
| input `board` | uint8 | [N, 2, 6, 7] | plane 0: stones of the side to move, plane 1: the opponent's (1 = stone); `[row, col]`, row 0 = bottom, col 0 = leftmost; N dynamic |
| output `value` | float32 | [N, 1] | {value_meaning}; expected outcome for the side to move: +1 win, 0 draw, −1 loss |
| output `policy_logits` | float32 | [N, 7] | logits over columns 0..6, not masked (mask full columns before a softmax) |

ONNX opset {OPSET}, one file ({size:,} bytes), no external data, FP32 (the shipped
config serves it with `precision: auto`: converted at load to an FP16 body
with an FP32 head on a GPU, with NHWC convolutions whose kernels add their bias, as is on the CPU; `tandem convert-fp16` writes the
FP16-body / FP32-head variant and reports its accuracy). The input is cast to float inside the model. The encoding equals
`search_service.games.connect4.observation` and `training.connect4_encoding.encode_moves`.

## Architecture

{params:,} trainable parameters. Input planes: the two stone planes, plus two
computed inside the model: a plane of ones (tells the zero padding at the board's
edge from an empty cell) and the parity of the stone count (which player is to move
matters for odd/even threats). Stem 3×3 conv ({config['channels']} channels) + batch
norm + ReLU; {config['blocks']} residual blocks (two 3×3 convs with batch norm each);
value head: 1×1 conv to {config['head_channels']} channels, linear {config['head_channels'] * 42}→{config['value_hidden']}, ReLU,
{value_out}; policy head: 1×1 conv to {config['head_channels']} channels, linear
{config['head_channels'] * 42}→7.

## Training data

Exact game-theoretic labels (Pons' score convention; see `data/README.md`):

| source (training part) | positions |
| --- | --- |
{train_rows}

* UCI Connect-4 data set (John Tromp, UCI Machine Learning Repository,
  https://archive.ics.uci.edu/dataset/26/connect+4): 8-stone openings (the
  60,801 rows shipped in `data/connect4/uci/`, 90 % of the original 67,557),
  with move scores from the bitbully solver.
* Random-walk positions (10–38 stones) from UCI openings, labelled with the
  bitbully solver (Markus Thill, AGPL-3.0): `data/connect4/solver/`.
* Random-walk positions from the empty board (5–41 stones), labelled with
  bitbully: `data/connect4/walks/` (commands in `data/README.md`).
* {pons_note} never trained on: Pascal Pons' test sets, from "Solving Connect 4:
  how to build a perfect AI",
  http://blog.gamesolver.org/solving-connect-four/02-test-protocol/, via GitHub
  `mbarbin/c4solver` commit 39cd6353a09418b36f864b9e3763b7aaa7df7c69.

Targets: value = sign of the solver score for the side to move; policy = uniform
over the moves that keep the solver's result (sign of the move score equals the
sign of the score; in a lost position, the slowest losses, `best_moves`).
Each `solver/` position is visited {args.solver_repeat}× per epoch, every other
position once. Augmentation: each sample mirrored left-right with
probability ½. Loss: {value_loss}
+ cross-entropy(policy). AdamW (weight decay 1e-4), one-cycle learning rate
(max {args.lr}), batch {args.batch}, {args.epochs} epochs, seed {args.seed};
{train_s:.0f} s wall time {trained_on}.

Held out (never trained on): a seeded 10 % of each training source (chosen per
position by a keyed hash of the position up to mirroring, seed {args.seed}; so a
position and its mirror image are on the same side), and the whole of every
Pons set not trained on. Training positions that are (up to mirroring) in a
held-out Test_L1 set are dropped (some UCI rows are), and so are those one
move after any held-out position (their labels are its move scores, which a
search of it is judged by): {dropped:,} positions of the training sources in
all. The script refuses to run if a Test_L2_R1 / Test_L3_R1 position or its
mirror is in the training set. The `solver/` and `walks/` files exclude every
Pons position by construction. Positions to choose a network by its search:
`data/connect4/validation/` (held-out walks, `bench/value_search_quality.py`).

## Held-out metrics

Computed with ONNX Runtime (CPU) on the exported file. *Value accuracy*: the
value's outcome class equals the solver's, where v ≥ 1/3 reads as a win,
v ≤ −1/3 as a loss and anything between as a draw (per-outcome columns: accuracy
on the positions of that true outcome). *Good move*: the policy's top legal
column keeps the solver's result (for lost positions: is a slowest loss).
*Best move*: the top legal column is one of the solver's `best_moves`.

| held-out set | positions | stones | win/draw/loss | value acc. | on wins | on draws | on losses | good move | best move |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
{metric_rows(metrics)}

Export check: `onnx.checker` (full check) passes; ONNX Runtime and PyTorch
outputs differ by at most {diff:.1e} on 1,024 held-out positions.
{comparison_section(comparison, previous, tuple(args.compare_trained_pons))}
## Reproduce

```
{previous_line}{command}
```

Date: {datetime.date.today().isoformat()}. PyTorch {torch.__version__}, ONNX Runtime
{onnxruntime.__version__}, NumPy {np.__version__}. Seeds are fixed; a bit-identical
file needs the same library versions and thread count{gpu_caveat}.

## Limits

The value is a learned estimate, not a solver. It is weakest on draws (the
"on draws" column), which are rare in random-walk positions, and on late
end-game positions a few plies from the end, where a search finds the result
itself. Use the network as a search heuristic, never as ground truth.
"""
    path.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------- main

def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("reward_service/models/connect4_value.onnx"))
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--channels", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1995)
    parser.add_argument("--value-head", choices=("tanh", "wdl"), default="tanh",
                        help="tanh regression, or win/draw/loss logits (value = P(win) - P(loss))")
    parser.add_argument("--solver-repeat", type=int, default=1,
                        help="visits per epoch of each solver/ random-walk position")
    parser.add_argument("--train-pons", nargs="*", default=[], choices=TRAIN_PONS,
                        help="Pons sets to train on (90 %%); default none: all four stay held out")
    parser.add_argument("--compare", type=Path, default=None,
                        help="the previous model's ONNX file: adds a previous-vs-new table to the card")
    parser.add_argument("--compare-trained-pons", nargs="*", default=[], choices=TRAIN_PONS,
                        help="Pons sets the --compare model trained on (90 %%): only their held-out 10 %% compared")
    parser.add_argument("--compare-rev", default=None,
                        help="the git revision the --compare file comes from (the card's Reproduce shows the git show)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu",
                        help='torch device to train on ("cpu", "cuda"); export and evaluation stay on the CPU')
    args = parser.parse_args(argv)

    import torch

    from .connect4_model import parameter_count

    torch.set_num_threads(args.threads)
    command = "python -m training.train_connect4_value " + " ".join(
        sys.argv[1:] if argv is None else argv)

    t0 = time.perf_counter()
    sources = load_sources(walks=True)
    train, source, held = split_sources(sources, args.seed, ("uci", "solver", "walks"),
                                        tuple(args.train_pons))
    names, sizes = np.unique(source, return_counts=True)
    counts = {str(k): int(n) for k, n in zip(names, sizes)}
    counts["total"] = len(train)
    # in a training source, neither trained on nor held out (see split_sources)
    dropped = sum(len(sources[n]) - len(held[f"{n} (held-out 10 %)"])
                  for n in ("uci", "solver", "walks", *args.train_pons)) - len(train)
    walks = held.pop("walks (held-out 10 %)")
    for name, part in by_stones(walks, ((5, 11), (12, 17), (18, 28), (29, 41))).items():
        held[f"walks {name} (held-out 10 %)"] = part
    print(f"data: {len(train)} training positions, {dropped} dropped ({time.perf_counter() - t0:.0f} s); held out: "
          + ", ".join(f"{k} {len(v)}" for k, v in held.items()))

    t1 = time.perf_counter()
    model = train_model(train, channels=args.channels, blocks=args.blocks, epochs=args.epochs,
                        batch=args.batch, lr=args.lr, seed=args.seed,
                        repeat=np.where(source == "solver", args.solver_repeat, 1), wdl=args.value_head == "wdl",
                        device=args.device)
    train_s = time.perf_counter() - t1

    sample = np.concatenate([s.boards for s in held.values()])[::7][:1024]
    metadata = {"contract": "board uint8 [N,2,6,7] (side to move, opponent; row 0 bottom) -> "
                            "value float32 [N,1] in [-1, 1], policy_logits float32 [N,7]",
                "command": command, "date": datetime.date.today().isoformat()}
    diff = export_onnx(model, args.out, sample, metadata, "board", ["value", "policy_logits"])
    print(f"exported {args.out} ({args.out.stat().st_size} bytes), ORT vs torch max diff {diff:.2e}")

    metrics = {}
    for name, s in held.items():
        if len(s) == 0:
            continue
        v, p = run_onnx(args.out, s.boards)
        metrics[name] = m = evaluate(v, p, s)
        print(f"{name}: value acc {pct(m['value_accuracy'])}, good move {pct(m['good_move_rate'])}, "
              f"best move {pct(m['best_move_rate'])} ({m['positions']} positions)")

    comparison, previous = None, ""
    if args.compare is not None:
        previous = f"sha256 {hashlib.sha256(args.compare.read_bytes()).hexdigest()[:16]}…"
        comparison = compare(args.compare, args.out, held, tuple(args.compare_trained_pons))
        for name, (old, new) in comparison.items():
            print(f"{name}: value acc {pct(old['value_accuracy'])} -> {pct(new['value_accuracy'])}, "
                  f"good move {pct(old['good_move_rate'])} -> {pct(new['good_move_rate'])}")

    card = args.out.with_suffix(".md")
    write_card(card, command=command, params=parameter_count(model), config=model.config, args=args,
               counts=counts, dropped=dropped, metrics=metrics, diff=diff, size=args.out.stat().st_size, train_s=train_s,
               comparison=comparison, previous=previous)
    print(f"wrote {card}; total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
