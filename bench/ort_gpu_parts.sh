#!/usr/bin/env bash
# Carries onnxruntime-gpu to the GPU machine (no registry there) in parts small
# enough for one device call each, beside the working tree (64 MiB a call):
# the wheel's files less what tandem never loads (TensorRT provider, the
# transformers/quantization/tools packages), as one tar.xz split in 42 MiB parts
# (five for 1.31.1).
#   bash bench/ort_gpu_parts.sh prepare   # here, once: download, strip, pack, split
#   bash bench/ort_gpu_parts.sh stage N   # here: part N at .ortgpu/current (.git/info/exclude: /.ortgpu/)
# Then device calls back to back (the machine goes back after 30 s idle), each
# carrying [".ortgpu", ".whl"] and starting with
#   mkdir -p /root/ortstage && cp .ortgpu/current /root/ortstage/$(cat .ortgpu/name)
# and, once every part is there, `mv /root/ortstage /root/ortparts` before
# `source bench/gpu_setup.sh`, which unpacks them into /root/ortsite.
set -euo pipefail
VER=${ORT_GPU_VERSION:-1.31.1}
PARTS=/tmp/ortgpu-tandem
case "${1:-}" in
prepare)
  rm -rf "$PARTS" && mkdir -p "$PARTS/site" && cd "$PARTS"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d . "onnxruntime-gpu==$VER"
  (cd site && unzip -q ../onnxruntime_gpu-*.whl && rm -rf onnxruntime/transformers onnxruntime/quantization \
    onnxruntime/tools onnxruntime/capi/libonnxruntime_providers_tensorrt.so)
  tar -C site -cf - . | xz -T0 -6 | split -b 42M -d - part
  ls part* ;;
stage)
  n=$(printf '%02d' "${2:?part number}")
  mkdir -p .ortgpu && cp "$PARTS/part$n" .ortgpu/current && echo "part$n" > .ortgpu/name && echo "staged part$n" ;;
*) sed -n '2,14p' "$0"; exit 2 ;;
esac
