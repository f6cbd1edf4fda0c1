"""RewardService over real gRPC on loopback, with the shipped ONNX model."""
from __future__ import annotations

import grpc
import numpy as np
import onnx
import onnx.helper as oh
import pytest

from reward_service import server as reward_server
from tandem import tensors
from tandem.server import channel
from tandem.v1 import reward_pb2, reward_pb2_grpc

from conftest import loopback_config

MODEL = "connect4_value"


def _float_model(path) -> str:
    """A real ONNX model with a float input (to test NaN/Inf handling): y = mean(x, axis=1)."""
    node = oh.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=0)
    graph = oh.make_graph(
        [node], "mean",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N"])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)
    return str(path)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    mean_path = _float_model(tmp_path_factory.mktemp("models") / "mean.onnx")
    models = [
        {"name": MODEL, "path": "reward_service/models/connect4_value.onnx", "max_batch_size": 64},
        {"name": "mean_reject", "path": mean_path},
    ]
    cfg = loopback_config(reward={"models": models, "execution_provider": "auto"})
    service = reward_server.start(cfg, follow_scheduler=False)
    # A second server with nonfinite_inputs: pass.
    cfg_pass = loopback_config(reward={"models": [{"name": "mean_pass", "path": mean_path}], "nonfinite_inputs": "pass"})
    service_pass = reward_server.start(cfg_pass, follow_scheduler=False)
    ch, ch_pass = channel(cfg.reward.address), channel(cfg_pass.reward.address)
    yield reward_pb2_grpc.RewardServiceStub(ch), reward_pb2_grpc.RewardServiceStub(ch_pass)
    ch.close()
    ch_pass.close()
    service.stop()
    service_pass.stop()


def boards(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    return (rng.random((n, 2, 6, 7)) < 0.2).astype(np.uint8)


def evaluate(stub, array, name="board", model=MODEL, **kw):
    return stub.Evaluate(reward_pb2.EvaluateRequest(model=model, inputs=[tensors.to_proto(name, array)], **kw), timeout=10)


def test_metadata_reports_the_provider_in_use(stubs):
    stub, _ = stubs
    meta = stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL))
    assert meta.execution_provider in meta.available_providers
    assert [(i.name, i.dtype, list(i.shape)) for i in meta.inputs] == [("board", reward_pb2.DATA_TYPE_UINT8, [-1, 2, 6, 7])]
    assert {o.name for o in meta.outputs} == {"value", "policy_logits"}
    assert len(meta.version) == 12 and meta.max_batch_size == 64
    assert stub.ListModels(reward_pb2.ListModelsRequest()).models == [MODEL, "mean_reject"]


@pytest.mark.parametrize("n", [1, 8, 64])
def test_evaluate_batch(stubs, n):
    stub, _ = stubs
    reply = evaluate(stub, boards(n))
    out = {t.name: tensors.from_proto(t) for t in reply.outputs}
    assert out["value"].shape == (n, 1) and out["value"].dtype == np.float32
    assert np.all(np.abs(out["value"]) <= 1.0)
    assert out["policy_logits"].shape == (n, 7)
    assert reply.execution_provider.endswith("ExecutionProvider") and reply.compute_ms > 0


def test_batch_rows_are_independent(stubs):
    stub, _ = stubs
    b = boards(8)
    whole = tensors.from_proto(evaluate(stub, b, output_names=["value"]).outputs[0])
    single = np.concatenate([tensors.from_proto(evaluate(stub, b[i : i + 1], output_names=["value"]).outputs[0]) for i in range(8)])
    np.testing.assert_allclose(whole, single, atol=1e-5)


def _tensor(name="board", dtype=reward_pb2.DATA_TYPE_UINT8, shape=(1, 2, 6, 7), data=None):
    data = bytes(int(np.prod(shape)) * tensors.numpy_dtype(dtype).itemsize) if data is None else data
    return reward_pb2.Tensor(name=name, dtype=dtype, shape=shape, data=data)


BAD = [
    ("unknown model", dict(model="nope", inputs=[_tensor()]), grpc.StatusCode.NOT_FOUND, "model: no model named 'nope'"),
    ("wrong dtype", dict(inputs=[_tensor(dtype=reward_pb2.DATA_TYPE_FLOAT32)]), grpc.StatusCode.INVALID_ARGUMENT, "dtype: expected DATA_TYPE_UINT8"),
    ("unset dtype", dict(inputs=[_tensor(dtype=0, data=b"")]), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    ("wrong rank", dict(inputs=[_tensor(shape=(1, 84))]), grpc.StatusCode.INVALID_ARGUMENT, "shape: expected [-1, 2, 6, 7]"),
    ("wrong dim", dict(inputs=[_tensor(shape=(1, 2, 7, 6))]), grpc.StatusCode.INVALID_ARGUMENT, "shape: expected"),
    ("short data", dict(inputs=[_tensor(data=b"\0" * 83)]), grpc.StatusCode.INVALID_ARGUMENT, "83 bytes, but shape [1, 2, 6, 7]"),
    ("long data", dict(inputs=[_tensor(data=b"\0" * 85)]), grpc.StatusCode.INVALID_ARGUMENT, "85 bytes"),
    ("empty batch", dict(inputs=[_tensor(shape=(0, 2, 6, 7))]), grpc.StatusCode.INVALID_ARGUMENT, "empty batch"),
    ("batch too large", dict(inputs=[_tensor(shape=(65, 2, 6, 7))]), grpc.StatusCode.INVALID_ARGUMENT, "exceeds max_batch_size 64"),
    ("negative dim", dict(inputs=[_tensor(shape=(1, 2, -6, 7), data=b"")]), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
    ("missing input", dict(inputs=[]), grpc.StatusCode.INVALID_ARGUMENT, "missing input 'board'"),
    ("unknown input", dict(inputs=[_tensor(), _tensor(name="extra")]), grpc.StatusCode.INVALID_ARGUMENT, "no input 'extra'"),
    ("repeated input", dict(inputs=[_tensor(), _tensor()]), grpc.StatusCode.INVALID_ARGUMENT, "given twice"),
    ("unknown output", dict(inputs=[_tensor()], output_names=["q"]), grpc.StatusCode.INVALID_ARGUMENT, "no output 'q'"),
]


@pytest.mark.parametrize("why, fields, code, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_status_and_the_server_keeps_serving(stubs, why, fields, code, message):
    stub, _ = stubs
    fields.setdefault("model", MODEL)
    with pytest.raises(grpc.RpcError) as info:
        stub.Evaluate(reward_pb2.EvaluateRequest(**fields), timeout=10)
    assert info.value.code() == code
    assert message in info.value.details()
    assert evaluate(stub, boards(2)).outputs  # still serving


def test_metadata_of_unknown_model(stubs):
    stub, _ = stubs
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model="ghost"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_inputs_reject_or_pass(stubs, bad):
    stub, stub_pass = stubs
    x = np.ones((3, 4), np.float32)
    x[1, 2] = bad
    with pytest.raises(grpc.RpcError) as info:
        evaluate(stub, x, name="x", model="mean_reject")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN or Inf" in info.value.details()
    y = tensors.from_proto(evaluate(stub_pass, x, name="x", model="mean_pass").outputs[0])
    assert y[0] == 1.0 and y[2] == 1.0 and not np.isfinite(y[1])  # other rows unaffected
