"""`tandem up` / `tandem demo` say up front where the search and the models run."""
from __future__ import annotations

import dataclasses

import pytest

from search_service import backends
from stack import compute
from tandem import gpu
from tandem.config import TandemConfig

cpu_only = pytest.mark.skipif(gpu.cuda_device_count() > 0, reason="the CPU-host line")


@cpu_only
def test_cpu_host_says_both_run_on_the_cpu():
    line = compute.describe(TandemConfig())
    assert line.startswith("compute: search on the CPU (no CUDA GPU visible); reward models on the CPU"), line
    assert "pip install" not in line  # nothing to fix on a CPU host


def test_configured_cpu_backend_is_named():
    cfg = TandemConfig()
    cfg = dataclasses.replace(cfg, search=dataclasses.replace(cfg.search, backend="cpu"))
    assert "search on the CPU (search.backend: cpu)" in compute.describe(cfg)


def test_gpu_host_without_the_gpu_extra_names_the_fix(monkeypatch):
    # This host has no GPU: the driver's answer is replaced by one GPU, CuPy stays really absent.
    monkeypatch.setattr(gpu, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(backends, "cuda_device_count", lambda: 1)
    if backends.cuda_available() is None:
        pytest.skip("CuPy is installed here")
    line = compute.describe(TandemConfig())
    assert "search on the CPU (CuPy is not installed" in line, line
    assert "a CUDA GPU is visible (1): pip install 'tandem[gpu]'" in line, line


@pytest.mark.gpu
def test_gpu_host_with_the_gpu_extra_runs_the_search_on_the_gpu():
    line = compute.describe(TandemConfig())
    assert "search on the GPU (CUDA kernels)" in line and "onnxruntime-gpu" in line, line
