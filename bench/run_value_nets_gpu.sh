#!/usr/bin/env bash
# Choosing the value network's size on the GPU machine, in two device calls of
# under 10 minutes each (as docs/benchmarks.md's "Choosing the value network"
# was made, 2026-12-01):
#
#   STEP=train bash bench/run_value_nets_gpu.sh
#       trains every SIZES network at once on the one GPU, each in its own copy
#       of the tree under $WORK (train_connect4_value --device cuda, the shipped
#       command's data, split and head; --compare against the shipped file), then
#       searches the validation openings with each and with the shipped network
#       (bench.value_search_quality --provider cuda), and prints a table; the
#       GPU tests run beside the training (untimed; a loaded GPU can fail the
#       timing-bound ones: run them alone to judge them).
#   STEP=pick PICK=96x8 bash bench/run_value_nets_gpu.sh
#       in the next call (the machine keeps $WORK while it stays warm): the
#       Pons sets at equal simulations for the shipped and the picked network;
#       the 16 ms search_quality rows of each, the shipped one first; then,
#       with the pick copied over reward_service/models/connect4_value.{onnx,md},
#       bench.neural_search's latency and throughput rows and the stack as a
#       user runs it (bench/run_stack_gpu.sh: tandem up + tandem play, 600 frames
#       with each evaluator).
#
# SIZES: channels x residual blocks, space-separated (default "64x6 96x8 128x10 40x5");
# EPOCHS (12), BATCH (512). Setup as bench/gpu_setup.sh says (carry [".whl"];
# pass TANDEM_COMMIT=<commit>). Writes into $OUT (at most 8 files come back):
# train: net_<size>.tgz (the .onnx, its card, the training log), logs.tgz;
# pick: value_search_quality_{shipped,pick}/, quality_{shipped,pick}/, lat/ (result
# files), play.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-runs/value_nets_gpu}
WORK=${WORK:-/root/value_nets}
SIZES=${SIZES:-64x6 96x8 128x10 40x5}
MODELS=reward_service/models
VALIDATION=data/connect4/validation/openings_05-14.jsonl
mkdir -p "$OUTDIR" "$WORK"
source bench/gpu_setup.sh >/dev/null 2>&1
export PYTHONPATH=/root/ortsite:/tmp/site:$PWD

search_validation() {  # $1 label, $2 model file: the validation openings at 600 simulations, in the background
  timeout 240 python3 -m bench.value_search_quality --provider cuda --threads 2 --models "$2" \
    --sets "$VALIDATION" --out "$WORK/vsq_$1" > "$WORK/vsq_$1.log" 2>&1 &
}

rate() {  # $1 result dir: "rate (misses)" of each row
  python3 -c "import json,sys; print(' '.join(f\"{r['position_set']} {r['optimal_move_rate']:.3f} ({r['misses']})\"
    for r in json.load(open(sys.argv[1] + '/value_search_quality.json'))['rows']))" "$1" 2>/dev/null || echo "no result"
}

