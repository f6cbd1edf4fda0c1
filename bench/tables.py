"""Renders the benchmark tables of docs/benchmarks.md (Markdown) from bench/results/*.json.

Prints to stdout, one section per result file: a line saying when, where and
from which commit it was measured, then the table. mcts_throughput is pivoted
(one column of sims/s, and of L2 hit rate where measured, per variant);
frame_scheduling gets the seed's columns and where each frame's time went;
the others list their rows.

Command: ``python3 -m bench.tables [--results DIR] [--only mcts_latency,...]``
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from bench.common import RESULTS_DIR

ORDER = ("mcts_latency", "mcts_throughput", "mcts_peer", "search_quality", "frame_scheduling", "reward_latency")


def fmt_ms(v) -> str:
    if v is None:
        return "—"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def fmt_rate(v) -> str:
    """Simulations per second: 1.23 M, 45.6 k, 789."""
    if v is None:
        return "—"
    if v >= 1e6:
        return f"{v / 1e6:.3g} M"
    if v >= 1e3:
        return f"{v / 1e3:.3g} k"
    return f"{v:.0f}"


def fmt_pct(v) -> str:
    return "—" if v is None else f"{v:.1f} %"


def fmt(v) -> str:
    return "—" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def markdown(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def provenance(doc: dict) -> str:
    v = doc.get("versions", {})
    commit = (v.get("tandem_commit") or "unknown")[:10] + (" (with uncommitted changes)" if v.get("tandem_dirty") else "")
    where = doc.get("gpu") or "no GPU"
    return f"_{doc.get('date', '?')[:10]}, {where}, CPU {v.get('host_cpu', '?')}; tandem {commit}; `{doc.get('command', '')}`_"


def latency_table(rows: list[dict]) -> str:
    header = ["variant", "trees", "parallel sims", "simulations", "evaluator", "position", "p50 (ms)", "p99 (ms)"]
    body = [
        [r["variant"], fmt(r["trees"]), fmt(r["parallel_sims"]), fmt(r["simulations"]), r["evaluator"],
         r.get("position") or "empty board", fmt_ms(r["latency_ms_p50"]), fmt_ms(r["latency_ms_p99"])]
        for r in rows
    ]
    return markdown(header, body)


def throughput_tables(rows: list[dict]) -> str:
    """One pivoted table per (sweep, fixed parameter)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        sweep = r.get("sweep", "parallel_sims")
        fixed = ("trees", r["trees"]) if sweep == "parallel_sims" else ("parallel_sims", r["parallel_sims"])
        groups[(sweep, fixed, r["evaluator"])].append(r)
    out = []
    for (sweep, (fixed_name, fixed_value), evaluator), grp in groups.items():
        x_name = "parallel_sims" if sweep == "parallel_sims" else "trees"
        variants = list(dict.fromkeys(r["variant"] for r in grp))
        with_l2 = {v for v in variants if any(r["l2_hit_rate"] is not None for r in grp if r["variant"] == v)}
        header = [x_name.replace("_", " ")]
        for v in variants:
            header.append(f"{v} sims/s")
            if v in with_l2:
                header.append(f"{v} L2 hit")
        cell = {(r["variant"], r[x_name]): r for r in grp}
        body = []
        for x in sorted({r[x_name] for r in grp}):
            line = [fmt(x)]
            for v in variants:
                r = cell.get((v, x))
                line.append(fmt_rate(r["sims_per_s"]) if r else "—")
                if v in with_l2:
                    line.append(fmt_pct(r["l2_hit_rate"]) if r else "—")
            body.append(line)
        out.append(f"{x_name.replace('_', ' ')} sweep at {fixed_name.replace('_', ' ')} = {fixed_value}, {evaluator}:\n\n" + markdown(header, body))
    return "\n\n".join(out)


def peer_table(rows: list[dict]) -> str:
    header = ["system", "variant", "trees", "simulations", "evaluator", "parallel sims", "p50 (ms)", "sims/s"]
    body = [
        [r["system"], r.get("variant", ""), fmt(r["trees"]), fmt(r["simulations"]), r["evaluator"],
         fmt(r.get("parallel_sims")), fmt_ms(r["latency_ms_p50"]), fmt_rate(r["sims_per_s"])]
        for r in rows
    ]
    return markdown(header, body)


