#!/usr/bin/env bash
# The main job beside a trainer, as a user runs it, in one device call: `tandem up` (the shipped config: four
# processes, the bulk server among them), a trainer sending 64-frame batches by shared memory to the bulk
# server (tandem.config.bulk_address; loadtest/background.py), and meanwhile `tandem status` and `tandem play`
# 600 frames with rollouts, then with the value model. Setup as bench/gpu_setup.sh says (carry [".whl"]).
# Writes into $OUT: play_rollout_trainer.json, play_value_model_trainer.json, status_trainer.txt, trainer.json.
set -o pipefail
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-runs/play_trainer_gpu}
mkdir -p "$OUTDIR"
source bench/gpu_setup.sh > /dev/null
$TANDEM up --log-dir /tmp/play_trainer_logs > /tmp/play_trainer_up.log 2>&1 &
UP=$!
for _ in $(seq 180); do $TANDEM health 127.0.0.1:50052 >/dev/null 2>&1 && break; sleep 1; done
cat > /tmp/play_trainer.py <<'PY'
import json, sys, time
from loadtest.background import BackgroundProcess
from tandem.config import bulk_address, load_config
if __name__ == "__main__":  # the trainer's own process is spawned: it imports this file again
    cfg = load_config()
    bg = BackgroundProcess(bulk_address(cfg), cfg, batch=64, workers=2, transport="shm")
    bg.start(); t = time.monotonic(); time.sleep(float(sys.argv[2])); frames = bg.report()["frames"]; bg.stop()
    report = {**bg.report(), "address": bulk_address(cfg), "frames_per_s_while_playing": frames / (time.monotonic() - t)}
    bg.close(); json.dump(report, open(sys.argv[1], "w")); print("trainer", report)
PY
python3 /tmp/play_trainer.py "$OUTDIR/trainer.json" "${TRAINER_S:-50}" &
TRAINER=$!
sleep 5
$TANDEM status > "$OUTDIR/status_trainer.txt" 2>&1; grep -E "reward|bulk" "$OUTDIR/status_trainer.txt"
for ev in rollout value_model; do
  $TANDEM play --frames 600 --fps 60 --evaluator $ev --report "$OUTDIR/play_${ev}_trainer.json" > /dev/null 2>&1 || echo "play $ev failed"
done
wait $TRAINER; kill -INT $UP; wait $UP; echo "tandem up exited $?"
python3 - "$OUTDIR" <<'PY'
import json, sys
for ev in ("rollout", "value_model"):
    r = json.load(open(f"{sys.argv[1]}/play_{ev}_trainer.json"))
    print(ev, r["frames_answered"], "missed", r["missed_frames"], "p50/p99", r["frame_latency_ms"]["p50"],
          r["frame_latency_ms"]["p99"], "optimal", r["optimal_move_rate"], r["backends"]["handoff"], r["errors"])
PY
