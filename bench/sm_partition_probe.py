"""Probe (GPU only): can the bulk lane be confined to a green context, so that
critical kernels find SMs free instead of waiting for bulk blocks to drain?

Checks, in one process: a green context of part of the SMs (cuda.bindings),
kernels on its stream land only on its SMs, cuDNN / cuBLAS and a CUDA graph run
on that stream; then times a critical batch-1 frame model (graph replay, greatest
stream priority, primary context) while a batch-64 bulk copy of it runs back to
back (a) on a least-priority stream of the primary context, (b) on a green
context stream of total - R SMs, for several R. Prints JSON lines and a table.
"""
from __future__ import annotations

import json
import os
import sys
import time

import cupy
import torch
from cuda.bindings import driver as cu


def ok(result):
    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{err}")
    return rest[0] if len(rest) == 1 else rest


def green_stream(sm_count: int, priority: int = 0):
    dev = ok(cu.cuDeviceGet(0))
    res = ok(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, n, remaining = ok(cu.cuDevSmResourceSplitByCount(1, res, 0, sm_count))
    desc = ok(cu.cuDevResourceGenerateDesc([groups[0]], 1))
    gctx = ok(cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    stream = ok(cu.cuGreenCtxStreamCreate(gctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value, priority))
    return gctx, stream, groups[0].sm.smCount, res.sm.smCount


SMID = cupy.RawKernel(r"""
extern "C" __global__ void smid(int* out) {
    unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    if (threadIdx.x == 0) out[blockIdx.x] = (int)s;
    long long t = clock64(); while (clock64() - t < 200000) {}
}""", "smid")


def sms_used(stream_ptr: int) -> int:
    out = cupy.full(2048, -1, cupy.int32)
    with cupy.cuda.ExternalStream(stream_ptr):
        SMID((2048,), (64,), (out,))
    cupy.cuda.ExternalStream(stream_ptr).synchronize()
    return len(set(out.get().tolist()) - {-1})


class Frame(torch.nn.Module):
    """frame_reward's shape (reward_service/models/frame_reward.md), random weights."""

    def __init__(self):
        super().__init__()
        c = torch.nn.Conv2d
        self.stem = torch.nn.Sequential(c(3, 16, 8, 8), torch.nn.ReLU(), c(16, 32, 2, 2), torch.nn.ReLU(),
                                        c(32, 48, 2, 2), torch.nn.ReLU())
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(c(48, 48, 3, padding=1), torch.nn.ReLU(),
                                                               c(48, 48, 3, padding=1)) for _ in range(2)])
        self.head = c(48, 4, 1)
        self.fc = torch.nn.Sequential(torch.nn.Linear(196, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1), torch.nn.Tanh())

    def forward(self, frame):
        x = (frame.permute(0, 3, 1, 2).float() - 128.0) / 64.0
        x = self.stem(x)
        for b in self.blocks:
            x = torch.relu(x + b(x))
        return self.fc(self.head(x).flatten(1))


def graphed(model, batch, stream):
    x = torch.randint(0, 255, (batch, 224, 224, 3), dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(x)
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        y = model(x)
    return g, x, y


def timed(model, bulk_stream, crit_stream, seconds=3.0, period_s=0.002):
    """Critical latencies (ms) and bulk batches/s with bulk_stream (or None: no bulk)."""
    cg, cx, cy = graphed(model, 1, crit_stream)
    bulk = graphed(model, 64, bulk_stream) if bulk_stream is not None else None
    lat, inflight, bulk_done = [], [], 0
    end = time.perf_counter() + seconds
    nxt = time.perf_counter()
    while time.perf_counter() < end:
        if bulk is not None:
            still = []
            for e in inflight:
                if e.query():
                    bulk_done += 1
                else:
                    still.append(e)
            inflight = still
            while len(inflight) < 2:
                with torch.cuda.stream(bulk_stream):
                    bulk[0].replay()
                    e = torch.cuda.Event()
                    e.record(bulk_stream)
                inflight.append(e)
        if time.perf_counter() >= nxt:
            t = time.perf_counter()
            with torch.cuda.stream(crit_stream):
                cg.replay()
            crit_stream.synchronize()
            lat.append((time.perf_counter() - t) * 1e3)
            nxt = t + period_s
    torch.cuda.synchronize()
    lat.sort()
    return {"crit_p50_ms": lat[len(lat) // 2], "crit_p99_ms": lat[int(len(lat) * 0.99)], "crit_n": len(lat),
            "bulk_per_s": bulk_done / seconds}


def main():
    torch.cuda.init()
    torch.backends.cudnn.benchmark = True
    ok(cu.cuInit(0))
    lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -5)
    rows = []
    mps = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
    print("mps", bool(mps), "driver", ok(cu.cuDriverGetVersion()), flush=True)
    # 1. confinement and libraries on a green stream
    for want in (16, 64, 116, 124):
        try:
            gctx, s, got, total = green_stream(want)
            used = sms_used(int(s))
            ts = torch.cuda.ExternalStream(int(s))
            a = torch.randn(512, 512, device="cuda")
            ref = a @ a
            conv = torch.nn.Conv2d(8, 8, 3).cuda()
            img = torch.randn(4, 8, 32, 32, device="cuda")
            cref = conv(img)
            with torch.cuda.stream(ts):
                mm = a @ a
                cv = conv(img)
            ts.synchronize()
            row = {"check": "green", "asked": want, "got": got, "total": total, "sms_used": used,
                   "matmul_ok": bool(torch.allclose(mm, ref)), "conv_ok": bool(torch.allclose(cv, cref, atol=1e-5))}
        except Exception as exc:  # noqa: BLE001 -- a probe: report it
            row = {"check": "green", "asked": want, "error": repr(exc)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(json.dumps({"check": "plain stream sms", "sms_used": sms_used(torch.cuda.Stream().cuda_stream)}), flush=True)
    # 2. timing
    model = Frame().cuda().eval()
    torch.set_grad_enabled(False)
    crit = torch.cuda.Stream(priority=-5)
    cases = [("alone", None), ("prio_only", torch.cuda.Stream(priority=0))]
    for reserve in (8, 16, 32):
        try:
            gctx, s, got, total = green_stream(132 - reserve, 0)
            cases.append((f"green_reserve_{132 - got}", torch.cuda.ExternalStream(int(s))))
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"case": f"green {reserve}", "error": repr(exc)}), flush=True)
    bulk_alone = None
    for name, bs in cases:
        r = timed(model, bs, crit)
        r["case"] = name
        print(json.dumps(r), flush=True)
        rows.append(r)
    # bulk alone throughput per case (no critical): same loop with no critical ticks
    for name, bs in cases[1:]:
        r = timed(model, bs, crit, seconds=2.0, period_s=1e9)
        print(json.dumps({"case": name + "_bulk_alone", "bulk_per_s": r["bulk_per_s"]}), flush=True)
    print("table", "mps" if mps else "no-mps")
    for r in rows:
        if "case" in r:
            print(f"{r['case']:>24} crit p50 {r['crit_p50_ms']:.3f} p99 {r['crit_p99_ms']:.3f} bulk/s {r['bulk_per_s']:.0f}")


if __name__ == "__main__":
    sys.exit(main())
