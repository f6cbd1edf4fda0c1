#!/usr/bin/env bash
# Scheduling GPU run (issue 5): tandem doctor --deep, the GPU tests of the
# scheduling parts, then the 60 FPS frame-scheduling benchmark under every
# policy (bench/frame_scheduling.py), all in one device call.
#
# Needs onnxruntime-gpu on the machine, carried in parts exactly as for
# bench/run_reward_gpu.sh (see its header: ort-gpu-parts.sh from the team's shared tools
# `prepare`, then per part `stage N` + a device call carrying [".ortgpu"]),
# then one device call carrying [".whl"], from the repository root:
#
#   bash bench/run_scheduling_gpu.sh              # about 6 min
#   SECONDS_PER_POLICY=10 bash bench/run_scheduling_gpu.sh   # shorter
#   CHECKS_ONLY=1 ... / BENCH_ONLY=1 ...   # the doctor and tests / the benchmark alone
#
# Writes into $OUT: frame_scheduling.json, frame_scheduling_latencies.json,
# doctor.txt, pytest_gpu.log, bench.log and each scenario's server logs
# (logs/<policy>/). The machine has no matplotlib: draw the PNG here afterwards,
#   python -m bench.frame_scheduling --plot-only <folder holding the returned files>
set -o pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
OUTDIR=${OUT:-bench/results}
mkdir -p "$OUTDIR"
source bench/gpu_setup.sh
echo "setup $(( $(date +%s) - t0 )) s"
if [ -z "${BENCH_ONLY:-}" ]; then
# The checks: MPS (started here for the doctor, stopped after), priorities across processes, memory, copies.
python3 - <<'PY' 2>&1 | tee "$OUTDIR/doctor.txt"
import subprocess
from scheduler import mps
from tandem import device
from tandem.config import load_config
pipe, logs = device.mps_directories(load_config().scheduler)
c = mps.ensure(pipe, logs, True)
print("MPS:", c.message, flush=True)
try:
    subprocess.run(["python3", "-m", "stack", "doctor", "--deep"], timeout=240,
                   env={**__import__("os").environ, **device.mps_client_env(pipe, logs)})
finally:
    mps.stop(c)
PY
timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/scheduler/test_assignments.py tests/stack/test_doctor.py \
  tests/ground/test_nvtx.py tests/reward/test_reward_gpu.py 2>&1 | tee "$OUTDIR/pytest_gpu.log" | tail -15
echo "tests done at $(( $(date +%s) - t0 )) s"
fi
[ -n "${CHECKS_ONLY:-}" ] && exit 0
timeout 420 python3 -m bench.frame_scheduling --seconds "${SECONDS_PER_POLICY:-15}" --out "$OUTDIR" \
  --logs "$OUTDIR/logs" 2>&1 | tee "$OUTDIR/bench.log" | grep -v " INFO " | tail -30
echo "all done at $(( $(date +%s) - t0 )) s"
