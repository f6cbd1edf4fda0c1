"""A bounded soak (``loadtest/soak.py``): the three real server processes under
the open-loop generator -- 4 engines at 15 FPS, each frame one value-model
Search of 32 simulations and one Evaluate -- for ``TANDEM_SOAK_SECONDS``
(default 60 s). No request may be lost, and after the warm-up each server's RSS, open file descriptors and
threads must stay flat (zero refusals is a capacity figure: opt-in,
``TANDEM_SOAK_STRICT=1``). Figures go to ``runs/reliability/soak.json``."""
from __future__ import annotations

import os

import pytest

from loadtest.reliability_figures import SoakFigures, save_figures
from loadtest.soak import run_soak, soak_config
from tandem.config import ServerConfig
from tandem.guard import HEALTH_WORKERS, REFUSAL_WORKERS, SPARE_WORKERS

pytestmark = pytest.mark.slow

SECONDS = float(os.environ.get("TANDEM_SOAK_SECONDS", 60))
STRICT = os.environ.get("TANDEM_SOAK_STRICT") == "1"
RSS_GROWTH_MIB = 16.0  # per server, after the warm-up, over the run
RSS_SLOPE_MIB_PER_MIN = 8.0
FD_GROWTH = 2
# gRPC's thread pools start their workers lazily, so a late burst may add some
# after the warm-up; more than the pools hold is a leak. Every server's pool holds
# one per admitted RPC (max_concurrent_rpcs) and a few spare, the refusal and
# health pools their own few, plus the watchdog (tandem/guard.py).
THREAD_GROWTH = max(ServerConfig().max_workers, ServerConfig().max_concurrent_rpcs) + SPARE_WORKERS \
    + REFUSAL_WORKERS + HEALTH_WORKERS + 1


# The search's evaluation cache (search.evaluation_cache_bytes, 64 MiB shipped) grows by design
# until full, as fast as the host searches new leaves: a small one is full within the warm-up,
# so the growth figures show leaks, not the host's speed.
CACHE_BYTES = 1 << 20


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("soak")
    report = run_soak(seconds=SECONDS, engines=4, fps=15.0, simulations=32, evaluator="value_model",
                      config_path=soak_config(work, evaluation_cache_bytes=CACHE_BYTES), log_dir=work / "logs")
    save_figures(SoakFigures.from_report(report))
    return report


def test_soak_loses_nothing_and_stays_flat(report):
    """Holds on any machine, however busy: every request is answered or refused
    with a status (never lost), the servers stay up and drain, nothing leaks."""
    for kind, r in report["load"]["requests"].items():
        assert r["lost"] == 0 and r["answered"] + sum(r["refused"].values()) == r["sent"], (kind, r)
    assert report["server_exited_during_soak"] is None
    assert set(report["exit_codes"].values()) == {0}  # and all three drained and stopped cleanly
    for name, s in report["servers"].items():
        assert s["rss_growth_mib"] <= RSS_GROWTH_MIB, (name, s)
        assert s["rss_slope_mib_per_min"] <= RSS_SLOPE_MIB_PER_MIN, (name, s)
        assert s["fds_growth"] <= FD_GROWTH and s["threads_growth"] <= THREAD_GROWTH, (name, s)


@pytest.mark.skipif(not STRICT, reason="capacity figure: set TANDEM_SOAK_STRICT=1 on an unloaded machine")
def test_soak_refuses_nothing_at_this_load(report):
    """A capacity figure, not a correctness one (it depends on the machine's
    speed): at 4 engines x 15 FPS the generator keeps its schedule, no request
    is refused and no search falls back to rollouts."""
    req = report["load"]["requests"]
    for kind in ("search", "evaluate"):
        r = req[kind]
        assert r["sent"] >= 0.9 * SECONDS * 4 * 15, r  # the generator kept its schedule
        assert r["refused"] == {} and r["answered"] == r["sent"], (kind, r)
    assert req["search"]["evaluators"] == {"EVALUATOR_VALUE_MODEL": req["search"]["answered"]}


def test_a_short_soak_beside_a_trainer_under_dynamic_loses_nothing(tmp_path):
    """The soak's trainer form (issue 12, part 5) in brief on the CPU: engines
    and a shared-memory trainer at once under the dynamic policy; nothing is
    lost, the trainer's batches are all answered, the lever is sampled. (The
    10-minute run on the GPU is docs/reliability.md's figure.)"""
    report = run_soak(seconds=8.0, engines=2, fps=10.0, simulations=16, evaluator="rollout", frames=True,
                      policy="dynamic", trainer="shm", log_dir=tmp_path / "logs")
    for kind, r in report["load"]["requests"].items():
        assert r["lost"] == 0 and r["answered"] + sum(r["refused"].values()) == r["sent"] > 0, (kind, r)
    assert report["server_exited_during_soak"] is None and set(report["exit_codes"].values()) == {0}
    assert report["policy"] == "dynamic"
    trainer = report["trainer"]
    assert trainer["transport"] == "shm" and trainer["batches"] > 0 and not trainer["refused"], trainer
    lever = report["bulk_lever"]
    assert lever["samples"] > 0 and 10 <= lever["bulk_share_mean_percent"] <= 100
