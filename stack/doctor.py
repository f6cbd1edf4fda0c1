"""``tandem doctor``: checks a host for what the scheduler relies on and prints
each finding with its fix.

Checks (GPU measurements run in child processes, :mod:`stack.doctor_gpu`,
so the doctor holds no CUDA context):

* GPU present (the driver, asked directly);
* the GPU builds load: ONNX Runtime's CUDA execution provider and CuPy
  (:mod:`stack.doctor_libraries`); on a GPU host either one missing is a FAIL;
* MPS: a control daemon answers in the configured pipe directory;
* stream priority range (the policies need at least two levels);
* free device memory against the fixed pools in the config;
* host -> device copy bandwidth, pageable vs pinned;
* clocks and utilisation (NVML, where ``nvidia-ml-py`` is installed);
* ``--deep``: priorities really enforced -- a high-priority kernel chain
  timed alone and against a saturating low-priority load in a second process.

On a host without a GPU it says plainly which checks it could not make.
Exit status: 0 when no finding is ``FAIL``, else 1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from tandem import device
from tandem.config import TandemConfig
from tandem.gpu import cuda_device_count

OK, WARN, FAIL, UNKNOWN = "ok", "WARN", "FAIL", "not checked"
GPU_CHECKS = ("stream priority range", "free memory and pools", "copy bandwidth (pageable vs pinned)",
              "clocks and utilisation", "priorities enforced (--deep)")
CHILD_TIMEOUT_S = 120.0
ENFORCED_P99_RATIO = 2.0  # chain p99 under load within this factor of alone: priorities act
CUDA_EP = "CUDAExecutionProvider"
INSTALL_GPU = "pip install 'tandem[gpu]' (make demo and make test pick it where nvidia-smi lists a GPU)"
PRIORITY_GAIN = 0.5  # or: the high-priority chain's p99 at most this share of the same chain at the load's priority


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # OK, WARN, FAIL or UNKNOWN
    detail: str
    fix: str = ""


def _child(args: list[str], env: dict[str, str], module: str = "stack.doctor_gpu") -> dict:
    """JSON printed by ``python -m MODULE ARGS``.

    Raises:
        RuntimeError: the child failed or timed out (its last stderr line in the message).
    """
    try:
        done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timed out after {CHILD_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_libraries(found: dict) -> list[Finding]:
    """ONNX Runtime's CUDA provider and CuPy, from :func:`stack.doctor_libraries.probe`'s
    answer: on a GPU host, each that does not load is a FAIL (the service would run on the CPU)."""
    version, providers = found.get("ort_version", ""), found.get("ort_providers", [])
    check = "ONNX Runtime CUDA provider"
    if "ort_error" in found:
        ort = Finding(check, FAIL, f"onnxruntime does not load: {found['ort_error']}", INSTALL_GPU)
    elif CUDA_EP not in providers:
        ort = Finding(check, FAIL, f"onnxruntime {version} is the CPU build ({', '.join(providers)}): "
                      "the reward service runs on the CPU", f"pip uninstall -y onnxruntime; {INSTALL_GPU}")
    elif found.get("ort_session_providers", [""])[0] != CUDA_EP:
        ort = Finding(check, FAIL, f"onnxruntime-gpu {version} fell back to {found.get('ort_session_providers')}: "
                      "its CUDA libraries (CUDA runtime, cuBLAS, cuDNN) did not load; the reward service runs on "
                      f"the CPU ({found.get('ort_fallback_reason') or 'no reason logged'})",
                      "install the CUDA and cuDNN versions this onnxruntime-gpu release names, or run the image "
                      "of deploy/Dockerfile")
    else:
        ort = Finding(check, OK, f"onnxruntime-gpu {version}: a session runs on {CUDA_EP}")
    if "cupy_error" in found:
        missing = found["cupy_error"].startswith(("ModuleNotFoundError", "ImportError"))
        cupy = Finding("CuPy", FAIL, f"CuPy does not work: {found['cupy_error']}; the search runs on the CPU "
                       "(the NumPy reference)", INSTALL_GPU if missing else
                       "the CuPy wheel of the driver's CUDA major (cupy-cuda13x for CUDA 13, cupy-cuda12x for 12)")
    else:
        cupy = Finding("CuPy", OK, f"CuPy {found['cupy_version']}: kernels compile and run")
    return [ort, cupy]


def check_mps(cfg: TandemConfig, has_gpu: bool) -> Finding:
    pipe, _ = device.mps_directories(cfg.scheduler)
    if not has_gpu:
        return Finding("MPS", UNKNOWN, "no GPU: cross-process stream priorities are not enforced on this host",
                       "run tandem doctor on the GPU host")
    _, active, message = device.probe_mps(pipe, 2.0)
    if active:
        return Finding("MPS", OK, message)
    return Finding("MPS", FAIL, f"{message}; stream priorities do not act across the reward and search processes",
                   "start the stack with `tandem up` (the scheduler starts MPS, scheduler.mps: auto), or start "
                   f"`CUDA_MPS_PIPE_DIRECTORY={pipe} nvidia-cuda-mps-control -d` yourself")


def check_facts(cfg: TandemConfig, facts: dict) -> list[Finding]:
    out = []
    least, greatest = facts["least_priority"], facts["greatest_priority"]
    levels = least - greatest + 1
    out.append(Finding("stream priority range", OK if levels >= 2 else FAIL,
                       f"least {least}, greatest {greatest} ({levels} levels)",
                       "" if levels >= 2 else "this GPU has one priority: use policy static (MPS thread partition)"))
    # reward.memory_pool_bytes is each reward process's: the bulk server holds one too.
    reward_processes = 2 if cfg.reward.bulk_server.enabled else 1
    pools = reward_processes * cfg.reward.memory_pool_bytes + cfg.search.memory_pool_bytes
    free, total = facts["free_bytes"], facts["total_bytes"]
    detail = f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free; fixed pools {pools / 2**30:.1f} GiB"
    if reward_processes > 1 and cfg.reward.memory_pool_bytes:
        detail += " (the reward pool twice: the bulk server holds one too)"
    if pools == 0:
        out.append(Finding("free memory and pools", WARN, detail + " (no pool limit set)",
                           "set reward.memory_pool_bytes and search.memory_pool_bytes so neither service can "
                           "starve the other"))
    elif pools > free:
        out.append(Finding("free memory and pools", FAIL, detail + ": the pools do not fit",
                           "lower the pools or free the GPU (nvidia-smi shows who holds it)"))
    else:
        out.append(Finding("free memory and pools", OK, detail))
    pageable, pinned = facts["pageable_gb_per_s"], facts["pinned_gb_per_s"]
    ratio = pinned / pageable if pageable else 0.0
    out.append(Finding("copy bandwidth (pageable vs pinned)", OK if ratio >= 1.2 else WARN,
                       f"host->device {pageable:.1f} GB/s pageable, {pinned:.1f} GB/s pinned",
                       "" if ratio >= 1.2 else "pinned copies are no faster: check the PCIe link "
                       "(nvidia-smi -q | grep -A3 'Link Width') and IOMMU settings"))
    return out


def check_nvml() -> Finding:
    from tandem import nvml

    s = nvml.sample()
    if s is None:
        return Finding("clocks and utilisation", UNKNOWN, "NVML not available",
                       "pip install nvidia-ml-py (or read nvidia-smi -q -d CLOCK,UTILIZATION)")
    detail = (f"SM clock {s['sm_clock_mhz']} of {s['sm_clock_max_mhz']} MHz, utilisation {s['gpu_util_percent']:.0f} %, "
              f"{s['memory_used_bytes'] / 2**30:.1f} GiB in use")
    if s["gpu_util_percent"] > 10:
        return Finding("clocks and utilisation", WARN, detail + ": another process is using the GPU",
                       "stop it (nvidia-smi lists it) before measuring latency")
    return Finding("clocks and utilisation", OK, detail)


def check_enforced(env: dict[str, str]) -> Finding:
    """The high-priority chain alone, and under another process's load at the
    load's priority and at the greatest: priorities act when the greatest
    keeps the chain near its time alone, or well ahead of the same chain at
    the load's priority (without MPS the two are alike)."""
    alone = _child(["chain"], env)
    low = _child(["chain", "--load", "--low"], env)
    high = _child(["chain", "--load"], env)
    ratio = high["p99_ms"] / max(alone["p99_ms"], 1e-6)
    gain = high["p99_ms"] / max(low["p99_ms"], 1e-6)
    detail = (f"kernel chain p99 {alone['p99_ms']:.2f} ms alone; against a load in another process "
              f"{low['p99_ms']:.2f} ms at the load's priority, {high['p99_ms']:.2f} ms at the greatest "
              f"(x{ratio:.1f} of alone, x{gain:.2f} of the load's priority)")
    if ratio <= ENFORCED_P99_RATIO or gain <= PRIORITY_GAIN:
        return Finding("priorities enforced (--deep)", OK, detail)
    return Finding("priorities enforced (--deep)", FAIL, detail,
                   "run both services as clients of one MPS server (tandem up with scheduler.mps: auto)")


