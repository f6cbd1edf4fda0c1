"""The 60 FPS load test under one scheduling policy (issue 5, part 7).

One run starts the three servers (``tandem up``'s :class:`~stack.supervisor.Stack`)
with ``scheduler.policy`` set, then plays ``engines`` game engines at ``fps``
with :class:`~loadtest.generator.OpenLoopGenerator` (each frame: one
``Search`` of a real position with a fixed simulation budget, the frame
deadline only as a cap, plus one ``Evaluate`` of the rendered 224x224 frame
on ``frame_reward``) while :class:`~loadtest.background.BackgroundProcess`
saturates the reward service with large bulk batches, sent as bytes or
through shared memory (``background_transport``). It measures after a
warm-up and stops the stack.

Scenarios (the ``policy`` column of ``bench/results/frame_scheduling.json``):

* ``uncontended`` -- frames alone (policy ``default``);
* ``background_alone`` -- the background client alone (its throughput
  without frames);
* ``default``, ``dynamic``, ``static`` -- both, under that policy. Under
  ``static`` the stack starts each service with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
  (the static policy's share per kind, stack/supervisor.py), which MPS reads
  when the process creates its CUDA context. The policy also sets the bulk
  share (scheduler/policy.py, "The lever over bulk work"): none under
  ``default``, a fixed one under ``static``, the live one under ``dynamic``;
  a :class:`LeverSampler` reads it from the scheduler every 100 ms.

The trainer sends to the reward service's bulk server where the config runs
one (``reward.bulk_server``: a process of its own for bulk work,
:func:`tandem.config.bulk_address`), else to the reward service itself;
``bulk_server`` in each row says which. Scenarios under one policy can share
one start of the stack (:func:`run_scenarios`).

Everything measured is in ms (latencies from each frame's *scheduled* time)
or per second.
"""
from __future__ import annotations

import dataclasses
import socket
import tempfile
import threading
import time
from pathlib import Path

import grpc
import yaml
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

from loadtest.background import BackgroundProcess
from loadtest.generator import LoadSpec, OpenLoopGenerator
from stack.supervisor import Stack
from tandem.config import bulk_address, load_config
from tandem.server import channel

SCENARIOS = ("uncontended", "background_alone", "default", "dynamic", "static")
ROW_FIELDS = ("policy", "background_transport", "bulk_server", "clients", "fps", "frame_ms_avg", "frame_ms_p50", "frame_ms_p99",
              "missed_frame_share", "background_per_s", "simulations_per_frame", "critical_queue_ms_p99",
              "critical_model_ms_p99", "bulk_share_mean_percent", "frames_at_risk_share")