def quality_table(rows: list[dict]) -> str:
    header = ["position set", "backend", "budget", "parallel sims", "positions", "optimal move rate", "mean sims"]
    body = []
    for r in rows:
        if r.get("budget_ms") is not None:
            budget, sims = f"{fmt(r['budget_ms'])} ms per request", fmt_rate(r.get("simulations_mean"))
        else:
            budget, sims = f"{r['simulations']} sims (batched)", fmt(r["simulations"])
        body.append([r["position_set"], r["backend"], budget, fmt(r.get("parallel_sims")), fmt(r["positions"]),
                     fmt_pct(100 * r["optimal_move_rate"]), sims])
    return markdown(header, body)


def frame_table(rows: list[dict]) -> str:
    """The seed's table: frame latency per policy, plus where each frame's time went
    (the search, the Evaluate, and the reward service's own queue and model time)."""
    header = ["policy", "trainer", "engines × FPS", "frame avg / p50 / p99 (ms)", "missed", "background (frames/s)",
              "Search p50 / p99 (ms)", "Evaluate p50 / p99 (ms)", "reward queue + model p50 (ms)"]

    def pair(d: dict | None, key: str) -> str:
        lat = (d or {}).get(key) or {}
        return "—" if lat.get("p50") is None else f"{fmt_ms(lat['p50'])} / {fmt_ms(lat['p99'])}"

    body = []
    for r in rows:
        req = r.get("requests") or {}
        ev = req.get("evaluate") or {}
        server = "—"
        if (ev.get("server_queue_ms") or {}).get("p50") is not None:
            server = f"{fmt_ms(ev['server_queue_ms']['p50'])} + {fmt_ms(ev['server_compute_ms']['p50'])}"
        frame = "—" if r["frame_ms_p50"] is None else \
            f"{fmt_ms(r['frame_ms_avg'])} / {fmt_ms(r['frame_ms_p50'])} / {fmt_ms(r['frame_ms_p99'])}"
        body.append([r["policy"], _trainer(r), f"{r['clients']} × {fmt(r['fps'])}" if r["clients"] else "—", frame,
                     fmt_pct(None if r["missed_frame_share"] is None else 100 * r["missed_frame_share"]),
                     fmt(r["background_per_s"]), pair(req.get("search"), "latency_from_schedule_ms"),
                     pair(ev, "latency_from_schedule_ms"), server])
    return markdown(header, body)


def _trainer(row: dict) -> str:
    """How the row's trainer sent its frames, and where: "shm → bulk server" (older files: the transport alone)."""
    transport = row.get("background_transport")
    if transport is None:
        return "—"
    if "bulk_server" not in row:
        return transport
    return f"{transport} → {'bulk server' if row['bulk_server'] else 'reward service'}"


def generic_table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return markdown(keys, [[fmt(r.get(k)) for k in keys] for r in rows])


RENDER = {
    "mcts_latency": latency_table,
    "mcts_throughput": throughput_tables,
    "mcts_peer": peer_table,
    "search_quality": quality_table,
    "frame_scheduling": frame_table,
}


def render(results: Path, only: list[str] | None = None) -> str:
    # A benchmark may have several result files (mcts_throughput_h200.json and
    # mcts_throughput_k16_h200.json: runs with other options); each gets a table.
    docs: dict[str, list[tuple[str, dict]]] = {}
    for path in sorted(results.glob("*.json")):
        doc = json.loads(path.read_text())
        if "rows" not in doc:  # a side file (frame_scheduling_latencies.json: the raw latencies for the plot)
            continue
        docs.setdefault(doc.get("benchmark", path.stem), []).append((path.name, doc))
    names = [n for n in ORDER if n in docs] + sorted(n for n in docs if n not in ORDER)
    out = []
    for name in names:
        if only and name not in only:
            continue
        for file_name, doc in docs[name]:
            table = RENDER.get(name, generic_table)(doc["rows"]) if doc["rows"] else "(no rows)"
            out.append(f"### {name} (`{file_name}`)\n\n{provenance(doc)}\n\n{table}\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Markdown tables from bench/results/*.json")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--only", default=None, help="comma list of benchmark names")
    args = parser.parse_args(argv)
    print(render(args.results, args.only.split(",") if args.only else None))


if __name__ == "__main__":
    main()
