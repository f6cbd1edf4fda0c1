"""`make demo` / `make test` pick the ONNX Runtime build by the host (issue 14, part 2):
the `gpu` extra where `nvidia-smi -L` lists a GPU, the `cpu` extra elsewhere, and say
which. Checked with make's dry run (nothing installed) and a stand-in `nvidia-smi`."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tandem.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _dry_run(target: str, path_dirs: list[Path]) -> str:
    env = {**os.environ, "PATH": os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"])}
    out = subprocess.run(["make", "-n", "-B", target, "VENV=/nonexistent-venv"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("target", ["demo", "test"])
def test_a_listed_gpu_picks_the_gpu_extra_and_says_so(tmp_path, target):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-00000000)'\n")
    fake.chmod(0o755)
    out = _dry_run(target, [tmp_path])
    assert "nvidia-smi lists a CUDA GPU" in out and "gpu]'" in out  # pip install -e '.[gpu]' / '.[test,gpu]'
    assert "cpu]'" not in out


@pytest.mark.parametrize("target", ["demo", "test"])
def test_no_gpu_picks_the_cpu_extra_and_says_so(tmp_path, target):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 9\n")  # a driver tool that finds no device
    fake.chmod(0o755)
    out = _dry_run(target, [tmp_path])
    assert "no CUDA GPU listed by nvidia-smi" in out and "cpu]'" in out
    assert "gpu]'" not in out
