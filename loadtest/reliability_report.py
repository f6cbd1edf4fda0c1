"""Reliability figures: the tests write them, this renders them.

The reliability tests (``tests/stack/test_bad_input_properties.py``, ``tests/stack/fuzz/``,
``tests/stack/test_limits.py``, ``tests/stack/test_faults.py``, ``tests/stack/test_soak.py``,
``tests/stack/test_access.py``) each fill a section of
:mod:`loadtest.reliability_figures` and save it to ``runs/reliability/<name>.json``;
``python -m loadtest.reliability_report`` prints the markdown tables of
``docs/reliability.md`` from whatever is there (``--write`` replaces the
generated section of that page), one function per section.
"""
from __future__ import annotations

from collections.abc import Callable

from loadtest.reliability_figures import (
    AccessFigures,
    BadInputFigures,
    FaultsFigures,
    Figures,
    FuzzFigures,
    LimitsFigures,
    RequestCounts,
    SoakFigures,
    Stamp,
    load_figures,
)
from tandem.paths import REPO_ROOT

START, END = "<!-- reliability-figures:start -->", "<!-- reliability-figures:end -->"
DOC = REPO_ROOT / "docs" / "reliability.md"
# Codes that mean the server failed rather than refused: never expected.
_FAILURES = ("UNKNOWN", "INTERNAL")


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return out + [""]


