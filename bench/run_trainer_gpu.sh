#!/usr/bin/env bash
# Issue 12 on the GPU: 60 FPS under a trainer's load, in two steps of device calls.
#
#   bash bench/run_trainer_gpu.sh table   # the seed's table: python -m bench.frame_scheduling, every
#                                         # scenario, the trainer on gRPC bytes and on shared memory, sent
#                                         # to the bulk server and to the reward service itself (--bulk-server
#                                         # on,off), then starts the 10-minute soak detached (setsid) and returns
#   bash bench/run_trainer_gpu.sh wait    # waits for the soak (next calls, back to back) and returns it
#   TRANSPORT=shm SOAK_SECONDS=0 bash bench/run_trainer_gpu.sh table   # one transport (~6 min), no soak: two
#       calls of under 10 minutes for both (TRANSPORT=grpc the second; each writes frame_scheduling.json)
#   TESTS="tests/reward/test_bulk_server.py ..." bash bench/run_trainer_gpu.sh table   # those GPU tests first
#
# Make each `wait` call at once after the previous one returns: the device machine is given back after
# 30 s idle, and the detached soak goes with it (2026-11-30: lost so, after 13 of its minutes).
#
# The soak: 8 engines at 60 FPS (1000 rollout simulations and a rendered frame's critical Evaluate per
# frame) beside a shared-memory trainer, dynamic policy, python -m loadtest.soak. It runs alone on the
# GPU: nothing else is started until `wait` has returned it. Setup as bench/gpu_setup.sh says (carry
# [".whl"]; pass TANDEM_COMMIT=<commit>). Writes into $OUT: frame_scheduling.json,
# frame_scheduling_latencies.json, bench.log; then soak_trainer.json, soak.log.
# Draw the PNG where matplotlib is: python -m bench.frame_scheduling --plot-only <folder>
set -o pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
OUTDIR=${OUT:-runs/trainer_gpu}
SOAK_DIR=/root/soak
mkdir -p "$OUTDIR"
source bench/gpu_setup.sh
echo "setup $(( $(date +%s) - t0 )) s"
case "${1:-table}" in
table)
  if [ -n "${TESTS:-}" ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider -x $TESTS 2>&1 | tee "$OUTDIR/pytest_gpu.log" | tail -6 \
      || { echo "tests failed: no table"; exit 1; }
    echo "tests done at $(( $(date +%s) - t0 )) s"
  fi
  timeout 540 python3 -m bench.frame_scheduling --seconds "${SECONDS_PER_SCENARIO:-10}" --no-plot --out "$OUTDIR" \
    --background-transport "${TRANSPORT:-grpc,shm}" --bulk-server "${BULK:-on,off}" \
    2>&1 | tee "$OUTDIR/bench.log" | grep -v " INFO \| WARNING " | tail -14
  echo "table done at $(( $(date +%s) - t0 )) s"
  if [ -n "${SOAK_SECONDS:-600}" ] && [ "${SOAK_SECONDS:-600}" != 0 ]; then
    rm -rf "$SOAK_DIR" && mkdir -p "$SOAK_DIR"
    setsid bash -c "python3 -m loadtest.soak --seconds ${SOAK_SECONDS:-600} --engines 8 --fps 60 --simulations 1000 \
      --evaluator rollout --frames --trainer shm --policy dynamic --out $SOAK_DIR/soak_trainer.json \
      > $SOAK_DIR/soak.log 2>&1; echo \$? > $SOAK_DIR/rc" < /dev/null > /dev/null 2>&1 &
    echo "soak started (${SOAK_SECONDS:-600} s); call again with: wait"
  fi
  ;;
wait)
  while [ ! -f "$SOAK_DIR/rc" ] && [ $(( $(date +%s) - t0 )) -lt "${WAIT_MAX_S:-570}" ]; do sleep 5; done
  if [ -f "$SOAK_DIR/rc" ]; then
    cp "$SOAK_DIR/soak_trainer.json" "$OUTDIR/" 2>/dev/null; tail -c 20000 "$SOAK_DIR/soak.log" > "$OUTDIR/soak.log"
    echo "soak exit $(cat $SOAK_DIR/rc)"
    python3 - "$OUTDIR/soak_trainer.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for kind, q in r["load"]["requests"].items():
    print(kind, {k: q[k] for k in ("sent", "answered", "refused", "lost")}, q["latency_from_schedule_ms"])
print("trainer", r["trainer"]); print("lever", r["bulk_lever"]); print("gpu", r["gpu_device"])
for name, s in r["servers"].items():
    print(name, {k: s.get(k) for k in ("rss_growth_mib", "rss_slope_mib_per_min", "gpu_mib_growth", "fds_growth",
                                         "threads_growth")})
PY
  else
    echo "soak still running at $(( $(date +%s) - t0 )) s; call again"; tail -3 "$SOAK_DIR/soak.log"
  fi
  ;;
esac
