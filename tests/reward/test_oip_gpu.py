"""Triton's CUDA shared-memory calls over the Open Inference Protocol
(reward_service/oip.py) with a real CUDA IPC region: the client, in another
process (a CUDA IPC handle cannot be opened by the process that exported
it), puts the boards in device memory, registers it with tritonclient, asks
for an output in a second region, and compares with a plain ModelInfer.
Marked ``gpu``: skipped where no CUDA GPU is visible.

    pytest -m gpu tests/reward/test_oip_gpu.py
"""
from __future__ import annotations

import base64
import multiprocessing as mp

import numpy as np
import pytest
from conftest import loopback_config

from reward_service import server as reward_server
from tandem.gpu import cupy_module

pytestmark = pytest.mark.gpu
pytest.importorskip("tritonclient.grpc", reason="the oip extra (tritonclient[grpc]) is not installed")

MODEL = "connect4_value"


def _client(address: str, conn) -> None:
    import cupy
    import tritonclient.grpc as grpcclient

    out = {}
    try:
        client = grpcclient.InferenceServerClient(address)
        b = (np.random.default_rng(3).random((8, 2, 6, 7)) < 0.2).astype(np.uint8)
        x = grpcclient.InferInput("board", list(b.shape), "UINT8")
        x.set_data_from_numpy(b)
        want = client.infer(MODEL, [x], client_timeout=30).as_numpy("value")
        inp, res = cupy.cuda.Memory(b.nbytes), cupy.cuda.Memory(1 << 16)  # whole allocations (cudaMalloc)
        cupy.cuda.runtime.memcpy(inp.ptr, b.ctypes.data, b.nbytes, cupy.cuda.runtime.memcpyHostToDevice)
        for name, mem, size in (("cuda_in", inp, b.nbytes), ("cuda_out", res, 1 << 16)):
            handle = cupy.cuda.runtime.ipcGetMemHandle(mem.ptr)
            client.register_cuda_shared_memory(name, base64.b64encode(handle), 0, size)
        out["status"] = sorted(client.get_cuda_shared_memory_status().regions)
        x = grpcclient.InferInput("board", list(b.shape), "UINT8")
        x.set_shared_memory("cuda_in", b.nbytes)
        value = grpcclient.InferRequestedOutput("value")
        value.set_shared_memory("cuda_out", 1 << 16)
        client.infer(MODEL, [x], outputs=[value], client_timeout=30)
        got = np.empty((8, 1), np.float32)
        cupy.cuda.runtime.memcpy(got.ctypes.data, res.ptr, got.nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
        out["max_error"] = float(np.abs(got - want).max())
        client.unregister_cuda_shared_memory()
        out["after"] = sorted(client.get_cuda_shared_memory_status().regions)
    except Exception as exc:  # handed to the test, which fails with it
        out["error"] = repr(exc)
    conn.send(out)


def test_cuda_regions_over_the_open_inference_protocol():
    if cupy_module() is None:
        pytest.skip("CuPy sees no GPU")
    cfg = loopback_config(reward={"models": [{"name": MODEL, "path": "reward_service/models/connect4_value.onnx",
                                              "max_batch_size": 64}]})
    service = reward_server.start(cfg, follow_scheduler=False)
    try:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_client, args=(cfg.reward.address, child))
        proc.start()
        assert parent.poll(120), "the client process did not answer"
        out = parent.recv()
        proc.join(30)
    finally:
        service.stop()
    assert "error" not in out, out.get("error")
    assert out["status"] == ["cuda_in", "cuda_out"] and out["after"] == []
    assert out["max_error"] < 1e-5
