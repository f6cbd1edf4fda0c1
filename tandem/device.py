"""Host facts: what GPU 0 offers (name, memory, stream priority range) and
whether an MPS control daemon answers.

:func:`probe` never raises: every failure (no CuPy, no GPU, no MPS tools, a
hung MPS control daemon) becomes a plain sentence in :class:`DeviceInfo`.
The GPU is asked through CuPy in a short-lived child process
(``python -m tandem.device`` prints the facts as JSON), so the scheduler
daemon never holds a CUDA context of its own.

Why MPS matters (docs/design.md, "Measured physics"): across processes, CUDA
stream priorities do nothing unless the processes are clients of one MPS
server; without MPS the GPU time-slices the processes' contexts. So
``priorities_enforced`` is true only with a GPU *and* an MPS control daemon
that answers.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tandem.gpu import cupy_module
from tandem.paths import import_root
from tandem.stream_priority import PriorityRange, stream_priority_range

log = logging.getLogger(__name__)

#: The stream priority range assumed where no GPU can be asked: the H200's
#: (least 0, greatest -5; docs/design.md, "Measured physics"). The one place for it.
NOMINAL_PRIORITY_RANGE = PriorityRange(least=0, greatest=-5)

MPS_CONTROL_BINARY = "nvidia-cuda-mps-control"
DEFAULT_MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # the MPS control daemon's default

DEFAULT_LOG_DIRECTORY = "/tmp/nvidia-log"  # the MPS control daemon's default


def mps_directories(sched) -> tuple[str, str]:
    """(pipe, log) directories for a ``SchedulerConfig``: the configured ones,
    else ``$CUDA_MPS_PIPE_DIRECTORY`` / ``$CUDA_MPS_LOG_DIRECTORY``, else MPS's defaults."""
    pipe = sched.mps_pipe_directory or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIRECTORY
    logs = sched.mps_log_directory or os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIRECTORY
    return pipe, logs


def mps_client_env(pipe_directory: str, log_directory: str) -> dict[str, str]:
    """The environment an MPS client (and the control daemon) needs."""
    return {"CUDA_MPS_PIPE_DIRECTORY": pipe_directory, "CUDA_MPS_LOG_DIRECTORY": log_directory}


NO_GPU_MESSAGE = "no GPU: stream priorities are not enforced across processes"


@dataclass(frozen=True)
class DeviceInfo:
    """Findings about GPU 0 and MPS.

    Attributes:
        gpu_name: device name, "" without a GPU.
        total_memory_bytes: device memory in bytes, 0 without a GPU.
        priority_range: the device's stream priority range, or
            :data:`NOMINAL_PRIORITY_RANGE` where no GPU answered.
        range_from_device: whether ``priority_range`` was read from the device.
        mps_binary: path of ``nvidia-cuda-mps-control``, "" when not on PATH.
        mps_pipe_directory: where the control daemon is looked for
            (``CUDA_MPS_PIPE_DIRECTORY`` or ``/tmp/nvidia-mps``).
        mps_active: a control daemon answered there.
        mps_message: why MPS is or is not in force, one sentence.
        priorities_enforced: stream priorities act across processes.
        message: what all this means for scheduling, one sentence.
    """

    gpu_name: str = ""
    total_memory_bytes: int = 0
    priority_range: PriorityRange = NOMINAL_PRIORITY_RANGE
    range_from_device: bool = False
    mps_binary: str = ""
    mps_pipe_directory: str = DEFAULT_MPS_PIPE_DIRECTORY
    mps_active: bool = False
    mps_message: str = NO_GPU_MESSAGE
    priorities_enforced: bool = False
    message: str = NO_GPU_MESSAGE

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu_name)


def cpu_only() -> DeviceInfo:
    """The findings on a host without a GPU (also a stand-in for tests)."""
    return DeviceInfo()


def _gpu_facts() -> dict | None:
    """Asks CuPy about GPU 0 in this process: {"name", "total_memory_bytes", "least", "greatest"} or None."""
    cupy = cupy_module()
    if cupy is None:
        return None
    try:
        runtime = cupy.cuda.runtime
        props = runtime.getDeviceProperties(0)
        name = props.get("name", b"")
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        with cupy.cuda.Device(0):
            least, greatest = stream_priority_range(runtime)
        return {"name": name or "unknown GPU", "total_memory_bytes": int(props.get("totalGlobalMem", 0)),
                "least": least, "greatest": greatest}
    except Exception as exc:  # cudaErrorNoDevice, driver mismatch, ...
        log.debug("no usable GPU: %s", exc)
        return None


