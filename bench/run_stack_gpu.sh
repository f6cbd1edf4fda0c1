#!/usr/bin/env bash
# The stack on the GPU as a user runs it, in one device call: the GPU tests,
# then `tandem up` in the background, `tandem status`, `tandem play` (rollouts,
# then the default evaluator: the value model on a GPU, 120 frames to warm and
# the rest measured) and a clean stop.
#
# From the repository root on the GPU machine (the device tool's `run`, with
# carry [".whl"] holding the grpcio-health-checking, grpcio-reflection and
# onnxconverter-common wheels; onnxruntime-gpu in /root/ortsite if it was
# carried in parts as bench/run_scheduling_gpu.sh's header says):
#
#   bash bench/run_stack_gpu.sh                 # GPU tests + play
#   TESTS="" bash bench/run_stack_gpu.sh        # play only
#   FRAMES=600 VALUE_FRAMES=600 bash bench/run_stack_gpu.sh
#   BENCH="first_request mcts_latency" bash bench/run_stack_gpu.sh   # then these benchmarks (GPU rows)
#   KILL_REWARD=1 ...   # then kill -9 the reward server, check the restart, play 120 value-model frames
#   CO_LOCATED=1 ...    # co-located mode (co_located: true): one process, the leaves handed over in-process
#   (pass TANDEM_COMMIT=<commit>: the device copy's .git may be older than its work tree)
#
# Writes into $OUT (else runs/stack_gpu): pytest_gpu.log, play_rollout.json,
# play_value_model.json, status.txt and each benchmark's result file (the
# servers' logs go to $LOGS, default /tmp/stack_gpu_logs: the device tool
# returns at most 8 files); prints a table last.
set -o pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
OUTDIR=${OUT:-runs/stack_gpu}
LOGS=${LOGS:-/tmp/stack_gpu_logs}
mkdir -p "$OUTDIR" "$LOGS"
source bench/gpu_setup.sh
echo "setup $(( $(date +%s) - t0 )) s; tandem = $TANDEM"

TESTS=${TESTS-tests}
if [ -n "$TESTS" ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS 2>&1 | tee "$OUTDIR/pytest_gpu.log" | tail -12
  echo "tests done at $(( $(date +%s) - t0 )) s"
fi

CONFIG_ARG=()
if [ -n "${CO_LOCATED:-}" ]; then  # the bundled config with co_located: true
  python3 -c "import yaml; d = yaml.safe_load(open('deploy/config/tandem.yaml')); d['co_located'] = True; \
yaml.safe_dump(d, open('$LOGS/co_located.yaml', 'w'))"
  CONFIG_ARG=(--config "$LOGS/co_located.yaml")
fi
$TANDEM up "${CONFIG_ARG[@]}" --log-dir "$LOGS" > "$LOGS/up.log" 2>&1 &
UP=$!
for _ in $(seq 120); do $TANDEM health 127.0.0.1:50052 >/dev/null 2>&1 && break; sleep 1; done
$TANDEM status > "$OUTDIR/status.txt" 2>&1; head -20 "$OUTDIR/status.txt"
$TANDEM play "${CONFIG_ARG[@]}" --evaluator rollout --frames "${FRAMES:-600}" --report "$OUTDIR/play_rollout.json" \
  > "$OUTDIR/play_rollout.txt" 2>&1
# The default evaluator (auto: the search service's search.evaluator, the value model on a GPU), as a user plays.
$TANDEM play "${CONFIG_ARG[@]}" --frames 120 --report "$OUTDIR/play_value_warm.json" > /dev/null 2>&1
$TANDEM play "${CONFIG_ARG[@]}" --frames "${VALUE_FRAMES:-240}" --report "$OUTDIR/play_value_model.json" \
  > "$OUTDIR/play_value_model.txt" 2>&1
if [ -n "${KILL_REWARD:-}" ]; then  # supervision on the GPU: kill -9 the reward server, tandem up restarts it
  pkill -9 -f "stack serve reward" && echo "reward server killed"
  sleep 2; for _ in $(seq 60); do $TANDEM health 127.0.0.1:50051 >/dev/null 2>&1 && break; sleep 1; done
  $TANDEM status 2>&1 | grep -i -E "restart|reward " | head -4
  $TANDEM play --evaluator value_model --frames 120 --report "$OUTDIR/play_after_restart.json" 2>&1 | tail -3
fi
kill -TERM $UP; wait $UP; echo "tandem up exited $?"
for b in ${BENCH:-}; do
  timeout 240 python3 -m "bench.$b" --backend gpu --out "$OUTDIR" 2>&1 | tail -12
done
tail -3 "$LOGS/up.log"
python3 - "$OUTDIR" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print(f"{'evaluator':12} {'frames':>6} {'sims/frame':>10} {'p50 ms':>7} {'p99 ms':>7} {'missed':>6} {'optimal':>7}")
for name in ("rollout", "value_model"):
    p = out / f"play_{name}.json"
    if not p.exists():
        print(name, "no report"); continue
    r = json.loads(p.read_text())
    lat, sims = r["frame_latency_ms"], r["simulations_per_frame"]
    print(f"{name:12} {r['frames']:6} {sims['mean']:10.1f} {lat['p50']:7.2f} {lat['p99']:7.2f} "
          f"{r['missed_frames']:6} {r['optimal_move_rate'] or 0:7.3f}  {r['backends']}")
PY
echo "total $(( $(date +%s) - t0 )) s"
