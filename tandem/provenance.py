"""Where a measurement came from: the fields every result file and report
records (docs/design.md, "Benchmark results").

:func:`record` gives ``{"date", "gpu", "versions", "command"}``:

* ``date``: UTC time, ISO 8601 (``2026-11-30T12:00:00Z``);
* ``gpu``: the name ``nvidia-smi`` gives for GPU 0, or None where there is none;
* ``versions`` (:func:`versions`): python, numpy, cupy, jax, jaxlib, mctx, pgx
  (None where not installed), ``tandem_commit`` (``$TANDEM_COMMIT``, else
  ``git rev-parse HEAD`` where the running tandem was imported from, else None), ``tandem_dirty`` (the
  working tree differs from that commit, untracked files included; None where
  unknown), ``nvidia_driver`` and ``host_cpu``;
* ``command``: the exact command line (``sys.orig_argv``).

A tree sent to another machine (the GPU machine's copy may hold an older
``.git`` than its work tree) cannot tell its own commit: whoever sent it sets
``$TANDEM_COMMIT`` and ``$TANDEM_DIRTY`` (0 or 1: whether the tree sent
differed from that commit), as bench/gpu_setup.sh says.
"""
from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata as _md
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from tandem.paths import import_root


def _dist_version(name: str) -> str | None:
    try:
        return _md.version(name)
    except _md.PackageNotFoundError:
        return None


def _cupy_version() -> str | None:
    for dist in _md.packages_distributions().get("cupy", []):
        v = _dist_version(dist)
        if v:
            return v
    return None


def _run(cmd: list[str]) -> str | None:
    """``cmd``'s stdout (stripped), run where the running ``tandem`` was imported from (a checkout: its
    git commands answer; an installed package: they fail), or None where it fails or takes over 30 s."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=import_root())
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


@functools.cache
def gpu_info() -> tuple[str | None, str | None]:
    """(GPU 0's name, driver version) from nvidia-smi, or (None, None); asked once a process."""
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if not out:
        return None, None
    name, _, driver = out.splitlines()[0].partition(",")
    return name.strip() or None, driver.strip() or None


def _host_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} threads)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict:
    """The software versions a result depends on (module docstring)."""
    commit = os.environ.get("TANDEM_COMMIT") or _run(["git", "rev-parse", "HEAD"]) or None
    dirty = os.environ.get("TANDEM_DIRTY") if os.environ.get("TANDEM_COMMIT") else None
    status = ("1" if dirty == "1" else "") if dirty in ("0", "1") else _run(["git", "status", "--porcelain"])
    _, driver = gpu_info()
    return {
        "python": platform.python_version(),
        "numpy": _dist_version("numpy"),
        "cupy": _cupy_version(),
        "jax": _dist_version("jax"),
        "jaxlib": _dist_version("jaxlib"),
        "mctx": _dist_version("mctx"),
        "pgx": _dist_version("pgx"),
        "tandem_commit": commit,
        "tandem_dirty": None if status is None else bool(status),
        "nvidia_driver": driver,
        "host_cpu": _host_cpu(),
    }


def record() -> dict:
    """``{"date", "gpu", "versions", "command"}`` for this process, now (module docstring)."""
    gpu, _ = gpu_info()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": gpu,
        "versions": versions(),
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
    }
