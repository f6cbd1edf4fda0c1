"""Faults: each server process is killed (SIGKILL) under a steady load and
restarted, and the stack shows what it promises.

Three real processes (``tandem serve NAME --config``) on loopback, two engines
at 20 FPS from ``loadtest.generator`` (each frame one value-model Search and
one Evaluate, every call with a 10-s deadline), for the whole test:

* scheduler killed: search and reward keep serving every request (they run on
  their last assignment); restarted on its port, both services register again
  (``Status`` and ``tandem status`` list them);
* reward service killed: every search is still answered, from rollouts
  (``SearchResponse.evaluator`` = ROLLOUT); Evaluate gets UNAVAILABLE; once it
  is back, searches use the value model again;
* search service killed: Evaluate keeps being answered; Search gets
  UNAVAILABLE; once restarted, searches are answered again;
* every request sent is accounted for: answered, or refused with a clear
  status (UNAVAILABLE while its server is down); none lost, none UNKNOWN.

Figures go to ``runs/reliability/faults.json``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import free_port
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

from loadtest.generator import LoadSpec, OpenLoopGenerator
from loadtest.reliability_figures import FaultFigures, FaultsFigures, LoadFigures, RequestCounts, save_figures
from stack.supervisor import wait_serving
from tandem.config import BULK_SERVER, endpoints, load_config, loopback_data
from tandem.paths import REPO_ROOT
from tandem.server import channel

pytestmark = pytest.mark.slow

OUTAGE_S = 3.0  # how long each server stays dead
RECOVERY_TIMEOUT_S = 20.0


class Server:
    """One ``tandem serve NAME`` process that can be killed and started again."""

    def __init__(self, name: str, config: Path, cfg, log_dir: Path):
        self.name, self.config, self.cfg, self.log_dir = name, config, cfg, log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return endpoints(self.cfg)[self.name][0]

    def start(self) -> float:
        began = time.monotonic()
        self.starts += 1
        log = open(self.log_dir / f"{self.name}.{self.starts}.log", "wb")
        # No preexec_fn (so vfork, no fork handlers): a fork() while gRPC threads are busy in this
        # process (the load generator) can abort the child in gRPC's at-fork handler before exec.
        self.proc = subprocess.Popen([sys.executable, "-m", "stack", "serve", self.name, "--config", str(self.config)],
                                     cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_serving(self.address, self.cfg, 60.0, self.proc)
        return time.monotonic() - began

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _registered(cfg) -> set[int]:
    with channel(cfg.scheduler.address, cfg) as ch:
        st = scheduler_pb2_grpc.SchedulerStub(ch).Status(scheduler_pb2.StatusRequest(), timeout=2)
    return {s.kind for s in st.services}


def _wait(predicate, timeout_s: float = RECOVERY_TIMEOUT_S, step_s: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout_s``."""
    began = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - began
        except Exception:  # e.g. the scheduler still starting
            pass
        assert time.monotonic() - began < timeout_s, f"not within {timeout_s} s: {predicate.__doc__ or predicate}"
        time.sleep(step_s)


def _window(gen: OpenLoopGenerator, since: float, until: float) -> dict:
    """Figures of the requests scheduled in [since, until), once all of them have an answer.
    The generator records a frame's requests as it sends them, in schedule order: once one
    scheduled at ``until`` or later is there, every request of the window is."""
    end = time.monotonic() + gen.spec.timeout_s + 1.5

    def settled() -> bool:
        records = list(gen.records)
        return bool(records) and records[-1].scheduled >= until and all(
            r.code is not None for r in records if since <= r.scheduled < until)

    while time.monotonic() < end and not settled():
        time.sleep(0.02)
    return gen.report(since=since, until=until)["requests"]


def _counts(r: dict, *also: str) -> RequestCounts:
    """Sent and answered of a generator report's requests, and the ``also`` figures (refused, lost, evaluators)."""
    return RequestCounts(sent=r["sent"], answered=r["answered"], **{k: r[k] for k in also})


