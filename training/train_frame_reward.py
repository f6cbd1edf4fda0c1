"""Train the frame reward model (Connect Four value from a 224×224 RGB frame),
export it to ONNX and write its model card.

    python -m training.train_frame_reward \
        --out reward_service/models/frame_reward.onnx

The model reads what a game engine has: ``frame`` uint8 [N, 224, 224, 3]
(NHWC RGB, rendered by :mod:`training.frames`), and converts and
normalises it itself (so on a GPU that happens on the device). It returns
``value`` float32 [N, 1] in [-1, 1]: the solver's outcome for the side to move
(+1 win, 0 draw, -1 loss).

Data: the shipped solver-labelled positions, split exactly as for the value
network (``train_connect4_value.split_sources``: a seeded 10 % of each
training source held out, Pons Test_L2_R1 and Test_L3_R1 held out whole and
never trained on, nor any position one move after a held-out one -- a rule
newer than the shipped frame model, so a rerun of its command trains on 53
fewer positions). Training frames are rendered on the fly with jitter and
left-right mirroring; held-out frames are rendered once with a fixed seed.

Architecture (~100k parameters, stride early so 224² costs little): a
patchify stem (8×8 conv, stride 8) then two 2×2 stride-2 convs bring the frame
to a 7×7 grid, one position per 32-pixel board cell (plus the turn-indicator
row); residual 3×3 convs there; a value head (1×1 conv, linear, tanh).

Needs torch and onnx (the ``train`` extra). CPU only; a few minutes on two
threads.
"""
from __future__ import annotations

import argparse
import datetime
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np

from training import frames as F

from .connect4_data import load_sources
from .onnx_export import OPSET, export_onnx
from .train_connect4_value import split_sources

DRAW_BAND = 1.0 / 3.0  # |v| below this reads as a draw
INPUT, OUTPUT = "frame", "value"


def build_model(channels: int = 48, blocks: int = 2):
    """The torch module (see the module docstring). Input uint8 [N, 224, 224, 3];
    output float32 [N, 1]."""
    import torch
    from torch import nn

    def conv_bn(cin, cout, k, s, p=0):
        return [nn.Conv2d(cin, cout, k, s, p, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.a = nn.Sequential(*conv_bn(c, c, 3, 1, 1))
            self.b = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c))

        def forward(self, x):
            return torch.relu(x + self.b(self.a(x)))

    class FrameRewardNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(*conv_bn(3, 16, 8, 8), *conv_bn(16, 32, 2, 2), *conv_bn(32, channels, 2, 2))
            self.body = nn.Sequential(*[Block(channels) for _ in range(blocks)])
            self.head = nn.Sequential(
                nn.Conv2d(channels, 4, 1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 49, 32), nn.ReLU(),
                nn.Linear(32, 1), nn.Tanh(),
            )

        def forward(self, frame):
            # NHWC uint8 -> NCHW float, centred and scaled to about [-2, 2].
            # (contiguous first: channels-last activations take slow CPU paths in training)
            x = frame.permute(0, 3, 1, 2).contiguous().to(torch.float32)
            x = (x - 128.0) * (1.0 / 64.0)
            return self.head(self.body(self.stem(x)))

    return FrameRewardNet()


class Prefetcher:
    """Renders training batches in a background thread (NumPy releases the GIL
    in its gathers, torch in its kernels, so the two overlap)."""

    def __init__(self, moves: list, values: np.ndarray, batch: int, steps: int, seed: int):
        self._q: queue.Queue = queue.Queue(maxsize=3)
        self._args = (moves, values, batch, steps, seed)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        moves, values, batch, steps, seed = self._args
        rng = np.random.default_rng(seed)
        for _ in range(steps):
            idx = rng.integers(0, len(moves), batch)
            flip = rng.random(batch) < 0.5
            chosen = [F.mirror_moves(moves[i]) if f else moves[i] for i, f in zip(idx, flip)]
            self._q.put((F.render_moves(chosen, rng), values[idx]))

    def __iter__(self):
        while True:
            yield self._q.get()


