#!/usr/bin/env bash
# Where the search and reward services' interpreters go while N engines play (GPU machine): `tandem up`
# with the shipped config, then for each N in $ENGINES (default "1 8 64") N `tandem play` processes
# ($EVALUATOR, default value_model; 420 frames at 60 FPS) and, 3 s in, py-spy on both services for 4 s twice: --gil (what
# holds the interpreter lock) and all threads. Setup as bench/gpu_setup.sh says; py-spy is carried
# (carry ".venv/bin/py-spy": the `bench` extra installs it here). About 2 minutes.
#   ENGINES="1 8 64" bash bench/run_profile_gpu.sh
# Writes $OUT/profile/<service>_<N>[_gil].raw, the play reports, both services' /metrics after each N
# (metrics_<N>_<port>.txt: cumulative), the servers' logs; prints each profile's top functions
# (bench/profile_summary.py) and each N's missed frames and search phases, last.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -n "${NO_GPU_SETUP:-}" ] || source bench/gpu_setup.sh > /dev/null  # NO_GPU_SETUP=1: a machine set up already (a CPU smoke run)
PYSPY=${PYSPY:-$PWD/.venv/bin/py-spy}
D=${OUT:-/tmp}/profile
mkdir -p "$D"
python3 -m stack up --log-dir "$D/logs" > "$D/up.log" 2>&1 &
UP=$!
for _ in $(seq 1 240); do grep -q "tandem is up" "$D/up.log" && break; sleep 1; done
S=$(pgrep -f "stack serve search" | head -1)
R=$(pgrep -f "stack serve reward( |$)" | head -1)
for N in ${ENGINES:-1 8 64}; do
  plays=()
  for e in $(seq 1 "$N"); do
    python3 -m stack play --frames 420 --evaluator "${EVALUATOR:-value_model}" --seed "$e" --report "$D/play_${N}_$e.json" \
      > /dev/null 2>&1 & plays+=($!)
  done
  sleep 3
  for gil in "--gil" ""; do
    tag=${gil:+_gil}
    timeout 10 "$PYSPY" record -p "$S" -d 4 -r 200 $gil -f raw -o "$D/search_${N}${tag}.raw" > /dev/null 2>&1 &
    s_spy=$!
    timeout 10 "$PYSPY" record -p "$R" -d 4 -r 200 $gil -f raw -o "$D/reward_${N}${tag}.raw" > /dev/null 2>&1
    wait $s_spy
  done
  wait "${plays[@]}"
  for port in 9452 9451; do
    python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" \
      "http://127.0.0.1:$port/metrics" > "$D/metrics_${N}_$port.txt" 2>&1
  done
done
kill -INT $UP; wait $UP
python3 -m bench.profile_summary "$D"/*_gil.raw --top 25
python3 - "$D" ${ENGINES:-1 8 64} <<'PY'
import glob, json, sys
for n in sys.argv[2:]:
    rs = [json.load(open(f)) for f in glob.glob(f"{sys.argv[1]}/play_{n}_*.json")]
    sims = [r["simulations_per_frame"]["mean"] or 0 for r in rs]
    print(f"{n} engines: {len(rs)} reports, missed {sum(r['missed_frames'] for r in rs)} of {420 * int(n)} frames, "
          f"simulations a frame {sum(sims) / max(len(sims), 1):.1f}, errors {sum(sum(r['errors'].values()) for r in rs)}")
    for key in ("frame_latency_ms", "search_latency_ms"):
        print(f"  {key} p50 {[r[key]['p50'] for r in rs][:8]}")
    for kind in ("search", "evaluate"):
        print(f"  {kind} request p50/p99 ms", [(r["request_latency_ms"][kind]["p50"], r["request_latency_ms"][kind]["p99"])
                                               for r in rs if kind in r.get("request_latency_ms", {})][:6])
    phases = {k: [r["search_phases_ms"][k]["mean"] for r in rs if r.get("search_phases_ms")] for k in
              ("select", "expand", "evaluate", "backup")}
    print("  phases mean ms (first engines):", {k: v[:4] for k, v in phases.items()})
PY
