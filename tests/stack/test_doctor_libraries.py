"""`tandem doctor` fails loudly on a GPU host whose ONNX Runtime CUDA provider or
CuPy cannot load (the services would silently run on the CPU there)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stack import doctor
from tandem.config import TandemConfig
from tandem.gpu import cuda_device_count

GOOD = {"ort_version": "1.31.1", "ort_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
        "ort_session_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
        "cupy_version": "14.2.0", "cupy_sum": 6}


def _by_check(found: dict) -> dict[str, doctor.Finding]:
    return {f.check: f for f in doctor.check_libraries(found)}


def test_both_loading_is_ok():
    by = _by_check(GOOD)
    assert by["ONNX Runtime CUDA provider"].status == doctor.OK and by["CuPy"].status == doctor.OK


@pytest.mark.parametrize("found, detail, fix", [
    ({**GOOD, "ort_providers": ["CPUExecutionProvider"]}, "is the CPU build", "pip uninstall -y onnxruntime"),
    ({**GOOD, "ort_session_providers": ["CPUExecutionProvider"],
      "ort_fallback_reason": "libcublasLt.so.13: cannot open shared object file"}, "libcublasLt.so.13", "cuDNN"),
    ({"ort_error": "ModuleNotFoundError: No module named 'onnxruntime'", "cupy_version": "14.2.0", "cupy_sum": 6},
     "onnxruntime does not load", "tandem[gpu]"),
], ids=["cpu-build", "provider-fell-back", "not-installed"])
def test_onnx_runtime_without_its_cuda_provider_fails_with_the_fix(found, detail, fix):
    f = _by_check(found)["ONNX Runtime CUDA provider"]
    assert f.status == doctor.FAIL and detail in f.detail and fix in f.fix, f


@pytest.mark.parametrize("error, fix", [
    ("ModuleNotFoundError: No module named 'cupy'", "tandem[gpu]"),
    ("CUDARuntimeError: cudaErrorInsufficientDriver", "cupy-cuda12x"),
], ids=["not-installed", "wrong-cuda"])
def test_cupy_not_working_fails_with_the_fix(error, fix):
    found = {k: v for k, v in GOOD.items() if not k.startswith("cupy")} | {"cupy_error": error}
    f = _by_check(found)["CuPy"]
    assert f.status == doctor.FAIL and error in f.detail and "runs on the CPU" in f.detail and fix in f.fix, f


def test_the_probe_reports_what_loads_on_this_host():
    done = subprocess.run([sys.executable, "-m", "stack.doctor_libraries"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["ort_version"] and "CPUExecutionProvider" in found["ort_providers"], found
    if cuda_device_count() == 0:  # a session cannot get the CUDA provider here: the finding says why
        f = _by_check(found)["ONNX Runtime CUDA provider"]
        assert f.status == doctor.FAIL and "CPU" in f.detail, f
        if "CUDAExecutionProvider" in found["ort_providers"]:
            assert found["ort_session_providers"][0] == "CPUExecutionProvider" and found["ort_fallback_reason"]


@pytest.mark.gpu
def test_gpu_host_with_the_gpu_extra_has_both_libraries():
    by = {f.check: f for f in doctor.run(TandemConfig())}
    assert by["ONNX Runtime CUDA provider"].status == doctor.OK, by["ONNX Runtime CUDA provider"]
    assert by["CuPy"].status == doctor.OK, by["CuPy"]