class LeverSampler:
    """Samples the scheduler's bulk lever every ``interval_s`` on a thread:
    the reward service's bulk share (percent) and whether frames were at risk.

    Args:
        address: the scheduler's address; ``cfg``: for the channel (TLS, token).
    """

    def __init__(self, address: str, cfg, interval_s: float = 0.1):
        self._channel = channel(address, cfg)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._interval_s = interval_s
        self._samples: list[tuple[float, bool]] = []  # (bulk share %, at risk); appended by the thread only
        self._reward_services = 0  # the most reward services (the bulk server one of them) a sample saw
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lever-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                st = self._stub.Status(scheduler_pb2.StatusRequest(), timeout=1.0)
            except grpc.RpcError:
                continue  # a missed sample; the figures say how many were taken
            shares = [s.assignment.bulk_share_percent or 100 for s in st.services
                      if s.kind == scheduler_pb2.SERVICE_KIND_REWARD]
            if shares:
                self._samples.append((min(shares), st.frames_at_risk))
                self._reward_services = max(self._reward_services, len(shares))

    def stop(self) -> dict:
        """Stops sampling; returns ``bulk_share_mean_percent`` (the least share
        among the reward services, averaged), ``frames_at_risk_share`` (0-1),
        ``reward_services`` (the most seen at once) and ``samples`` (None
        figures without samples)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self._channel.close()  # idempotent: stop() may be called again on the way out
        n = len(self._samples)
        return {"bulk_share_mean_percent": round(sum(s for s, _ in self._samples) / n, 1) if n else None,
                "frames_at_risk_share": round(sum(r for _, r in self._samples) / n, 3) if n else None,
                "reward_services": self._reward_services, "samples": n}


@dataclasses.dataclass(frozen=True)
class FrameTest:
    """What one run plays. Times in seconds, budgets per frame."""

    engines: int = 8  # game engines (the ``clients`` column)
    fps: float = 60.0
    simulations: int = 1000  # fixed search budget per frame
    deadline_cap_ms: float = 0.0  # cap on each search; 0 = one frame period (1000 / fps)
    warmup_s: float = 3.0  # played but not measured
    seconds: float = 20.0  # measured
    background_batch: int = 64  # frames per background Evaluate
    background_workers: int = 2  # background calls in flight
    # How the background trainer sends its frames: "grpc" (bytes in each message) or
    # "shm" (shared-memory regions it registers with the reward service; loadtest/background.py).
    background_transport: str = "grpc"
    timeout_s: float = 2.0  # gRPC deadline of each frame request

    @property
    def cap_ms(self) -> float:
        return self.deadline_cap_ms or 1000.0 / self.fps


def policy_of(scenario: str) -> str:
    """The scheduler policy a scenario runs under."""
    return scenario if scenario in ("default", "dynamic", "static") else "default"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(base: Path | None, policy: str, out: Path, free_ports: bool = False,
                 bulk_server: bool | None = None) -> Path:
    """``base`` (default: the schema's defaults) with ``scheduler.policy`` set, written to ``out``.
    With ``free_ports`` every server takes a free loopback port and no metrics
    port (a run beside other stacks on a shared host). ``bulk_server``: sets
    ``reward.bulk_server.enabled`` (None: as ``base`` has it).

    Raises:
        tandem.config.ConfigError: the result does not validate.
    """
    data = yaml.safe_load(Path(base).read_text()) if base else {}
    data = data or {}
    data.setdefault("scheduler", {})["policy"] = policy
    if bulk_server is not None:
        data.setdefault("reward", {}).setdefault("bulk_server", {})["enabled"] = bulk_server
    if free_ports:
        for name in ("scheduler", "reward", "search"):
            data.setdefault(name, {}).update(address=f"127.0.0.1:{_free_port()}", metrics_port=0)
        data["reward"].setdefault("bulk_server", {}).update(address=f"127.0.0.1:{_free_port()}", metrics_port=0)
        data["search"].pop("reward_address", None)  # follow the reward service's new address
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    load_config(out)  # refuse a bad config here, not in three child processes
    return out


def run_scenario(scenario: str, test: FrameTest, base_config: Path | None = None,
                 log_dir: Path | None = None, free_ports: bool = False,
                 bulk_server: bool | None = None) -> tuple[dict, list[float]]:
    """Starts the stack for ``scenario`` (on free loopback ports with
    ``free_ports``, see :func:`write_config`), plays it, stops the stack.

    Returns:
        (row with :data:`ROW_FIELDS` and the raw reports, measured frame latencies in ms).

    Raises:
        ValueError: unknown scenario.
        RuntimeError: the stack did not start.
    """
    return run_scenarios([scenario], test, base_config, log_dir, free_ports, bulk_server)[0]


def run_scenarios(scenarios: list[str], test: FrameTest, base_config: Path | None = None,
                  log_dir: Path | None = None, free_ports: bool = False,
                  bulk_server: bool | None = None) -> list[tuple[dict, list[float]]]:
    """:func:`run_scenario` for each of ``scenarios``, in order, on one start of
    the stack (each with its own trainer process and generator): they must
    share a policy (``uncontended``, ``background_alone`` and ``default`` do),
    and one start (~40 s on the GPU) serves them all.

    Raises:
        ValueError: an unknown scenario, or scenarios of several policies (before anything starts).
        RuntimeError: the stack did not start.
    """
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise ValueError(f"scenario: must be one of {', '.join(SCENARIOS)}, got {bad[0]!r}")
    policies = {policy_of(s) for s in scenarios}
    if len(policies) != 1:
        raise ValueError(f"scenarios: one stack runs one policy, got {sorted(policies)} ({', '.join(scenarios)})")
    with tempfile.TemporaryDirectory(prefix="tandem-frames-") as tmp:
        path = write_config(base_config, policies.pop(), Path(tmp) / "tandem.yaml", free_ports, bulk_server)
        cfg = load_config(path)
        stack = Stack(cfg, path, log_dir=log_dir / "-".join(scenarios) if log_dir else None)
        stack.start()
        try:
            return [_play(scenario, test, cfg) for scenario in scenarios]
        finally:
            stack.stop()


def _play(scenario: str, test: FrameTest, cfg) -> tuple[dict, list[float]]:
    frames_on = scenario != "background_alone"
    background_on = scenario != "uncontended"
    gen = bg = None
    lever = LeverSampler(cfg.scheduler.address, cfg)
    try:
        if background_on:
            bg = BackgroundProcess(bulk_address(cfg), cfg, batch=test.background_batch,
                                   workers=test.background_workers, transport=test.background_transport)
            bg.start()
        if frames_on:
            gen = OpenLoopGenerator(LoadSpec(
                cfg.search.address, cfg.reward.address, engines=test.engines, fps=test.fps,
                simulations=test.simulations, deadline_ms=test.cap_ms, frames=True, model="frame_reward",
                timeout_s=test.timeout_s), cfg)
            gen.start(test.warmup_s + test.seconds)
        time.sleep(test.warmup_s)
        lever.start()
        since = time.monotonic()
        bg_before = bg.report()["frames"] if bg else 0
        time.sleep(test.seconds)
        until = time.monotonic()
        bg_frames = (bg.report()["frames"] - bg_before) if bg else 0
        lever_figures = lever.stop()
        if gen:
            gen.stop()
        if bg:
            bg.stop()
        report = gen.report(since=since, until=until) if gen else None
        latencies = gen.frame_latencies_ms(since=since, until=until) if gen else []
    finally:
        lever.stop()
        for client in (gen, bg):
            if client is not None:
                client.close()
    evaluate = report["requests"]["evaluate"] if report else {}
    row = {
        "policy": scenario,
        "background_transport": test.background_transport if background_on else None,
        "bulk_server": cfg.reward.bulk_server.enabled,  # the trainer sent to the bulk server (else the reward service)
        "clients": test.engines if frames_on else 0,
        "fps": test.fps if frames_on else None,
        "frame_ms_avg": report["frame_latency_ms"]["mean"] if report else None,
        "frame_ms_p50": report["frame_latency_ms"]["p50"] if report else None,
        "frame_ms_p99": report["frame_latency_ms"]["p99"] if report else None,
        "missed_frame_share": report["missed_frame_share"] if report else None,
        "background_per_s": round(bg_frames / (until - since), 1) if bg else None,
        "simulations_per_frame": report["simulations_per_frame"] if report else None,
        # The frame's critical Evaluate as the reward service timed it (server queue, model run).
        "critical_queue_ms_p99": evaluate.get("server_queue_ms", {}).get("p99"),
        "critical_model_ms_p99": evaluate.get("server_compute_ms", {}).get("p99"),
        "bulk_share_mean_percent": lever_figures["bulk_share_mean_percent"],
        "frames_at_risk_share": lever_figures["frames_at_risk_share"],
        "lever_samples": lever_figures["samples"],
        "reward_services": lever_figures["reward_services"],  # 2 with the bulk server: it registered too
        "simulations_budget": test.simulations,
        "search_cap_ms": round(test.cap_ms, 3),
        "seconds": test.seconds,
        "requests": report["requests"] if report else None,
        "background": bg.report() if bg else None,
    }
    return row, latencies
