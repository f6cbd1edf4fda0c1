"""A bounded soak: a real stack (``tandem up``'s three processes) under the
open-loop generator, with each server's memory and file descriptors tracked.

The stack runs from a generated config (free loopback ports, CPU search,
value-model evaluator so search -> reward is soaked too). Every second the
sampler reads, for each server process, ``VmRSS`` and ``Threads`` from
``/proc/PID/status``, the number of entries of ``/proc/PID/fd`` and, on a
GPU host with NVML, the device memory it holds (pools included). The report
gives the generator's counts and latencies and, per server, the figures at the
end of the warm-up, at the end, their growth, and the RSS slope (least squares
over the samples after the warm-up, MiB per minute).

    python -m loadtest.soak --seconds 600 --engines 8 --fps 30 --out runs/reliability/soak_long.json

Under a trainer's load (issue 12): ``--trainer shm`` (or ``grpc``) runs
:class:`~loadtest.background.BackgroundProcess` beside the engines (bulk
batches of 64 rendered frames, 2 in flight) and ``--policy dynamic`` sets the
scheduler's policy; the report then holds the trainer's counts, the bulk
lever as the scheduler set it (``loadtest.frame_scheduling.LeverSampler``) and
the GPU's used memory (NVML) after the warm-up and at the end.

    python -m loadtest.soak --seconds 600 --engines 8 --fps 60 --simulations 1000 --evaluator rollout \
        --frames --trainer shm --policy dynamic --out soak_trainer.json

Run it from the repository root (the servers are ``python -m stack serve``).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from loadtest.background import TRANSPORTS, BackgroundProcess
from loadtest.frame_scheduling import LeverSampler
from loadtest.generator import LoadSpec, OpenLoopGenerator
from stack.supervisor import Stack
from tandem import nvml, provenance
from tandem.config import bulk_address, load_config, loopback_data


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_figures(pid: int) -> dict:
    """RSS (MiB), threads and open file descriptors of ``pid``, from /proc."""
    out = {"rss_mib": None, "threads": None, "fds": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_mib"] = int(line.split()[1]) / 1024.0
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


class Sampler:
    """Samples :func:`proc_figures` of some processes every ``interval_s`` on a thread."""

    def __init__(self, pids: dict[str, int], interval_s: float = 1.0):
        self.pids, self.interval_s = pids, interval_s
        self.samples: list[tuple[float, dict[str, dict]]] = []
        self.device_used_mib: list[tuple[float, float]] = []  # the whole GPU's used memory (NVML), if any
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            gpu = nvml.process_memory() or {}
            figures = {n: {**proc_figures(p), "gpu_mib": gpu[p] / 2**20 if p in gpu else None}
                       for n, p in self.pids.items()}
            self.samples.append((time.monotonic(), figures))
            device = nvml.sample()
            if device is not None:
                self.device_used_mib.append((time.monotonic(), device["memory_used_bytes"] / 2**20))
            if self._stop.wait(self.interval_s):
                return

    def summary(self, warm_until: float) -> dict:
        out = {}
        for name in self.pids:
            series = [(t, s[name]) for t, s in self.samples if s[name]["rss_mib"] is not None]
            after = [(t, f) for t, f in series if t >= warm_until] or series[-1:]
            first, last = after[0][1], after[-1][1]
            ts = np.array([t for t, _ in after]) - after[0][0]
            rss = np.array([f["rss_mib"] for _, f in after])
            slope = float(np.polyfit(ts, rss, 1)[0]) * 60.0 if len(after) >= 3 and ts[-1] > 0 else 0.0
            out[name] = {
                "rss_mib_start": round(series[0][1]["rss_mib"], 1),
                "rss_mib_after_warmup": round(first["rss_mib"], 1),
                "rss_mib_end": round(last["rss_mib"], 1),
                "rss_mib_max": round(max(f["rss_mib"] for _, f in series), 1),
                "rss_growth_mib": round(last["rss_mib"] - first["rss_mib"], 1),
                "rss_slope_mib_per_min": round(slope, 2),
                "fds_after_warmup": first["fds"], "fds_end": last["fds"], "fds_max": max(f["fds"] for _, f in series),
                "fds_growth": last["fds"] - first["fds"],
                "threads_after_warmup": first["threads"], "threads_end": last["threads"],
                "threads_growth": last["threads"] - first["threads"],
                "samples": len(series),
            }
            if first["gpu_mib"] is not None and last["gpu_mib"] is not None:
                out[name].update(gpu_mib_after_warmup=round(first["gpu_mib"], 1), gpu_mib_end=round(last["gpu_mib"], 1),
                                 gpu_mib_growth=round(last["gpu_mib"] - first["gpu_mib"], 1))
        return out

    def device_summary(self, warm_until: float) -> dict | None:
        """The whole GPU's used memory (MiB, every process on it, a trainer's
        too) after the warm-up, at the end, its maximum and growth; None without NVML."""
        used = [mib for t, mib in self.device_used_mib if t >= warm_until]
        if not used:
            return None
        return {"used_mib_after_warmup": round(used[0], 1), "used_mib_end": round(used[-1], 1),
                "used_mib_max": round(max(used), 1), "used_growth_mib": round(used[-1] - used[0], 1)}


def soak_config(directory: Path, backend: str = "auto", policy: str = "default", **search) -> Path:
    """A config for the soak's stack: free loopback ports, no metrics endpoints;
    ``backend`` for both services ("auto": the GPU where there is one), the
    scheduler's ``policy``."""
    data = loopback_data(_free_port)  # the trainer goes to the bulk server (tandem.config.bulk_address)
    data["scheduler"]["policy"] = policy
    data["search"].update({"backend": backend, **search})
    data["reward"]["execution_provider"] = backend
    path = directory / "soak.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_soak(seconds: float = 60.0, engines: int = 4, fps: float = 15.0, simulations: int = 32,
             evaluator: str = "value_model", warmup_s: float | None = None, config_path: Path | None = None,
             log_dir: Path | None = None, sample_interval_s: float = 1.0, backend: str = "auto",
             frames: bool = False, policy: str = "default", trainer: str | None = None) -> dict:
    """Starts a stack, soaks it for ``seconds`` and stops it; returns the report.

    The warm-up (default: a fifth of the run, at most 30 s) is excluded from
    the growth figures: allocators and caches fill up first. ``frames``: each
    frame's Evaluate scores a rendered 224x224 frame (``frame_reward``)
    instead of the board. ``policy``: the scheduler's (generated config only).
    ``trainer``: None, or the transport ("grpc" or "shm") of a background
    trainer sending bulk batches of 64 frames, 2 in flight, all along.
    """
    warmup_s = min(seconds / 5.0, 30.0) if warmup_s is None else warmup_s
    with tempfile.TemporaryDirectory(prefix="tandem-soak-") as tmp:
        path = config_path or soak_config(Path(tmp), backend, policy)
        cfg = load_config(path)
        stack = Stack(cfg, path, log_dir=log_dir)
        started = time.monotonic()
        stack.start()
        startup_s = time.monotonic() - started
        try:
            sampler = Sampler({name: p.pid for name, p in stack.procs.items()}, sample_interval_s)
            gen = OpenLoopGenerator(LoadSpec(cfg.search.address, cfg.reward.address, engines=engines, fps=fps,
                                             simulations=simulations, evaluator=evaluator, session_ids=True,
                                             frames=frames, model="frame_reward" if frames else "connect4_value"),
                                    cfg)
            bg = BackgroundProcess(bulk_address(cfg), cfg, transport=trainer) if trainer else None
            lever = LeverSampler(cfg.scheduler.address, cfg, interval_s=1.0)
            sampler.start()
            t0 = time.monotonic()
            try:
                if bg:
                    bg.start()
                lever.start()
                load = gen.run(seconds)
            finally:
                gen.close()
                lever_figures = lever.stop()
                if bg:
                    bg.close()
                sampler.stop()
            servers = sampler.summary(t0 + warmup_s)
            gpu_device = sampler.device_summary(t0 + warmup_s)
            failed = stack.failed()
        finally:
            codes = stack.stop()
    return {
        **provenance.record(),  # date, gpu, versions (commit, clean tree), command
        "seconds": seconds, "warmup_s": warmup_s, "engines": engines, "fps": fps, "simulations": simulations,
        "evaluator": evaluator, "frames": frames, "stack_startup_s": round(startup_s, 1), "load": load, "servers": servers,
        "server_exited_during_soak": failed, "exit_codes": codes, "policy": cfg.scheduler.policy,
        "trainer": bg.report() if bg else None, "bulk_lever": lever_figures,
        "gpu_device": gpu_device,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--fps", type=float, default=15.0)
    ap.add_argument("--simulations", type=int, default=32)
    ap.add_argument("--evaluator", choices=("rollout", "value_model"), default="value_model")
    ap.add_argument("--frames", action="store_true", help="Evaluate rendered 224x224 frames (frame_reward)")
    ap.add_argument("--config", type=Path, help="use this config instead of a generated one")
    ap.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                    help="search backend and reward execution provider of the generated config")
    ap.add_argument("--policy", choices=("default", "dynamic", "static"), default="default",
                    help="the scheduler's policy (generated config only)")
    ap.add_argument("--trainer", choices=TRANSPORTS, default=None,
                    help="run a background trainer (bulk batches of 64 frames) over this transport")
    ap.add_argument("--log-dir", type=Path)
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    args = ap.parse_args(argv)
    report = run_soak(args.seconds, args.engines, args.fps, args.simulations, args.evaluator,
                      config_path=args.config, log_dir=args.log_dir, backend=args.backend, frames=args.frames,
                      policy=args.policy, trainer=args.trainer)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    req = report["load"]["requests"]
    trainer_refused = bool(report["trainer"] and report["trainer"]["refused"])
    return 1 if any(v["lost"] or v["refused"] for v in req.values()) or trainer_refused else 0


if __name__ == "__main__":
    raise SystemExit(main())
