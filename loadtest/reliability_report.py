"""Reliability figures: the tests write them, this renders them.

The reliability tests (``tests/stack/test_bad_input_properties.py``, ``tests/stack/fuzz/``,
``tests/stack/test_limits.py``, ``tests/stack/test_faults.py``, ``tests/stack/test_soak.py``,
``tests/stack/test_access.py``) each write ``runs/reliability/<name>.json`` with
:func:`save_figures`; ``python -m loadtest.reliability_report`` prints the
markdown tables of ``docs/reliability.md`` from whatever is there
(``--write`` replaces the generated section of that page).
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from tandem.paths import REPO_ROOT

RESULTS_DIR = Path(os.environ.get("TANDEM_RELIABILITY_DIR", REPO_ROOT / "runs" / "reliability"))


def save_figures(name: str, figures: dict) -> Path:
    """Writes ``figures`` (plus date, host and CPU count) to ``RESULTS_DIR/<name>.json``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    doc = {"name": name, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
           **figures}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


START, END = "<!-- reliability-figures:start -->", "<!-- reliability-figures:end -->"
DOC = REPO_ROOT / "docs" / "reliability.md"


def _load(name: str) -> dict | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return out + [""]


def _codes(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"


def _ip(hex_addr: str) -> str:
    """/proc/net/tcp's hex address as text (loopback forms only; others as they are)."""
    return {"0100007F": "127.0.0.1", "0000000000000000FFFF00000100007F": "::ffff:127.0.0.1",
            "00000000000000000000000001000000": "::1", "00000000": "0.0.0.0"}.get(hex_addr, hex_addr)


def _stamp(doc: dict) -> str:
    h = doc.get("host", {})
    return f"_{doc['date']}, {h.get('cpus')} CPUs, Python {h.get('python')}_"


def render() -> str:
    """The markdown of every figure file present (sections without one are left out)."""
    out: list[str] = []
    d = _load("bad_input")
    if d:
        out += ["### Bad input over gRPC (`tests/stack/test_bad_input_properties.py`)", "", _stamp(d), ""]
        rows, total = [], 0
        for rpc, f in d["rpcs"].items():
            o = f["outcomes"]
            total += f["inputs"]
            rows.append([f"`{rpc}`", f["inputs"], o.get("OK", 0),
                         _codes({k: v for k, v in o.items() if k not in ("OK", "UNKNOWN", "INTERNAL")}),
                         o.get("UNKNOWN", 0) + o.get("INTERNAL", 0)])
        out += _table(["RPC", "malformed inputs", "OK (valid after all)", "refused with", "UNKNOWN / INTERNAL"], rows)
        out += [f"{total} inputs in all ({d['examples_per_property']} per property); after each one the server "
                "answered a valid call.", ""]
    d = _load("fuzz")
    if d:
        out += ["### Fuzzing of request decoding (`tests/stack/fuzz/`)", "", _stamp(d) + f", {d['seconds_budget']:g} s budget", ""]
        rows = [[f"`{t['target']}`", t["code"], t["examples"], t["seconds"], _codes(t["outcomes"])] for t in d["targets"]]
        out += _table(["target", "code under test", "inputs", "s", "outcomes"], rows)
    d = _load("limits")
    if d:
        out += ["### Limits (`tests/stack/test_limits.py`)", "", _stamp(d), ""]
        rows = []
        if "flood" in d:
            f = d["flood"]
            rows.append(["flood", f"{f['sent']} concurrent 300-ms searches, `max_concurrent_rpcs` {f['max_concurrent_rpcs']}, "
                         f"{f['max_workers']} threads",
                         f"{f['answered']} answered ({f['answered_latency_ms_min']}-{f['answered_latency_ms_max']} ms), "
                         f"{f['refused_resource_exhausted']} RESOURCE_EXHAUSTED within {f['refused_latency_ms_max']} ms, "
                         f"{f['lost']} lost; health probe while saturated: {f['health_probe_while_saturated']}"])
        if "cancel" in d:
            f = d["cancel"]
            rows.append(["cancel", f"client cancels a {f['budget_simulations']:,}-simulation search after 0.3 s",
                         f"stopped {f['stopped_after_cancel_ms']} ms later after {f['simulations_done']} simulations "
                         f"({f['waves']} waves); its one thread served the next call"])
        if "client_deadline" in d:
            f = d["client_deadline"]
            rows.append(["gRPC deadline", f"{f['grpc_timeout_ms']} ms timeout, no budget of its own",
                         f"{f['outcome']} after {f['answered_after_ms']} ms (search capped at {f['search_deadline_ms']} ms, "
                         f"{f['simulations_done']} simulations)"])
        if "watch_streams" in d:
            f = d["watch_streams"]
            rows.append(["watch streams", f"`max_workers` {f['max_workers']}",
                         f"{f['streams_admitted']} admitted, the next {f['third_stream']}; unary RPCs still served"])
        if "sessions" in d:
            f = d["sessions"]
            rows.append(["sessions", f"12 games, `max_sessions` {f['max_sessions']}",
                         f"{f['kept_after_12_games']} trees kept; session ids over {f['max_session_id_chars']} "
                         "characters: INVALID_ARGUMENT"])
        out += _table(["limit", "load", "result"], rows)
    d = _load("faults")
    if d:
        load = d["load"]
        out += ["### Faults (`tests/stack/test_faults.py`)", "", _stamp(d) +
                f"; {load['engines']} engines at {load['fps']:g} FPS ({load['evaluator']} search of "
                f"{load['simulations']} simulations + Evaluate per frame, {load['timeout_s']:g}-s deadlines), "
                f"{load['duration_s']} s, each server SIGKILLed for {d['outage_s']:g} s in turn", ""]
        rows = []
        for f in d["faults"]:
            wd = f["while_down"]
            parts = []
            for kind, v in wd.items():
                s = f"{kind} {v['answered']}/{v['sent']} answered"
                if v.get("refused"):
                    s += f" (refused: {_codes(v['refused'])})"
                if v.get("evaluators"):
                    s += f" ({_codes(v['evaluators'])})"
                parts.append(s)
            back = {k[:-2].replace("_", " "): v for k, v in f.items() if k.endswith("_s")}
            rows.append([f["killed"], "; ".join(parts), "; ".join(f"{k}: {v}" for k, v in back.items())])
        out += _table(["killed", "while it was down", "recovery (s)"], rows)
        rows = [[k, t["sent"], t["answered"], _codes(t["refused"]), t["lost"]] for k, t in d["totals"].items()]
        out += _table(["requests", "sent", "answered", "refused (clear status)", "lost"], rows)
    d = _load("soak")
    if d:
        req = d["load"]["requests"]
        out += ["### Soak (`tests/stack/test_soak.py`, `loadtest/soak.py`)", "", _stamp(d) +
                f"; {d['seconds']:g} s ({d['warmup_s']:g} s warm-up), {d['engines']} engines at {d['fps']:g} FPS, "
                f"each frame one {d['evaluator']} Search of {d['simulations']} simulations + one Evaluate", ""]
        rows = []
        for kind, r in req.items():
            lat = r["latency_from_schedule_ms"]
            rows.append([kind, r["sent"], r["answered"], _codes(r["refused"]), r["lost"],
                         f"{lat['p50']} / {lat['p99']} / {lat['max']}"])
        out += _table(["requests", "sent", "answered", "refused", "lost", "latency from schedule p50 / p99 / max (ms)"], rows)
        rows = [[n, f"{s['rss_mib_after_warmup']} → {s['rss_mib_end']}", s["rss_growth_mib"], s["rss_slope_mib_per_min"],
                 f"{s['fds_after_warmup']} → {s['fds_end']}", f"{s['threads_after_warmup']} → {s['threads_end']}"]
                for n, s in d["servers"].items()]
        out += _table(["server", "RSS MiB (after warm-up → end)", "RSS growth MiB", "RSS slope MiB/min", "open fds", "threads"], rows)
    d = _load("access")
    if d:
        out += ["### Access (`tests/stack/test_access.py`)", "", _stamp(d), ""]
        rows = []
        if "loopback" in d:
            lb = d["loopback"]
            rows.append(["shipped config", f"`{lb['config']}`: gRPC listens on {', '.join(map(_ip, lb['grpc_listeners']))}, "
                         f"metrics on {', '.join(map(_ip, lb['metrics_listeners']))} (from /proc/net/tcp*), nothing else"])
        if "tls" in d:
            rows.append(["TLS", "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in d["tls"].items())])
        if "mutual_tls" in d:
            rows.append(["mutual TLS", "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in d["mutual_tls"].items())])
        if "token" in d:
            calls = d["token"]["calls"]
            rows.append(["token", f"without or with a wrong token: UNAUTHENTICATED on "
                         f"{sum(v == 'UNAUTHENTICATED' for v in calls.values())} of {len(calls) * 2 // 3} calls tried; "
                         f"health without a token: {d['token']['health_without_token']}"])
        if "no_pickle_eval" in d:
            rows.append(["no pickle/eval", f"{d['no_pickle_eval']['files_checked']} serving files, "
                         f"{len(d['no_pickle_eval']['hits'])} hits"])
        if "keepalive" in d:
            k = d["keepalive"]
            rows.append(["keepalive", f"server allows a ping per {k['server_min_ping_interval_ms']} ms: a client pinging every "
                         f"{k['flooder_ping_ms']} ms got {k['flooder']} after {k['flooder_cut_after_s']} s; one pinging every "
                         f"{k['polite_ping_ms']} ms was still connected after {k['polite_connected_after_s']} s"])
        out += _table(["what", "result"], rows)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m loadtest.reliability_report", description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help=f"replace the figures section of {DOC.relative_to(REPO_ROOT)}")
    args = ap.parse_args(argv)
    text = render()
    if not args.write:
        print(text, end="")
        return 0
    doc = DOC.read_text()
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC}: no {START} ... {END} section")
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{START}\n{text}{END}{tail}")
    print(f"wrote the figures into {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
