#!/usr/bin/env bash
# Reward-service GPU run (issue 4): install the carried onnxruntime-gpu wheel,
# run the GPU tests, then the reward latency benchmark.
#
# Before it, carry onnxruntime-gpu in parts (ort-gpu-parts.sh from the team's shared tools, outside this repository:
# `prepare` here, then per part `stage N` + a device call carrying [".ortgpu"]
# that copies .ortgpu/current to /root/ortparts/$(cat .ortgpu/name)), back to
# back so the machine stays warm. The joined file must keep the wheel's real
# name (pip refuses "ort.whl"). Then one device call, carrying [".whl"]:
#   bash bench/run_reward_gpu.sh            # everything (about 4 min)
#   SHORT=1 bash bench/run_reward_gpu.sh    # frame model and gRPC rows only
set -o pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
source bench/gpu_setup.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 120 python3 -m pytest -q -m gpu tests/reward/test_reward_gpu.py -p no:cacheprovider -q 2>&1 | tee $OUT/pytest_gpu.log | tail -15
echo "tests done at $(( $(date +%s) - t0 )) s"
if [ -n "${SHORT:-}" ]; then ARGS="--skip resnet18,torch,copy --accuracy-limit 300"; else ARGS=""; fi
timeout 420 python3 -m bench.reward_latency $ARGS --out $OUT 2>&1 | tee $OUT/bench.log | grep -v "^model=" | tail -30
echo "all done at $(( $(date +%s) - t0 )) s"