def _codes(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"


def _words(d: dict) -> str:
    """``{"a_b": v}`` as "a b: v; ..."."""
    return "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in d.items())


def _ip(hex_addr: str) -> str:
    """/proc/net/tcp's hex address as text (loopback forms only; others as they are)."""
    return {"0100007F": "127.0.0.1", "0000000000000000FFFF00000100007F": "::ffff:127.0.0.1",
            "00000000000000000000000001000000": "::1", "00000000": "0.0.0.0"}.get(hex_addr, hex_addr)


def _stamp(stamp: Stamp) -> str:
    return f"_{stamp.date}, {stamp.host.cpus} CPUs, Python {stamp.host.python}_"


def _bad_input(stamp: Stamp, f: BadInputFigures) -> list[str]:
    out = ["### Bad input over gRPC (`tests/stack/test_bad_input_properties.py`)", "", _stamp(stamp), ""]
    rows = []
    for rpc, r in f.rpcs.items():
        o = r.outcomes
        refused = {k: v for k, v in o.items() if k != "OK" and k not in _FAILURES}
        rows.append([f"`{rpc}`", r.inputs, o.get("OK", 0), _codes(refused), sum(o.get(k, 0) for k in _FAILURES)])
    out += _table(["RPC", "malformed inputs", "OK (valid after all)", "refused with", "UNKNOWN / INTERNAL"], rows)
    total = sum(r.inputs for r in f.rpcs.values())
    return out + [f"{total} inputs in all ({f.examples_per_property} per property); after each one the server "
                  "answered a valid call.", ""]


def _fuzz(stamp: Stamp, f: FuzzFigures) -> list[str]:
    out = ["### Fuzzing of request decoding (`tests/stack/fuzz/`)", "", _stamp(stamp) + f", {f.budget_s:g} s budget", ""]
    rows = [[f"`{t.target}`", t.code, t.examples, t.elapsed_s, _codes(t.outcomes)] for t in f.targets]
    return out + _table(["target", "code under test", "inputs", "s", "outcomes"], rows)


def _limits(stamp: Stamp, f: LimitsFigures) -> list[str]:
    rows = []
    if fl := f.flood:
        rows.append(["flood", f"{fl.sent} concurrent {fl.search_deadline_ms:g}-ms searches, `max_concurrent_rpcs` "
                     f"{fl.max_concurrent_rpcs}, {fl.max_workers} threads",
                     f"{fl.answered} answered ({fl.answered_latency_ms_min}-{fl.answered_latency_ms_max} ms), "
                     f"{fl.refused_resource_exhausted} RESOURCE_EXHAUSTED within {fl.refused_latency_ms_max} ms, "
                     f"{fl.lost} lost; health probe while saturated: {fl.health_probe_while_saturated}"])
    if c := f.cancel:
        rows.append(["cancel", f"client cancels a {c.budget_simulations:,}-simulation search after "
                     f"{c.cancelled_after_ms / 1000:g} s",
                     f"stopped {c.stopped_after_cancel_ms} ms later after {c.simulations_done} simulations "
                     f"({c.waves} waves); its one thread served the next call"])
    if d := f.client_deadline:
        rows.append(["gRPC deadline", f"{d.grpc_timeout_ms} ms timeout, no budget of its own",
                     f"{d.outcome} after {d.answered_after_ms} ms (search capped at {d.search_deadline_ms} ms, "
                     f"{d.simulations_done} simulations)"])
    if w := f.watch_streams:
        rows.append(["watch streams", f"`max_workers` {w.max_workers}",
                     f"{w.streams_admitted} admitted, the next {w.third_stream}; unary RPCs still served"])
    if s := f.sessions:
        rows.append(["sessions", f"{s.games} games, `max_sessions` {s.max_sessions}",
                     f"{s.kept_after_games} trees kept; session ids over {s.max_session_id_chars} "
                     "characters: INVALID_ARGUMENT"])
    return ["### Limits (`tests/stack/test_limits.py`)", "", _stamp(stamp), ""] + \
        _table(["limit", "load", "result"], rows)


def _while_down(kind: str, r: RequestCounts) -> str:
    s = f"{kind} {r.answered}/{r.sent} answered"
    if r.refused:
        s += f" (refused: {_codes(r.refused)})"
    if r.evaluators:
        s += f" ({_codes(r.evaluators)})"
    return s


def _faults(stamp: Stamp, f: FaultsFigures) -> list[str]:
    load = f.load
    out = ["### Faults (`tests/stack/test_faults.py`)", "", _stamp(stamp) +
           f"; {load.engines} engines at {load.fps:g} FPS ({load.evaluator} search of "
           f"{load.simulations} simulations + Evaluate per frame, {load.timeout_s:g}-s deadlines), "
           f"{load.duration_s} s, each server SIGKILLed for {f.outage_s:g} s in turn", ""]
    rows = [[x.killed, "; ".join(_while_down(k, r) for k, r in x.while_down.items()), _words(x.recovery_s)]
            for x in f.faults]
    out += _table(["killed", "while it was down", "recovery (s)"], rows)
    rows = [[k, t.sent, t.answered, _codes(t.refused), t.lost] for k, t in f.totals.items()]
    return out + _table(["requests", "sent", "answered", "refused (clear status)", "lost"], rows)


def _soak(stamp: Stamp, f: SoakFigures) -> list[str]:
    out = ["### Soak (`tests/stack/test_soak.py`, `loadtest/soak.py`)", "", _stamp(stamp) +
           f"; {f.duration_s:g} s ({f.warmup_s:g} s warm-up), {f.engines} engines at {f.fps:g} FPS, "
           f"each frame one {f.evaluator} Search of {f.simulations} simulations + one Evaluate", ""]
    rows = []
    for kind, r in f.requests.items():
        lat = r.latency_from_schedule_ms
        rows.append([kind, r.sent, r.answered, _codes(r.refused), r.lost, f"{lat.p50} / {lat.p99} / {lat.max}"])
    out += _table(["requests", "sent", "answered", "refused", "lost", "latency from schedule p50 / p99 / max (ms)"], rows)
    rows = [[n, f"{s.rss_mib_after_warmup} → {s.rss_mib_end}", s.rss_growth_mib, s.rss_slope_mib_per_min,
             f"{s.fds_after_warmup} → {s.fds_end}", f"{s.threads_after_warmup} → {s.threads_end}"]
            for n, s in f.servers.items()]
    return out + _table(["server", "RSS MiB (after warm-up → end)", "RSS growth MiB", "RSS slope MiB/min", "open fds",
                         "threads"], rows)


def _access(stamp: Stamp, f: AccessFigures) -> list[str]:
    rows = []
    if lb := f.loopback:
        rows.append(["shipped config", f"`{lb.config}`: gRPC listens on {', '.join(map(_ip, lb.grpc_listeners))}, "
                     f"metrics on {', '.join(map(_ip, lb.metrics_listeners))} (from /proc/net/tcp*), nothing else"])
    if f.tls:
        rows.append(["TLS", _words(f.tls)])
    if m := f.mutual_tls:
        rows.append(["mutual TLS", _words({**m.outcomes, "search_to_reward": m.search_to_reward,
                                           "services_registered_with_scheduler": m.services_registered_with_scheduler})])
    if t := f.token:
        tried = [code for call, code in t.calls.items() if not call.endswith("/right")]
        rows.append(["token", f"without or with a wrong token: UNAUTHENTICATED on "
                     f"{tried.count('UNAUTHENTICATED')} of {len(tried)} calls tried; "
                     f"health without a token: {t.health_without_token}"])
    if p := f.no_pickle_eval:
        rows.append(["no pickle/eval", f"{p.files_checked} serving files, {len(p.hits)} hits"])
    if k := f.keepalive:
        rows.append(["keepalive", f"server allows a ping per {k.server_min_ping_interval_ms} ms: a client pinging "
                     f"every {k.flooder_ping_ms} ms got {k.flooder_outcome} after {k.flooder_cut_after_s} s; one "
                     f"pinging every {k.polite_ping_ms} ms was still connected after {k.polite_connected_after_s} s"])
    return ["### Access (`tests/stack/test_access.py`)", "", _stamp(stamp), ""] + _table(["what", "result"], rows)


# The page's sections, in order: each section's figures and the function that renders them.
SECTIONS: list[tuple[type[Figures], Callable[[Stamp, Figures], list[str]]]] = [
    (BadInputFigures, _bad_input), (FuzzFigures, _fuzz), (LimitsFigures, _limits),
    (FaultsFigures, _faults), (SoakFigures, _soak), (AccessFigures, _access),
]


def render() -> str:
    """The markdown of every figure file present (sections without one are left out).

    Raises:
        json.JSONDecodeError, KeyError, TypeError: a figures file does not fit its schema
            (see ``loadtest.reliability_figures.load_figures``).
    """
    out: list[str] = []
    for cls, section in SECTIONS:
        loaded = load_figures(cls)
        if loaded is not None:
            out += section(*loaded)
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
