#!/usr/bin/env bash
# Issue 11 on the GPU in one device call: the GPU tests of the leaf channel, the
# search and the reward service; python -m bench.neural_search --mps (both hand-offs in
# one run); python -m bench.value_model_runs; then the stack as a user runs it (bench/run_stack_gpu.sh: tandem up,
# tandem play with rollouts and with the value model, 600 frames each). With
# SOAK=1 it then starts issue 12's 10-minute soak detached, as
# `bash bench/run_trainer_gpu.sh table` does (collect it with `bash
# bench/run_trainer_gpu.sh wait`, at once).
#
# STEP=tests: the tests and value_model_runs only; STEP=bench: the rest (two calls
# of under 10 minutes each, back to back); STEP=none: neither (with SOAK=1: the soak only). Setup as bench/gpu_setup.sh says (carry [".whl"]; pass TANDEM_COMMIT=<commit>).
# Writes into $OUT: pytest_gpu.log, neural_search.json, value_model_runs.json, play_rollout.json,
# play_value_model.json, status.txt; prints a table last.
set -o pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
OUTDIR=${OUT:-runs/neural_gpu}
mkdir -p "$OUTDIR"
source bench/gpu_setup.sh
echo "setup $(( $(date +%s) - t0 )) s"
STEP=${STEP:-all}
if [ "$STEP" = all ] || [ "$STEP" = tests ]; then
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/reward tests/search} 2>&1 \
  | tee "$OUTDIR/pytest_gpu.log" | tail -8
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout 180 python3 -m bench.value_model_runs --out "$OUTDIR" 2>&1 | grep -v " INFO \| WARNING " | tail -18
echo "value_model_runs done at $(( $(date +%s) - t0 )) s"
fi
if [ "$STEP" = all ] || [ "$STEP" = bench ]; then
timeout 360 python3 -m bench.neural_search --backend gpu --out "$OUTDIR" --repeats "${REPEATS:-30}" \
  --positions "${POSITIONS:-200}" --mps 2>&1 | grep -v " INFO \| WARNING " | tail -32
echo "bench done at $(( $(date +%s) - t0 )) s"
OUT=/tmp/stack_gpu TESTS="" FRAMES=${FRAMES:-600} VALUE_FRAMES=${VALUE_FRAMES:-600} bash bench/run_stack_gpu.sh 2>&1 \
  | grep -v "^setup\|^ort \|^NVIDIA" | tail -24
cp /tmp/stack_gpu/play_rollout.json /tmp/stack_gpu/play_value_model.json /tmp/stack_gpu/status.txt "$OUTDIR/"
fi
if [ -n "${SOAK:-}" ]; then
  SOAK_DIR=/root/soak; rm -rf "$SOAK_DIR" && mkdir -p "$SOAK_DIR"
  setsid bash -c "python3 -m loadtest.soak --seconds ${SOAK_SECONDS:-600} --engines 8 --fps 60 --simulations 1000 \
    --evaluator rollout --frames --trainer shm --policy dynamic --out $SOAK_DIR/soak_trainer.json \
    > $SOAK_DIR/soak.log 2>&1; echo \$? > $SOAK_DIR/rc" < /dev/null > /dev/null 2>&1 &
  echo "soak started (${SOAK_SECONDS:-600} s); collect with: bash bench/run_trainer_gpu.sh wait"
fi
echo "total $(( $(date +%s) - t0 )) s"
