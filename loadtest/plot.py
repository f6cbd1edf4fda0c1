"""PNG of frame latency distributions, one curve per policy and one panel per
background transport (needs matplotlib: the ``loadtest`` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from stack.stats import percentiles

# Log-axis ticks written as plain numbers (ms), not powers of ten.
_TICKS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


def plot_latencies(panels: Mapping[str, Mapping[str, Sequence[float]]], fps: float, path: Path,
                   title: str = "") -> Path:
    """Writes the empirical CDF of each policy's frame latencies (ms) to ``path``
    (PNG): one panel per key of ``panels`` (a background transport, e.g.
    ``"grpc"``; ``""`` for an unnamed single panel), one curve per policy, the
    frame period (1000 / ``fps`` ms) marked, a log latency axis labelled in
    plain milliseconds. Policies without frames are left out.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, StrMethodFormatter

    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.8), dpi=120, squeeze=False, sharey=True)
    for ax, (panel, latencies_ms) in zip(axes[0], panels.items()):
        for name, values in latencies_ms.items():
            v = np.sort(np.asarray(values, np.float64))
            if v.size == 0:
                continue
            p50, p99 = percentiles(v, 50, 99)
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post",
                    label=f"{name} (p50 {p50:.2f}, p99 {p99:.2f} ms)")
        ax.axvline(1000.0 / fps, color="grey", linestyle="--", linewidth=1, label=f"frame period {1000.0 / fps:.1f} ms")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(_TICKS_MS))
        ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("frame latency from its scheduled time (ms, log scale)")
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(f"trainer over {panel}" if panel else "frame latency per scheduling policy", fontsize=10)
    axes[0][0].set_ylabel("share of frames at or below")
    fig.suptitle(title or "frame latency per scheduling policy")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
