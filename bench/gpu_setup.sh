# Sourced by the GPU run scripts (bench/run_*_gpu.sh) on the GPU machine, from
# the repository root: installs what was carried there and sets PYTHONPATH.
#   - onnxruntime-gpu, carried in parts into /root/ortparts (bench/ort_gpu_parts.sh, or the team's
#     ort-gpu-parts.sh: `prepare` once, then per part `stage N` + a device call
#     copying .ortgpu/current to /root/ortparts/$(cat .ortgpu/name)), joined
#     and installed into /root/ortsite once;
#   - the wheels carried in .whl (grpcio-health-checking, grpcio-reflection,
#     onnxconverter-common: the machine has no registry) into /tmp/site;
#   - TANDEM_COMMIT=<sha> TANDEM_DIRTY=0 exported by the caller when the tree sent is that commit, clean
#     (bench/common.py versions(): the machine's own .git may be older than the tree);
#   - the `tandem` command, as a user gets it ($TANDEM; no deps, no build isolation).
# Prints the GPU, ONNX Runtime's providers and CuPy's version.
W=/root/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl  # pip needs a valid wheel name
if [ -d /root/ortparts ]; then
  if head -c 6 /root/ortparts/part00 | grep -q 7zXZ; then  # bench/ort_gpu_parts.sh: a split tar.xz
    mkdir -p /root/ortsite && cat /root/ortparts/part* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/root/ortsite')"
  else  # the team's ort-gpu-parts.sh: a split wheel
    cat /root/ortparts/part* > $W && python3 -m pip install -q --no-index --no-deps --no-compile --target /root/ortsite $W 2>&1 | tail -2
  fi
  rm -rf /root/ortparts
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/root/ortsite:/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
TANDEM="tandem"; command -v tandem >/dev/null || TANDEM="python3 -m stack"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import onnxruntime as o, cupy; print('ort', o.__version__, o.get_available_providers()[:2], 'cupy', cupy.__version__)"