def train(model, moves: list, values: np.ndarray, *, steps: int, batch: int, lr: float, seed: int, log=print):
    """AdamW + one-cycle learning rate, MSE on the value. Returns the model in eval mode."""
    import torch

    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.2)
    model.train()
    start, running = time.perf_counter(), None
    for step, (x, y) in enumerate(Prefetcher(moves, values, batch, steps, seed), 1):
        pred = model(torch.from_numpy(x))
        loss = torch.nn.functional.mse_loss(pred[:, 0], torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0 or step == steps:
            log(f"step {step}/{steps}  loss {running:.4f}  {time.perf_counter() - start:.0f} s")
        if step == steps:
            break
    model.eval()
    return model


def outcome_class(value: np.ndarray) -> np.ndarray:
    """int [N]: +1 win (v >= 1/3), -1 loss (v <= -1/3), 0 draw."""
    v = np.asarray(value).reshape(-1)
    return np.where(v >= DRAW_BAND, 1, np.where(v <= -DRAW_BAND, -1, 0))


def heldout_sets(seed: int = 1995, sources: dict | None = None) -> dict:
    """{held-out set name: (move strings, value target float32 [N])}: the
    positions the model never trained on (see the module docstring)."""
    _, _, held = split_sources(sources or load_sources(), seed)
    return {name: (list(s.moves), s.value_target) for name, s in held.items()}


def render_heldout(moves: list, seed: int, start: int, stop: int) -> np.ndarray:
    """Frames ``start:stop`` of a held-out set, rendered with the jitter of a
    fixed per-set seed (so a chunk is the same whatever the chunking)."""
    rng = np.random.default_rng([seed, start])
    return F.render_moves(moves[start:stop], rng)


def predict(run, moves: list, seed: int, chunk: int = 256) -> np.ndarray:
    """float32 [N]: ``run(frames) -> value [n, 1]`` over held-out frames, in chunks."""
    out = [run(render_heldout(moves, seed, i, min(i + chunk, len(moves)))).reshape(-1)
           for i in range(0, len(moves), chunk)]
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def accuracy_table(pred: dict, targets: dict) -> dict:
    """{set: {positions, accuracy, on_wins, on_draws, on_losses}} from predicted values."""
    rows = {}
    for name, v in pred.items():
        t = np.sign(targets[name]).astype(int)
        c = outcome_class(v)
        row = {"positions": len(t), "accuracy": float((c == t).mean()) if len(t) else float("nan")}
        for label, k in (("on_wins", 1), ("on_draws", 0), ("on_losses", -1)):
            m = t == k
            row[label] = float((c[m] == k).mean()) if m.any() else None
        row["counts"] = (int((t == 1).sum()), int((t == 0).sum()), int((t == -1).sum()))
        rows[name] = row
    return rows


def pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def write_card(path: Path, *, command: str, params: int, args, n_train: int, table: dict, diff: float,
               seconds: float, size: int) -> None:
    import onnxruntime
    import torch

    lines = [
        f"| {name} | {r['positions']} | {'/'.join(map(str, r['counts']))} | {pct(r['accuracy'])} | "
        f"{pct(r['on_wins'])} | {pct(r['on_draws'])} | {pct(r['on_losses'])} |"
        for name, r in table.items()
    ]
    total = sum(r["positions"] for r in table.values())
    overall = sum(r["accuracy"] * r["positions"] for r in table.values()) / max(total, 1)
    wins = sum(r["counts"][0] for r in table.values())
    path.write_text(f"""# frame_reward.onnx — Connect Four value from a game frame

A small CNN that reads a rendered Connect Four frame, as a game engine has it
(224×224 RGB, uint8, NHWC), and estimates the game's theoretical outcome for
the side to move. The reward service's frame model: what `Evaluate` of one
uint8 frame runs, and the model the FP16 accuracy check uses. Generated by
`training/train_frame_reward.py` (do not edit by hand: re-run
the command below).

## Interface (contract)

| name | dtype | shape | meaning |
| --- | --- | --- | --- |
| input `frame` | uint8 | [N, 224, 224, 3] | RGB frame, row 0 at the top, NHWC, as drawn by `training/frames.py`; N dynamic |
| output `value` | float32 | [N, 1] | tanh; expected outcome for the side to move: +1 win, 0 draw, −1 loss |

The model converts the frame to float NCHW and normalises it itself
((x − 128) / 64), so on a GPU the conversion runs on the device and the host
sends 150,528 bytes per frame (a quarter of a float32 frame). ONNX opset
{OPSET}, one file ({size:,} bytes), no external data.

The frames (`training/frames.py`): a blue board of 6 × 7 cells of
32 × 32 pixels filling the lower 224 × 192 pixels, red discs for the first
player, yellow for the second, and a disc of the colour of the player to move
hovering above the middle column (the turn indicator, as game UIs show it).
Jitter: a shift of up to ±{F.JITTER_PX} pixels and a brightness change of up to
±{100 * F.BRIGHTNESS_JITTER:.0f} %.

## Architecture

{params:,} trainable parameters. Patchify stem: 8×8 conv stride 8 (16
channels) → 2×2 conv stride 2 (32) → 2×2 conv stride 2 ({args.channels}), each
with batch norm and ReLU: a 7×7 grid, one position per 32-pixel cell
row/column (the top row holds the turn indicator). {args.blocks} residual
blocks of two 3×3 convs ({args.channels} channels). Value head: 1×1 conv to 4
channels, linear 196→32, ReLU, linear →1, tanh.

## Training

Positions: the shipped solver-labelled sets (see `data/README.md` and
`reward_service/models/connect4_value.md` for sources and licences), split
exactly as for the value network: a seeded 10 % of each training source
(uci, solver random walks, Pons Test_L1_R1 / Test_L1_R2) held out by a keyed
hash of the position up to mirroring (seed {args.seed}), and all of Pons
**Test_L2_R1** and **Test_L3_R1** (the search benchmark sets) held out whole;
the split refuses to run if a benchmark position or its mirror is in the
training set. {n_train:,} training positions.

Target: sign of the solver score for the side to move. Frames rendered on the
fly with jitter; each position mirrored left-right with probability ½.
Loss: MSE(value). AdamW (weight decay 1e-4), one-cycle learning rate (max
{args.lr}), batch {args.batch}, {args.steps} steps ({args.steps * args.batch:,}
frames), seed {args.seed}; {seconds:.0f} s wall time on a shared CPU
({args.threads} threads).

## Held-out accuracy

Computed with ONNX Runtime (CPU) on the exported file, on frames rendered with
jitter (a fixed seed per set). *Accuracy*: the value's outcome class equals
the solver's, where v ≥ 1/3 reads as a win, v ≤ −1/3 as a loss and anything
between as a draw; per-outcome columns: accuracy on the positions of that true
outcome.

| held-out set | positions | win/draw/loss | accuracy | on wins | on draws | on losses |
| --- | --- | --- | --- | --- | --- | --- |
{chr(10).join(lines)}

All held-out positions together: {total:,}, accuracy {pct(overall)} (always
answering "win", the most common outcome, would score {pct(wins / max(total, 1))}).

Export check: `onnx.checker` (full check) passes; ONNX Runtime and PyTorch
outputs differ by at most {diff:.1e} on 64 held-out frames.

## Reproduce

```
{command}
```

Date: {datetime.date.today().isoformat()}. PyTorch {torch.__version__}, ONNX Runtime
{onnxruntime.__version__}, NumPy {np.__version__}. Seeds are fixed; a bit-identical
file needs the same library versions and thread count.

## Limits

A learned estimate from pixels with a small budget (a few CPU minutes), well
below the board-input value network (`connect4_value.md`); weakest on draws
and late end games, like it. It knows only frames drawn like
`training/frames.py` (colours, geometry, a turn indicator): another
renderer's frames are out of distribution. Use it as a reward signal and a
benchmark model, never as ground truth.
""")


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("reward_service/models/frame_reward.onnx"))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--channels", type=int, default=48)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1995)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import onnxruntime as ort
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    sources = load_sources()
    train_set, _, _ = split_sources(sources, args.seed)  # SystemExit on a benchmark leak
    held = heldout_sets(args.seed, sources)
    print(f"training positions: {len(train_set)}; held out: " + ", ".join(f"{k} {len(v[0])}" for k, v in held.items()))
    model = build_model(args.channels, args.blocks)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"parameters: {params}")
    train(model, list(train_set.moves), train_set.value_target, steps=args.steps, batch=args.batch, lr=args.lr,
          seed=args.seed)
    seconds = time.perf_counter() - t0

    first = next(iter(held.values()))[0]
    sample = render_heldout(first, args.seed, 0, 64)
    diff = export_onnx(model, args.out, sample, input_name=INPUT, output_names=[OUTPUT], metadata={
        "source": "training/train_frame_reward.py",
        "card": args.out.with_suffix(".md").name,
    })
    sess = ort.InferenceSession(str(args.out), providers=["CPUExecutionProvider"])
    run = lambda x: sess.run(None, {INPUT: x})[0]  # noqa: E731
    pred = {name: predict(run, m, args.seed) for name, (m, _) in held.items()}
    table = accuracy_table(pred, {name: t for name, (_, t) in held.items()})
    for name, r in table.items():
        print(f"{name:28s} {r['positions']:6d}  accuracy {pct(r['accuracy'])}")
    size = args.out.stat().st_size
    write_card(args.out.with_suffix(".md"), command="python -m training.train_frame_reward "
               + " ".join(argv if argv is not None else sys.argv[1:]), params=params, args=args,
               n_train=len(train_set), table=table, diff=diff, seconds=seconds, size=size)
    print(f"wrote {args.out} ({size} bytes) and its card; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
