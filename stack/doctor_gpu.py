"""GPU measurements for ``tandem doctor``, run in child processes so that the
doctor itself never holds a CUDA context (needs CuPy and a GPU).

    python -m stack.doctor_gpu facts            # JSON: priority range, memory, copy bandwidth
    python -m stack.doctor_gpu chain [--load] [--low]   # JSON: p50/p99 of a kernel chain (ms)
    python -m stack.doctor_gpu load SECONDS     # a saturating low-priority load (the other process)

``chain`` is the priority check of docs/design.md, "Measured physics": a chain of
30 short kernels (what one MCTS wave looks like) on the greatest priority
(``--low``: on priority 0, the load's), timed alone and while another process
runs a saturating load on priority 0. Under MPS the high-priority chain is
scheduled ahead of the load's waiting blocks, so it is much faster than the
same chain at the load's priority; without MPS the GPU time-slices the two
contexts and priority makes no difference. A load whose blocks fill every SM
(this one) still slows a high-priority chain against its time alone: running
blocks are not preempted and share the SMs' issue slots.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

from stack.stats import percentiles

CHAIN_KERNELS = 30  # kernels per chain (one MCTS wave)
CHAIN_REPEATS = 200
COPY_BYTES = 64 << 20  # host -> device copy size for the bandwidth check

_SPIN = r"""
extern "C" __global__ void spin(float* x, int iters) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f;
    x[i] = v;
}
"""


def _spin(cupy):
    return cupy.RawKernel(_SPIN, "spin")


def facts() -> dict:
    """Stream priority range, free/total memory (bytes), H2D copy bandwidth pageable vs pinned (GB/s)."""
    import cupy
    import numpy as np

    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    free, total = rt.memGetInfo()
    from tandem.stream_priority import stream_priority_range

    least, greatest = stream_priority_range(rt)
    dev = cupy.empty(COPY_BYTES, cupy.uint8)
    pageable = np.ones(COPY_BYTES, np.uint8)
    pinned_mem = cupy.cuda.alloc_pinned_memory(COPY_BYTES)
    pinned = np.frombuffer(pinned_mem, np.uint8, COPY_BYTES)
    pinned[:] = 1

    def bandwidth(host) -> float:
        dev.set(host)  # warm
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(5):
            dev.set(host)
        cupy.cuda.Device().synchronize()
        return 5 * COPY_BYTES / (time.perf_counter() - t) / 1e9

    return {
        "name": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "least_priority": least, "greatest_priority": greatest,
        "free_bytes": int(free), "total_bytes": int(total),
        "pageable_gb_per_s": round(bandwidth(pageable), 2), "pinned_gb_per_s": round(bandwidth(pinned), 2),
    }


def chain(with_load: bool, low: bool = False, load_seconds: float = 8.0) -> dict:
    """p50/p99 (ms) of a chain of short kernels on the greatest priority (``low``:
    on priority 0); with ``with_load`` while a child process saturates the GPU on priority 0."""
    import cupy
    import numpy as np

    spin = _spin(cupy)
    x = cupy.zeros(32 * 128, cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True, priority=0 if low else -100)  # -100: clamped to the greatest
    child = None
    if with_load:
        child = subprocess.Popen([sys.executable, "-m", "stack.doctor_gpu", "load", str(load_seconds)],
                                 stdout=subprocess.PIPE, text=True)
        child.stdout.readline()  # "ready": the load runs
    try:
        times = []
        with stream:
            for i in range(CHAIN_REPEATS + 10):
                t = time.perf_counter()
                for _ in range(CHAIN_KERNELS):
                    spin((32,), (128,), (x, np.int32(200)))
                stream.synchronize()
                if i >= 10:
                    times.append((time.perf_counter() - t) * 1e3)
    finally:
        if child is not None:
            child.terminate()
            child.wait(10)
    p50, p99 = percentiles(times, 50, 99)
    return {"p50_ms": round(p50, 3), "p99_ms": round(p99, 3)}


def load(seconds: float) -> None:
    """Keeps every SM busy on a priority-0 stream for ``seconds`` (long kernels, many blocks)."""
    import cupy
    import numpy as np

    spin = _spin(cupy)
    blocks = cupy.cuda.Device().attributes["MultiProcessorCount"] * 16
    x = cupy.zeros(blocks * 256, cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True, priority=0)
    end = time.monotonic() + seconds
    ready = False
    with stream:
        while time.monotonic() < end:
            for _ in range(8):
                spin((blocks,), (256,), (x, np.int32(20000)))
            stream.synchronize()
            if not ready:
                print("ready", flush=True)
                ready = True


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "facts"
    if what == "facts":
        print(json.dumps(facts()))
    elif what == "chain":
        print(json.dumps(chain("--load" in argv, "--low" in argv)))
    elif what == "load":
        load(float(argv[1]) if len(argv) > 1 else 8.0)
    else:
        print(f"unknown: {what} (facts | chain [--load] [--low] | load SECONDS)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
