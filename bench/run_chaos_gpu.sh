#!/usr/bin/env bash
# The chaos run on the GPU machine as a user runs it, in one device call (under the 10-minute limit):
# `tandem up` with the shipped config, 64 engines at 60 FPS (value model) and a trainer at the bulk
# server, each server SIGKILLed in turn every minute and the search service stopped (SIGSTOP) for 5 s
# (loadtest/chaos.py, as the benchmark bench/chaos.py). Setup as bench/gpu_setup.sh says (carry [".whl"]; pass TANDEM_COMMIT=<commit>).
#   bash bench/run_chaos_gpu.sh                 # 8 minutes of load
#   MINUTES=2 ENGINES=8 bash bench/run_chaos_gpu.sh
# Writes $OUT/chaos_h200.json and prints its table last.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_setup.sh
OUT=${OUT:-runs}
mkdir -p "$OUT"
python3 -m bench.chaos --minutes "${MINUTES:-8}" --engines "${ENGINES:-64}" --fps 60 --evaluator value_model \
  --log-dir /tmp/chaos_logs --out "$OUT" && mv "$OUT/chaos.json" "$OUT/chaos_h200.json"
