"""PNG of frame latency distributions, one curve per policy (needs matplotlib:
the ``loadtest`` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from stack.stats import percentiles


def plot_latencies(latencies_ms: Mapping[str, Sequence[float]], fps: float, path: Path, title: str = "") -> Path:
    """Writes the empirical CDF of each policy's frame latencies (ms) to ``path``
    (PNG), with the frame period (1000 / ``fps`` ms) marked; policies without
    frames are left out.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, values in latencies_ms.items():
        v = np.sort(np.asarray(values, np.float64))
        if v.size == 0:
            continue
        p50, p99 = percentiles(v, 50, 99)
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=f"{name} (p50 {p50:.2f}, p99 {p99:.2f} ms)")
    ax.axvline(1000.0 / fps, color="grey", linestyle="--", linewidth=1, label=f"frame period {1000.0 / fps:.1f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("frame latency from its scheduled time (ms, log scale)")
    ax.set_ylabel("share of frames at or below")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or "frame latency per scheduling policy")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
