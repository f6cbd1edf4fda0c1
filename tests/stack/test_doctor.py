"""``tandem doctor``: findings with fixes; on a CPU host it says what it cannot check."""
from __future__ import annotations

import subprocess
import sys

import pytest

from stack import doctor
from tandem.config import TandemConfig
from tandem.gpu import cuda_device_count

cpu_only = pytest.mark.skipif(cuda_device_count() > 0, reason="the CPU-host findings")


@cpu_only
def test_cpu_host_says_plainly_what_it_cannot_check():
    findings = doctor.run(TandemConfig())
    by = {f.check: f for f in findings}
    assert by["GPU"].status == doctor.UNKNOWN and "no CUDA GPU" in by["GPU"].detail and by["GPU"].fix
    assert "not enforced" in by["MPS"].detail
    for check in doctor.GPU_CHECKS:
        assert by[check].status == doctor.UNKNOWN and "cannot check" in by[check].detail
    assert not any(f.status == doctor.FAIL for f in findings)


@cpu_only
def test_cli_prints_each_finding_and_exits_zero():
    done = subprocess.run([sys.executable, "-m", "stack", "doctor"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU visible" in done.stdout and "fix: run tandem doctor on the GPU host" in done.stdout
    assert "priorities enforced (--deep)" in done.stdout


def _facts(**over):
    return {"least_priority": 0, "greatest_priority": -5, "free_bytes": 100 << 30, "total_bytes": 140 << 30,
            "pageable_gb_per_s": 10.0, "pinned_gb_per_s": 40.0, **over}


def test_findings_from_gpu_facts_name_their_fix():
    import dataclasses

    base = TandemConfig()
    by = {f.check: f for f in doctor.check_facts(base, _facts())}
    assert by["stream priority range"].status == doctor.OK and "6 levels" in by["stream priority range"].detail
    assert by["free memory and pools"].status == doctor.WARN and "memory_pool_bytes" in by["free memory and pools"].fix
    assert by["copy bandwidth (pageable vs pinned)"].status == doctor.OK
    big = dataclasses.replace(base, reward=dataclasses.replace(base.reward, memory_pool_bytes=200 << 30))
    by = {f.check: f for f in doctor.check_facts(big, _facts(greatest_priority=0, pinned_gb_per_s=10.0))}
    assert by["free memory and pools"].status == doctor.FAIL
    assert by["stream priority range"].status == doctor.FAIL and "static" in by["stream priority range"].fix
    assert by["copy bandwidth (pageable vs pinned)"].status == doctor.WARN


def test_the_pools_that_must_fit_count_the_bulk_servers_reward_pool_too():
    import dataclasses

    base = TandemConfig()
    reward = dataclasses.replace(base.reward, memory_pool_bytes=40 << 30)
    cfg = dataclasses.replace(base, reward=reward, search=dataclasses.replace(base.search, memory_pool_bytes=30 << 30))
    by = {f.check: f for f in doctor.check_facts(cfg, _facts(free_bytes=100 << 30))}
    # 40 GiB for each reward process (the reward service and its bulk server) and 30 for search: 110 of 100 free.
    assert by["free memory and pools"].status == doctor.FAIL and "110.0 GiB" in by["free memory and pools"].detail
    alone = dataclasses.replace(cfg, reward=dataclasses.replace(reward, bulk_server=dataclasses.replace(
        reward.bulk_server, enabled=False)))
    by = {f.check: f for f in doctor.check_facts(alone, _facts(free_bytes=100 << 30))}
    assert by["free memory and pools"].status == doctor.OK and "70.0 GiB" in by["free memory and pools"].detail


def test_print_findings_exit_status(capsys):
    assert doctor.print_findings([doctor.Finding("a", doctor.OK, "fine")]) == 0
    assert doctor.print_findings([doctor.Finding("b", doctor.FAIL, "broken", "mend it")]) == 1
    out = capsys.readouterr().out
    assert "b: broken" in out and "fix: mend it" in out


@pytest.mark.gpu
def test_gpu_host_measures_facts():
    by = {f.check: f for f in doctor.run(TandemConfig())}
    assert by["GPU"].status == doctor.OK
    assert "levels" in by["stream priority range"].detail and "GB/s" in by["copy bandwidth (pageable vs pinned)"].detail


def test_without_nvml_gpu_metrics_are_absent_not_zero():
    from tandem import nvml

    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert nvml.sample() is None and nvml.register_gpu_metrics() is False
        assert doctor.check_nvml().status == doctor.UNKNOWN and "nvidia-ml-py" in doctor.check_nvml().fix
    else:
        pytest.skip("nvidia-ml-py is installed here")


@pytest.mark.parametrize("alone, low, high, status", [
    (0.23, 2.50, 0.40, doctor.OK),    # near its time alone
    (0.23, 2.50, 0.79, doctor.OK),    # slowed by full SMs, but far ahead of the load's priority
    (0.23, 0.90, 0.79, doctor.FAIL),  # priority makes no difference: no MPS
])
def test_priorities_enforced_is_judged_against_alone_and_the_loads_priority(monkeypatch, alone, low, high, status):
    """The decision on the three chain timings (measuring them needs a GPU: bench/run_scheduling_gpu.sh
    runs tandem doctor --deep under MPS)."""
    results = {(): alone, ("--load", "--low"): low, ("--load",): high}
    monkeypatch.setattr(doctor, "_child", lambda args, env: {"p50_ms": 0.0, "p99_ms": results[tuple(args[1:])]})
    finding = doctor.check_enforced({})
    assert finding.status == status
    assert f"{alone:.2f} ms alone" in finding.detail and f"{low:.2f} ms at the load's priority" in finding.detail
