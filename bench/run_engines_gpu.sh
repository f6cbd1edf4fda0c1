#!/usr/bin/env bash
# The engines curve on the GPU machine, in two device calls (each under the 10-minute limit). Setup as
# bench/gpu_setup.sh says (carry [".whl"]). Then:
#   bash bench/run_engines_gpu.sh curve      # N = 1, 8, 32, 64, 128 per evaluator, and the batch-call rows
#   bash bench/run_engines_gpu.sh contended  # N = 64 beside the bulk-server trainer, per policy
#   WORKERS=4 bash bench/run_engines_gpu.sh workers  # Search calls a second by search.workers, then the
#                                            # curve's N = 8, 32, 64 rows with search workers = $WORKERS and
#                                            # reward workers = $REWARD_WORKERS (default $WORKERS)
#   bash bench/run_engines_gpu.sh host_wait  # calls a second and CPU a call with host_wait auto and block
#                                            # (tandem.gpu.set_host_wait), then N = 8, 64 with block
# Each writes $OUT/engines_<machine>.json and .png (the curve; engines_<mode>_<machine>.* for the others;
# <machine>: h100, h200, ... from the GPU's name) and a short table (last). ENGINES (default 1,8,32,64,128),
# BATCH (default 16x16,1x256) and FRAMES (default 600) change the curve's rows.
set -o pipefail
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-runs/engines_gpu}
mkdir -p "$OUTDIR"
source bench/gpu_setup.sh > /dev/null
M=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i 'h[0-9]\{3\}' | tr 'A-Z' 'a-z')
M=${M:-gpu}
case "${1:-curve}" in
  curve) python3 -m bench.engines --engines "${ENGINES:-1,8,32,64,128}" --evaluators value_model,rollout \
           --batch "${BATCH-16x16,1x256}" --frames "${FRAMES:-600}" --contended 0 --policies default --out "$OUTDIR/curve" ;;
  contended) python3 -m bench.engines --engines "" --evaluators value_model --batch "" --contended 64 \
           --policies default,dynamic,static --out "$OUTDIR/contended" ;;
  workers) python3 -m bench.calls --service search,reward --backend cuda --provider auto --workers 1,2,4,8 --clients 16 --out "$OUTDIR"
           python3 -m bench.engines --engines 8,32,64 --evaluators rollout,value_model --batch "" --contended 0 \
             --policies default --search-workers "${WORKERS:-4}" --reward-workers "${REWARD_WORKERS:-${WORKERS:-4}}" \
             --out "$OUTDIR/workers" ;;
  host_wait) python3 -m bench.calls --service search,reward --backend cuda --provider auto --workers 1 --clients 16 \
           --host-wait auto,block --out "$OUTDIR"
           python3 -m bench.engines --engines 8,64 --evaluators value_model,rollout --batch "" --contended 0 \
             --policies default --host-wait block --out "$OUTDIR/host_wait" ;;
esac
# The shelf's names (bench/results/): the curve is engines_<machine>, the others engines_<mode>_<machine>.
for f in "$OUTDIR"/*/engines.json "$OUTDIR"/*/engines.png; do
  mode=$(basename "$(dirname "$f")"); name=engines_${mode}_$M; [ "$mode" = curve ] && name=engines_$M
  cp "$f" "$OUTDIR/$name.${f##*.}"
done
