"""``tandem doctor`` on a GPU host: do the GPU builds of the libraries load?
Run in a child process, so that the doctor itself holds no CUDA context:

    python -m stack.doctor_libraries   # JSON: what ONNX Runtime and CuPy did here

It opens the bundled value model with the CUDA execution provider first (ONNX
Runtime falls back to the CPU with only a log line when the provider's CUDA
libraries do not load) and runs one CuPy reduction (compiled with NVRTC). The
findings are :func:`stack.doctor.check_libraries`.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile

from tandem.paths import package_path

CUDA = "CUDAExecutionProvider"


@contextlib.contextmanager
def _stderr_captured():
    """File descriptor 2 (where ONNX Runtime's C++ logger writes) into a temporary
    file for the block; yields a list that holds what was written, once the block is done."""
    written: list[bytes] = []
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            yield written
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            written.append(log.read())


def _first_error(raw: bytes) -> str:
    """The first line of ONNX Runtime's log that names a failure, without colour codes."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in raw.decode(errors="replace").splitlines()]
    failing = [line for line in lines if "Failed" in line or "cannot open" in line] or lines or [""]
    return failing[0][-400:]


def probe() -> dict:
    """What loads here: ``ort_version``, ``ort_providers`` (compiled in),
    ``ort_session_providers`` (what a session really got, where the CUDA
    provider is compiled in) and ``ort_fallback_reason`` where it fell back to
    the CPU, ``cupy_version``, ``cupy_sum`` (of arange(4): 6);
    an ``ort_error`` / ``cupy_error`` (``"Type: message"``) where a step raised."""
    out: dict = {}
    try:
        import onnxruntime as ort

        out["ort_version"], out["ort_providers"] = ort.__version__, ort.get_available_providers()
        if CUDA in out["ort_providers"]:
            model = package_path("reward_service", "models", "connect4_value.onnx")
            with _stderr_captured() as log:  # ONNX Runtime says why the provider did not load, on fd 2
                session = ort.InferenceSession(str(model), providers=[CUDA, "CPUExecutionProvider"])
            out["ort_session_providers"] = session.get_providers()
            if out["ort_session_providers"][0] != CUDA:
                out["ort_fallback_reason"] = _first_error(b"".join(log))
    except Exception as exc:  # ImportError, or a broken CUDA install
        out["ort_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import cupy

        out["cupy_version"] = cupy.__version__
        out["cupy_sum"] = int(cupy.arange(4).sum())
    except Exception as exc:
        out["cupy_error"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    print(json.dumps(probe()))