if [ "${STEP:-train}" = train ]; then
  cp "$MODELS/connect4_value.onnx" "$WORK/shipped.onnx"
  (timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/reward tests/search tests/training/test_train.py \
     --ignore=tests/reward/test_oip.py \
     --deselect tests/reward/test_oip_gpu.py::test_cuda_regions_over_the_open_inference_protocol \
     > "$WORK/pytest_gpu.log" 2>&1) &
  TESTS_PID=$!
  TRAININGS=""
  for size in $SIZES; do
    w="$WORK/$size"; mkdir -p "$w"
    tar --exclude=./.ortgpu --exclude=./.whl --exclude=./runs -cf - . | tar -xf - -C "$w"
    (cd "$w" && cp "$MODELS/connect4_value.onnx" prev.onnx \
      && timeout 360 python3 -m training.train_connect4_value --out "$MODELS/connect4_value.onnx" --device cuda \
           --threads 3 --epochs "${EPOCHS:-12}" --batch "${BATCH:-512}" --value-head wdl \
           --channels "${size%x*}" --blocks "${size#*x}" --compare prev.onnx --compare-rev "${TANDEM_COMMIT:-HEAD}" \
           > train.log 2>&1) &
    TRAININGS="$TRAININGS $!"
  done
  wait $TRAININGS
  search_validation shipped "$WORK/shipped.onnx"
  for size in $SIZES; do [ -f "$WORK/$size/$MODELS/connect4_value.onnx" ] && search_validation "$size" "$WORK/$size/$MODELS/connect4_value.onnx"; done
  wait
  echo "GPU tests (beside the training): $(tail -1 "$WORK/pytest_gpu.log")"
  printf '%-8s %s\n' network "validation openings at 600 simulations"
  for label in shipped $SIZES; do printf '%-8s %s\n' "$label" "$(rate "$WORK/vsq_$label")"; done
  mkdir -p "$OUTDIR/logs"
  for size in $SIZES; do
    tar czf "$OUTDIR/net_$size.tgz" -C "$WORK/$size" "$MODELS/connect4_value.onnx" "$MODELS/connect4_value.md" train.log
  done
  cp -r "$WORK"/vsq_* "$WORK"/*.log "$OUTDIR/logs/"; tar czf "$OUTDIR/logs.tgz" -C "$OUTDIR" logs && rm -rf "$OUTDIR/logs"
fi

if [ "${STEP:-train}" = pick ]; then
  pick="$WORK/$PICK/$MODELS"
  [ -f "$pick/connect4_value.onnx" ] || { echo "no trained network $PICK under $WORK (run STEP=train first)"; exit 1; }
  cp "$MODELS/connect4_value.onnx" "$WORK/shipped.onnx"
  PONS=Test_L1_R1,Test_L1_R2,Test_L2_R1,Test_L3_R1
  for label in shipped pick; do
    f="$WORK/shipped.onnx"; [ $label = pick ] && f="$pick/connect4_value.onnx"
    timeout 240 python3 -m bench.value_search_quality --provider cuda --threads 2 --models "$f" --sets $PONS \
      --out "$OUTDIR/value_search_quality_$label" > "$WORK/vsqp_$label.log" 2>&1 &
  done
  wait
  for label in shipped pick; do
    [ $label = pick ] && cp "$pick/connect4_value.onnx" "$pick/connect4_value.md" "$MODELS/"
    timeout 200 python3 -m bench.neural_search --backend gpu --out "$OUTDIR/quality_$label" --kinds search_quality \
      --positions 200 --value-waves 32 --value-sims-per-warp 32 > "$WORK/quality_$label.log" 2>&1
  done
  timeout 180 python3 -m bench.neural_search --backend gpu --out "$OUTDIR/lat" --repeats 20 --kinds latency,throughput \
    --timeline --value-sims-per-warp 32 > "$WORK/lat.log" 2>&1
  mkdir -p "$WORK/play"
  OUT="$WORK/play" TESTS="" FRAMES=600 VALUE_FRAMES=600 timeout 240 bash bench/run_stack_gpu.sh > "$WORK/play.log" 2>&1
  cp "$WORK"/*.log "$WORK/play/" 2>/dev/null; tar czf "$OUTDIR/play.tgz" -C "$WORK/play" .
  for label in shipped pick; do echo "$label at equal simulations: $(rate "$OUTDIR/value_search_quality_$label")"; done
  python3 - "$OUTDIR" <<'EOF'
import glob, json, sys
out = sys.argv[1]
for label in ("shipped", "pick"):
    for f in glob.glob(f"{out}/quality_{label}/*.json"):
        for r in json.load(open(f))["rows"]:
            print(f"{label:8s} 16 ms {r['position_set']:11s} {r['evaluator']:12s} {r['optimal_move_rate']:.3f} "
                  f"({r['simulations_mean']:.0f} simulations)")
for f in glob.glob(f"{out}/lat/*.json"):
    for r in json.load(open(f))["rows"]:
        if r["kind"] in ("latency", "throughput") and r["handoff"] == "leaf_channel":
            size = r.get("wave", r.get("batch"))
            print(f"pick     {r['kind']:10s} {size:5d}  p50 {r['latency_ms_p50']:.2f} ms  {r['evals_per_s'] / 1e6:.2f} M/s")
EOF
  tail -4 "$WORK/play.log"
fi
