"""The chaos run: `tandem up` as a user runs it, N engines at a frame rate
and a trainer beside them, while every server is killed in turn and one is
stopped for a while; what each request, frame and server did meanwhile.

* ``tandem up --config CONFIG --log-dir DIR`` in a process of its own (its
  supervision restarts what is killed);
* the open-loop generator (loadtest/generator.py): ``--engines`` engines at
  ``--fps``, each frame one Search and one critical Evaluate through the
  frame client (stack/frame_loop.py, which sends the Evaluate to the reward
  service's standby while the reward service is down);
* a trainer (loadtest/background.py, in a process of its own) sending
  ``--trainer-batch``-frame bulk batches to the bulk server, where it runs;
* every ``--kill-every-s`` seconds the next server of the cycle (reward,
  reward_bulk, search, scheduler) gets SIGKILL; once, at the middle of the
  run, one server (``--stop``) gets SIGSTOP for ``--stop-s`` seconds, then
  SIGCONT;
* every 5 s each server's resident memory (VmRSS).

The result (JSON, ``--out``): per kill, the requests scheduled from it until
its server answered again (sent, answered, refused by code, lost) and its
restart-to-SERVING seconds; the whole run's totals (a request is lost when
nothing answered it a second past its deadline: 0 is the target); the
frames answered within their frame; each server's memory at the start and
the end; whether every server is SERVING at the end.

    python -m bench.chaos --minutes 8 --engines 64                                  # the GPU machine (bench/run_chaos_gpu.sh)
    python -m loadtest.chaos --minutes 1 --engines 2 --fps 10 --kill-every-s 15     # a CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loadtest.background import BackgroundProcess
from loadtest.generator import LoadSpec, OpenLoopGenerator
from tandem.config import BULK_SERVER, endpoints, load_config
from tandem.server import health_status
from tandem.workers import children

CYCLE = ("reward", BULK_SERVER, "search", "scheduler")  # the kill order
RSS_EVERY_S = 5.0


def stack_processes(supervisor: int) -> dict[str, int]:
    """The ``tandem serve NAME`` children of the ``tandem up`` process ``supervisor``: {name: pid}."""
    out = {}
    for pid in children(supervisor):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if b"serve" in argv:
            out[argv[argv.index(b"serve") + 1].decode()] = pid
    return out


def rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` (VmRSS, bytes); None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def wait_serving(cfg, name: str, timeout_s: float) -> float | None:
    """Seconds until server ``name`` answers SERVING (None: not within ``timeout_s``)."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if health_status(endpoints(cfg)[name][0], cfg, timeout_s=0.5) == "SERVING":
            return round(time.monotonic() - began, 2)
        time.sleep(0.1)
    return None


