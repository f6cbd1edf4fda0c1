#!/usr/bin/env bash
# Every figure the README's "Figures" table quotes, re-run on the GPU machine with the commands that made
# them, in three device calls of under 10 minutes each (about 20 minutes in all). Setup as
# bench/gpu_setup.sh says (carry [".whl"]; pass TANDEM_COMMIT=<commit> from a clean tree). Then:
#   STEP=search bash bench/run_headline_gpu.sh   # mcts_latency (GPU and CPU reference), mcts_throughput k16 (~4 min)
#   STEP=neural bash bench/run_headline_gpu.sh   # neural_search: latency by both hand-offs, throughput, quality (~7 min)
#   STEP=play   bash bench/run_headline_gpu.sh   # tandem up + tandem play (value model, 600 frames) in both
#                                                # modes, and frame_scheduling beside a bulk-server trainer (~8 min)
# Each writes into $OUT the result files named by benchmark and machine (<name>_h200.json on an H200), then prints
# the figures the README quotes, last. Copy them to bench/results/, replace the files the README and the
# manual cite, and run `pytest tests/test_doc_figures.py`: it fails on every figure that moved.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_setup.sh
OUT=${OUT:-/tmp/headline}
mkdir -p "$OUT"
STEP=${STEP:?set STEP=search, neural or play}
# The machine kind in the files' names (h100, h200, ...), from the GPU's name.
M=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i 'h[0-9]\{3\}' | tr 'A-Z' 'a-z')
M=${M:-gpu}

case "$STEP" in
search)
  python3 -m bench.mcts_latency --backend gpu --out "$OUT/gpu" && mv "$OUT/gpu/mcts_latency.json" "$OUT/mcts_latency_solver_${M}.json"
  python3 -m bench.mcts_latency --backend cpu_reference --out "$OUT/cpu" && mv "$OUT/cpu/mcts_latency.json" "$OUT/mcts_latency_cpu_reference_${M}.json"
  python3 -m bench.mcts_throughput --backend gpu --parallel-sweep 16 --sweep-trees 4,16,64,256,1024 --batch-sweep 1 \
    --batch-parallel-sims 16 --out "$OUT/thr" && mv "$OUT/thr/mcts_throughput.json" "$OUT/mcts_throughput_k16_${M}.json"
  ;;
neural)
  python3 -m bench.neural_search --backend gpu --mps --repeats 20 --kinds latency --serving leaf_channel --value-sims-per-warp 32 \
    --handoffs leaf_channel,in_process --out "$OUT/lat" && mv "$OUT/lat/neural_search.json" "$OUT/neural_search_latency_${M}.json"
  python3 -m bench.neural_search --backend gpu --mps --repeats 10 --kinds throughput --handoffs leaf_channel,in_process \
    --out "$OUT/thr" && mv "$OUT/thr/neural_search.json" "$OUT/neural_search_throughput_${M}.json"
  python3 -m bench.neural_search --backend gpu --mps --kinds search_quality --serving leaf_channel --value-sims-per-warp 32 \
    --out "$OUT/q" && mv "$OUT/q/neural_search.json" "$OUT/neural_search_quality_${M}.json"
  ;;
play)
  for mode in two_process co_located; do
    co=""; [ "$mode" = co_located ] && co=1
    CO_LOCATED=$co TESTS="" FRAMES=120 VALUE_FRAMES=600 OUT="$OUT/$mode" bash bench/run_stack_gpu.sh \
      && cp "$OUT/$mode/play_value_model.json" "$OUT/play_value_model_${mode}_${M}.json"
  done
  cp "$OUT/two_process/play_rollout.json" "$OUT/play_rollout_two_process_${M}.json"
  python3 -m bench.frame_scheduling --seconds 8 --no-plot --out "$OUT/sched" --background-transport shm --bulk-server on,off \
    && mv "$OUT/sched/frame_scheduling.json" "$OUT/frame_scheduling_bulk_server_shm_${M}.json"
  ;;
*) echo "STEP=$STEP: expected search, neural or play" >&2; exit 2 ;;
esac
echo "== result files in $OUT"
ls -1 "$OUT"/*_"$M".json 2>/dev/null
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*_*.json")):
    d = json.loads(f.read_text())
    print(f.name, d.get("date"), d.get("gpu"), (d.get("versions") or {}).get("tandem_commit"),
          "dirty" if (d.get("versions") or {}).get("tandem_dirty") else "")
EOF