def run(cfg: TandemConfig, deep: bool = False) -> list[Finding]:
    """All findings for this host (never raises: a failed measurement is a finding)."""
    has_gpu = cuda_device_count() > 0
    findings = [Finding("GPU", OK if has_gpu else UNKNOWN,
                        f"{cuda_device_count()} CUDA device(s)" if has_gpu else "no CUDA GPU visible on this host",
                        "" if has_gpu else "run tandem doctor on the GPU host; "
                        "here the services run on the CPU and nothing below can be measured")]
    findings.append(check_mps(cfg, has_gpu))
    if not has_gpu:
        findings += [Finding(c, UNKNOWN, "no GPU: cannot check") for c in GPU_CHECKS]
        return findings
    env = device.mps_client_env(*device.mps_directories(cfg.scheduler)) if cfg.scheduler.mps == "auto" else {}
    try:
        findings += check_libraries(_child([], env, module="stack.doctor_libraries"))
    except (RuntimeError, ValueError) as exc:
        findings.append(Finding("GPU libraries", FAIL, f"probe failed: {exc}", INSTALL_GPU))
    try:
        findings += check_facts(cfg, _child(["facts"], env))
    except (RuntimeError, ValueError, KeyError) as exc:
        findings.append(Finding("GPU facts", FAIL, f"measurement failed: {exc}", "is CuPy installed (tandem[gpu])?"))
    findings.append(check_nvml())
    if deep:
        try:
            findings.append(check_enforced(env))
        except (RuntimeError, ValueError, KeyError) as exc:
            findings.append(Finding("priorities enforced (--deep)", FAIL, f"measurement failed: {exc}"))
    else:
        findings.append(Finding("priorities enforced (--deep)", UNKNOWN, "not measured",
                                "tandem doctor --deep (about 10 s of GPU time)"))
    return findings


def print_findings(findings: list[Finding]) -> int:
    """Prints one line per finding (and its fix); returns 1 if any is FAIL."""
    for f in findings:
        print(f"[{f.status:^11}] {f.check}: {f.detail}")
        if f.fix:
            print(f"{'':14}fix: {f.fix}")
    return int(any(f.status == FAIL for f in findings))