def run(args) -> dict:
    cfg = load_config(args.config)
    names = [n for n in CYCLE if n in endpoints(cfg)]  # the bulk server where the config runs one
    cmd = [sys.executable, "-m", "stack", "up", "--log-dir", str(args.log_dir)]
    if args.config:
        cmd += ["--config", str(args.config)]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    gen = trainer = None
    kills, memory = [], {}
    try:
        for line in up.stdout:
            if "tandem is up" in line:
                break
        else:
            raise RuntimeError("tandem up exited before it was up")
        gen = OpenLoopGenerator(LoadSpec(cfg.search.address, cfg.reward.address, engines=args.engines, fps=args.fps,
                                         simulations=args.simulations, evaluator=args.evaluator,
                                         timeout_s=args.timeout_s), cfg)
        if args.trainer_batch and cfg.reward.bulk_server.enabled:
            trainer = BackgroundProcess(cfg.reward.bulk_server.address, cfg, batch=args.trainer_batch, workers=1)
            trainer.start()
        gen.start()
        began = time.monotonic()
        end = began + args.minutes * 60.0
        next_kill, next_rss, stopped = began + args.kill_every_s, began, False
        turn = 0
        while time.monotonic() < end:
            now = time.monotonic()
            pids = stack_processes(up.pid)
            if now >= next_rss:
                for name, pid in pids.items():
                    memory.setdefault(name, []).append((round(now - began, 1), rss_bytes(pid)))
                next_rss = now + RSS_EVERY_S
            if not stopped and now - began >= args.minutes * 30.0 and args.stop in pids:
                stopped = True
                os.kill(pids[args.stop], signal.SIGSTOP)
                time.sleep(args.stop_s)
                os.kill(pids[args.stop], signal.SIGCONT)
                back_s = wait_serving(cfg, args.stop, timeout_s=args.kill_every_s)
                time.sleep(args.timeout_s + 1.0)  # the stop's requests have their answers (or their deadline)
                kills.append({"server": args.stop, "signal": "SIGSTOP", "at_s": round(now - began, 1),
                              "seconds": args.stop_s, "serving_again_after_s": back_s,
                              "requests": gen.report(since=now, until=now + args.stop_s)["requests"]})
            if now >= next_kill:
                name = names[turn % len(names)]
                turn += 1
                if name in pids:
                    killed = time.monotonic()
                    os.kill(pids[name], signal.SIGKILL)
                    back_s = wait_serving(cfg, name, timeout_s=args.kill_every_s)
                    kills.append({"server": name, "signal": "SIGKILL", "at_s": round(killed - began, 1),
                                  "serving_again_after_s": back_s,
                                  "requests": gen.report(since=killed, until=time.monotonic())["requests"]})
                next_kill = time.monotonic() + args.kill_every_s
            time.sleep(0.1)
        gen.stop()
        total = gen.report()
        serving = {name: health_status(endpoints(cfg)[name][0], cfg, timeout_s=2.0) for name in names}
    finally:
        if gen is not None:
            gen.stop(drain_s=0)
            gen.close()
        if trainer is not None:
            trainer.close()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
    lost = sum(r["lost"] for r in total["requests"].values())
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "config": str(args.config or "deploy/config/tandem.yaml"),
        "minutes": args.minutes, "engines": args.engines, "fps": args.fps,
        "trainer": trainer.report() if trainer is not None else None,
        "faults": kills,
        "totals": total["requests"], "lost": lost,
        "missed_frame_share": total["missed_frame_share"], "frame_latency_ms": total["frame_latency_ms"],
        "serving_at_the_end": serving,
        "memory_bytes": {name: {"first": series[0][1], "last": series[-1][1], "max": max(v or 0 for _, v in series)}
                         for name, series in memory.items()},
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The chaos run's options (also bench/chaos.py's)."""
    p.add_argument("--config", type=Path, default=None, help="tandem config (default: the shipped one)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--fps", type=float, default=60.0)
    p.add_argument("--simulations", type=int, default=256, help="per search (the deadline caps it too)")
    p.add_argument("--evaluator", default="value_model", choices=("rollout", "value_model"))
    p.add_argument("--timeout-s", type=float, default=2.0, help="each request's gRPC deadline (s)")
    p.add_argument("--trainer-batch", type=int, default=64, help="frames per trainer batch (0: no trainer)")
    p.add_argument("--kill-every-s", type=float, default=60.0)
    p.add_argument("--stop", default="search", help="the server stopped (SIGSTOP) once, mid-run")
    p.add_argument("--stop-s", type=float, default=5.0)
    p.add_argument("--log-dir", type=Path, default=Path("runs/chaos_logs"))


def print_table(result: dict) -> None:
    print(f"{'server':<12} {'signal':<8} {'at s':>6} {'back s':>7}  requests scheduled until it served again")
    for k in result["faults"]:
        reqs = k.get("requests", {})
        brief = "; ".join(f"{kind} {r['answered']}/{r['sent']} refused {r['refused'] or 0} lost {r['lost']}"
                          for kind, r in reqs.items())
        print(f"{k['server']:<12} {k['signal']:<8} {k['at_s']:>6} {str(k.get('serving_again_after_s', '-')):>7}  {brief}")
    print(f"lost {result['lost']}; missed frames {result['missed_frame_share']}; serving at the end "
          f"{result['serving_at_the_end']}")


def held(result: dict) -> bool:
    """Nothing lost, every server SERVING at the end."""
    return result["lost"] == 0 and all(v == "SERVING" for v in result["serving_at_the_end"].values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--out", type=Path, default=Path("runs/chaos.json"))
    args = p.parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"written to {args.out}")
    return 0 if held(result) else 1


if __name__ == "__main__":
    sys.exit(main())