def test_kill_each_server_under_load(tmp_path):
    data = loopback_data(free_port, bulk_server=False)
    data["scheduler"].update(report_interval_ms=100, lease_ttl_ms=1000)
    data["reward"]["execution_provider"] = "cpu"
    # No evaluation cache: with it, repeated positions are answered from cached model
    # values while the reward service is down, and this test counts who valued the leaves.
    data["search"].update(backend="cpu", evaluator="value_model", evaluation_cache_bytes=0)
    config = tmp_path / "faults.yaml"
    config.write_text(yaml.safe_dump(data))
    cfg = load_config(config)
    servers = {name: Server(name, config, cfg, tmp_path) for name in ("scheduler", "reward", "search")}
    gen = None
    faults: list[FaultFigures] = []
    try:
        for s in servers.values():
            s.start()
        _wait(lambda: _registered(cfg) == {scheduler_pb2.SERVICE_KIND_SEARCH, scheduler_pb2.SERVICE_KIND_REWARD})
        gen = OpenLoopGenerator(LoadSpec(cfg.search.address, cfg.reward.address, engines=2, fps=20.0, simulations=16,
                                         evaluator="value_model", timeout_s=10.0), cfg)  # slack for a busy host
        gen.start()
        time.sleep(1.5)

        def latest_search(evaluator: str) -> bool:
            """the newest answered searches used the expected evaluator"""
            recent = [r for r in list(gen.records)[-40:] if r.kind == "search" and r.code == "OK"]
            return len(recent) >= 5 and all(r.evaluator == evaluator for r in recent[-5:])

        # -- the scheduler ---------------------------------------------------------------------------
        killed = time.monotonic()
        servers["scheduler"].kill()
        time.sleep(OUTAGE_S)
        during = _window(gen, killed, time.monotonic())
        for kind in ("search", "evaluate"):
            assert during[kind]["sent"] > 0 and during[kind]["answered"] == during[kind]["sent"], during[kind]
        assert during["search"]["evaluators"] == {"EVALUATOR_VALUE_MODEL": during["search"]["answered"]}
        restarted = time.monotonic()
        startup_s = servers["scheduler"].start()
        reregistered_s = _wait(lambda: _registered(cfg) == {scheduler_pb2.SERVICE_KIND_SEARCH,
                                                            scheduler_pb2.SERVICE_KIND_REWARD})
        status = subprocess.run([sys.executable, "-m", "stack", "status", "--config", str(config)], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        listed = [line.split()[0] for line in status.stdout.splitlines() if " lease " in line]
        assert sorted(listed) == ["reward", "search"], status.stdout
        faults.append(FaultFigures("scheduler", {k: _counts(v) for k, v in during.items()}, {
            "restart_to_serving": round(startup_s, 2), "services_registered_again_after": round(reregistered_s + startup_s, 2),
        }))

        # -- the reward service -------------------------------------------------------------------------
        killed = time.monotonic()
        servers["reward"].kill()
        time.sleep(OUTAGE_S)
        during = _window(gen, killed, time.monotonic())
        assert during["search"]["sent"] > 0 and during["search"]["answered"] == during["search"]["sent"], during["search"]
        assert during["search"]["evaluators"].get("EVALUATOR_ROLLOUT", 0) >= during["search"]["answered"] - 2  # in flight at the kill
        assert set(during["evaluate"]["refused"]) <= {"UNAVAILABLE"} and during["evaluate"]["lost"] == 0
        assert during["evaluate"]["answered"] <= 2  # only those answered before the kill
        restarted = time.monotonic()
        startup_s = servers["reward"].start()
        back_s = _wait(lambda: latest_search("EVALUATOR_VALUE_MODEL"))
        faults.append(FaultFigures(
            "reward", {"search": _counts(during["search"], "evaluators"), "evaluate": _counts(during["evaluate"], "refused")},
            {"restart_to_serving": round(startup_s, 2), "value_model_again_after_restart": round(back_s + startup_s, 2)}))

        # -- the search service ---------------------------------------------------------------------------
        killed = time.monotonic()
        servers["search"].kill()
        time.sleep(OUTAGE_S)
        during = _window(gen, killed, time.monotonic())
        assert during["evaluate"]["sent"] > 0 and during["evaluate"]["answered"] == during["evaluate"]["sent"], during
        assert set(during["search"]["refused"]) <= {"UNAVAILABLE"} and during["search"]["lost"] == 0
        restarted = time.monotonic()
        startup_s = servers["search"].start()
        back_s = _wait(lambda: latest_search("EVALUATOR_VALUE_MODEL") and list(gen.records)[-1].scheduled > restarted)
        faults.append(FaultFigures(
            "search", {"evaluate": _counts(during["evaluate"]), "search": _counts(during["search"], "refused")},
            {"restart_to_serving": round(startup_s, 2),
             "searches_answered_again_after_restart": round(back_s + startup_s, 2)}))

        # -- all back: a clean window, then the books must balance ------------------------------------------
        _wait(lambda: _registered(cfg) == {scheduler_pb2.SERVICE_KIND_SEARCH, scheduler_pb2.SERVICE_KIND_REWARD})
        clean_from = time.monotonic()
        time.sleep(2.0)
        clean = _window(gen, clean_from, time.monotonic())
        for kind in ("search", "evaluate"):
            assert clean[kind]["sent"] > 0 and clean[kind]["answered"] == clean[kind]["sent"], clean[kind]
        assert clean["search"]["evaluators"] == {"EVALUATOR_VALUE_MODEL": clean["search"]["answered"]}
        gen.stop()
        total = gen.report()["requests"]
        for kind, t in total.items():
            refused = sum(t["refused"].values())
            assert t["lost"] == 0 and t["sent"] == t["answered"] + refused, (kind, t)
            assert set(t["refused"]) <= {"UNAVAILABLE"}, (kind, t["refused"])  # never UNKNOWN, INTERNAL, ...
        spec = gen.spec
        save_figures(FaultsFigures(
            outage_s=OUTAGE_S,
            load=LoadFigures(engines=spec.engines, fps=spec.fps, simulations=spec.simulations, evaluator=spec.evaluator,
                             timeout_s=spec.timeout_s, duration_s=gen.report()["duration_s"]),
            faults=faults, totals={kind: _counts(t, "refused", "lost") for kind, t in total.items()}))
    finally:
        if gen is not None:
            gen.stop(drain_s=0)
            gen.close()
        for s in reversed(list(servers.values())):
            s.stop()


def test_a_frame_keeps_its_evaluate_while_the_reward_service_is_killed(tmp_path):
    """`tandem play` (value model) while the reward service is killed and
    started again: every frame is answered, the Evaluates of the outage by the
    standby (the bulk server), the searches from rollouts (the critical path,
    docs/reliability.md)."""
    import threading

    from stack.play import PlayOptions, play

    data = loopback_data(free_port)
    data["reward"]["execution_provider"] = "cpu"
    data["search"].update(backend="cpu", evaluator="value_model")
    config = tmp_path / "failover.yaml"
    config.write_text(yaml.safe_dump(data))
    cfg = load_config(config)
    servers = {name: Server(name, config, cfg, tmp_path) for name in ("reward", BULK_SERVER, "search")}
    outage = threading.Event()

    def kill_and_restart():
        time.sleep(2.0)  # some frames on the reward service first
        servers["reward"].kill()
        outage.set()
        time.sleep(OUTAGE_S)
        servers["reward"].start()

    try:
        for s in servers.values():
            s.start()
        killer = threading.Thread(target=kill_and_restart)
        killer.start()
        # 10 FPS: a generous frame on a busy 2-core host; the frames must outlast the outage.
        opts = PlayOptions(cfg.search.address, cfg.reward.address, late_answers=True, frames=100, fps=10.0, simulations=16,
                           evaluator="value_model")
        report = play(opts, cfg, log=None)
        killer.join()
    finally:
        for s in reversed(list(servers.values())):
            s.stop()
    assert outage.is_set()
    assert report["frames_answered"] == report["frames"] == 100 and report["errors"] == {}, report["errors"]
    assert report["backends"]["evaluate_by_standby"] > 0
