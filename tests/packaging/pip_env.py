"""pip, run as a subprocess, for the packaging tests (wheels, venvs, resolution).

Only what the tests need from PyPI is fetched (resolution metadata, a protobuf
wheel); where the index cannot be reached, the test is skipped with pip's reason.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_OFFLINE = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
            "Name or service not known", "ProxyError", "ConnectTimeout")


def pip(*args: str, python: str = sys.executable, timeout_s: float = 900) -> subprocess.CompletedProcess:
    """``python -m pip ARGS``; output captured as text. Run outside the checkout and
    without PYTHONPATH: pip must not take the checkout's ``tandem.egg-info`` (an
    editable install's) for an installed tandem, in this environment or a venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=tempfile.gettempdir())


def checked(result: subprocess.CompletedProcess, *, index_needed: bool = False) -> subprocess.CompletedProcess:
    """Fails the test with pip's output on a non-zero exit; skips instead where the
    command needed the package index and pip could not reach it."""
    if result.returncode != 0:
        out = result.stdout + result.stderr
        if index_needed and any(s in out for s in _OFFLINE):
            pytest.skip(f"the package index is unreachable: {out.strip().splitlines()[-1][:300]}")
        pytest.fail(f"{' '.join(result.args)} exited {result.returncode}:\n{out[-4000:]}")
    return result