def _probe_gpu(timeout_s: float = 60.0) -> tuple[str, int, PriorityRange] | None:
    """(name, total memory in bytes, priority range) of GPU 0, or None.

    Asked in a short-lived child process, so that the scheduler itself never
    holds a CUDA context (device memory, and an MPS client slot it has no use for).
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(import_root()), os.environ.get("PYTHONPATH", "")) if p)}
    try:
        done = subprocess.run([sys.executable, "-m", "tandem.device"], capture_output=True, text=True,
                              timeout=timeout_s, env=env, cwd=str(import_root()))
        facts = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        log.warning("GPU probe failed: %s", exc)
        return None
    if done.returncode != 0:
        log.warning("GPU probe exited %d: %s", done.returncode, done.stderr.strip()[-500:])
    if not facts:
        return None
    try:
        return facts["name"], int(facts["total_memory_bytes"]), PriorityRange(int(facts["least"]), int(facts["greatest"]))
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("GPU probe answered nonsense (%s): %r", exc, facts)
        return None


def probe_mps(pipe_dir: str, timeout_s: float) -> tuple[str, bool, str]:
    """(binary path or "", daemon answering, sentence)."""
    binary = shutil.which(MPS_CONTROL_BINARY) or ""
    control = Path(pipe_dir) / "control"
    if not binary:
        if control.exists():
            return "", False, (
                f"an MPS control pipe exists at {control} but {MPS_CONTROL_BINARY} is not on PATH "
                "to confirm the daemon answers"
            )
        return "", False, f"MPS unavailable: {MPS_CONTROL_BINARY} is not on PATH"
    if not control.exists():
        return binary, False, (
            f"MPS control daemon not running (no {control}); start it with "
            f"`CUDA_MPS_PIPE_DIRECTORY={pipe_dir} {MPS_CONTROL_BINARY} -d`"
        )
    try:
        done = subprocess.run(
            [binary], input="get_server_list\n", capture_output=True, text=True, timeout=timeout_s,
            env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir},
        )
    except subprocess.TimeoutExpired:
        return binary, False, f"MPS control daemon at {pipe_dir} did not answer within {timeout_s:.1f} s"
    except OSError as exc:
        return binary, False, f"could not run {binary}: {exc.strerror}"
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        return binary, False, (
            f"MPS control daemon at {pipe_dir} did not answer (exit {done.returncode}"
            f"{': ' + detail[-1] if detail else ''})"
        )
    return binary, True, f"MPS control daemon answering at {pipe_dir}"


def probe(pipe_directory: str | None = None, *, mps_timeout_s: float = 2.0) -> DeviceInfo:
    """Finds out what GPU 0 and MPS offer. Never raises; blocks for the GPU
    probe's child process (about a second with CuPy, 60 s at most) plus at
    most ``mps_timeout_s``.

    ``pipe_directory`` defaults to ``$CUDA_MPS_PIPE_DIRECTORY`` or ``/tmp/nvidia-mps``.
    """
    pipe_dir = pipe_directory or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIRECTORY
    gpu = _probe_gpu()
    if gpu is None:
        binary = shutil.which(MPS_CONTROL_BINARY) or ""
        return DeviceInfo(mps_binary=binary, mps_pipe_directory=pipe_dir)
    name, total, prange = gpu
    binary, active, mps_message = probe_mps(pipe_dir, mps_timeout_s)
    if active:
        message = f"{name}: stream priorities {prange.least}..{prange.greatest} act across processes (MPS)"
    else:
        message = (
            f"{name}: stream priorities are not enforced across processes without MPS "
            "(the GPU time-slices separate contexts); they act only within one process "
            "-- start MPS, or set co_located: true in the config (both services in one process)"
        )
    return DeviceInfo(
        gpu_name=name,
        total_memory_bytes=total,
        priority_range=prange,
        range_from_device=True,
        mps_binary=binary,
        mps_pipe_directory=pipe_dir,
        mps_active=active,
        mps_message=mps_message,
        priorities_enforced=active,
        message=message,
    )


if __name__ == "__main__":  # the child process of _probe_gpu
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    print(json.dumps(_gpu_facts()))
