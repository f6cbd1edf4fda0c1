"""FP16 conversion with an FP32 head (reward_service/precision.py) and the
``tandem convert-fp16`` command, on the CPU."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

pytest.importorskip("onnxconverter_common")

from reward_service import precision  # noqa: E402
from training import fp16_report  # noqa: E402
from tandem.paths import REPO_ROOT  # noqa: E402

VALUE_MODEL = REPO_ROOT / "reward_service" / "models" / "connect4_value.onnx"
FRAME_MODEL = REPO_ROOT / "reward_service" / "models" / "frame_reward.onnx"


def small_cnn(uint8_input: bool = False) -> onnx.ModelProto:
    """[N, 3, 8, 8] -> Conv -> Relu -> Flatten -> Gemm -> Tanh -> value [N, 1]
    (with a uint8 input and a Cast to float first when asked)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "w")
    fc = numpy_helper.from_array(rng.normal(0, 0.1, (1, 4 * 36)).astype(np.float32), "fc")
    fcb = numpy_helper.from_array(np.zeros(1, np.float32), "fcb")
    nodes = [
        oh.make_node("Conv", ["xf", "w"], ["c"], name="conv"),
        oh.make_node("Relu", ["c"], ["r"], name="relu"),
        oh.make_node("Flatten", ["r"], ["f"], name="flatten"),
        oh.make_node("Gemm", ["f", "fc", "fcb"], ["g"], name="fc", transB=1),
        oh.make_node("Tanh", ["g"], ["value"], name="tanh"),
    ]
    if uint8_input:
        nodes.insert(0, oh.make_node("Cast", ["x"], ["xf"], name="to_float", to=TensorProto.FLOAT))
        x = oh.make_tensor_value_info("x", TensorProto.UINT8, ["N", 3, 8, 8])
    else:
        nodes.insert(0, oh.make_node("Identity", ["x"], ["xf"], name="identity"))
        x = oh.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])
    graph = oh.make_graph(nodes, "small", [x], [oh.make_tensor_value_info("value", TensorProto.FLOAT, ["N", 1])],
                          [w, fc, fcb])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x})[0]


def producer(model, name):
    return next(n for n in model.graph.node if name in n.output)


def test_head_nodes_walk_back_to_the_last_weighted_layer():
    assert precision.head_nodes(small_cnn()) == ["tanh", "fc"]
    value = onnx.load(str(VALUE_MODEL))
    head = precision.head_nodes(value)
    assert {producer(value, "value").name, producer(value, "policy_logits").name} <= set(head)
    assert sum(1 for n in value.graph.node if n.name in head and n.op_type == "Gemm") == 2
    # the win/draw/loss head: value = sum of softmax(logits) * (1, 0, -1), FP32 from the logits' Gemm on
    assert {n.op_type for n in value.graph.node if n.name in head} >= {"Softmax", "Mul", "ReduceSum"}


def test_the_converter_alone_rounds_the_head_back_to_fp16():
    """Why convert_fp16 repairs the output: onnxconverter-common puts a Cast to
    FP16 after a blocked last node and declares the output FP16."""
    from onnxconverter_common import float16

    raw = float16.convert_float_to_float16(small_cnn(), keep_io_types=True, node_block_list=["tanh", "fc"])
    with pytest.raises(ValueError):
        precision.check_fp16_head(raw, ["tanh", "fc"], {"value"})


@pytest.mark.parametrize("uint8_input", [False, True])
def test_convert_keeps_the_head_and_output_fp32(uint8_input):
    fp32 = small_cnn(uint8_input)
    fp16 = precision.convert_fp16(fp32)
    out = fp16.graph.output[0]
    assert out.type.tensor_type.elem_type == TensorProto.FLOAT
    assert producer(fp16, "value").name == "tanh"  # no Cast between the head and the output
    inits = {i.name: i.data_type for i in fp16.graph.initializer}
    assert inits["fc"] == TensorProto.FLOAT and inits["fcb"] == TensorProto.FLOAT
    assert TensorProto.FLOAT16 in inits.values()  # the body is FP16
    assert fp16.graph.input[0].type.tensor_type.elem_type == fp32.graph.input[0].type.tensor_type.elem_type
    rng = np.random.default_rng(1)
    x = (rng.integers(0, 3, (5, 3, 8, 8)) if uint8_input else rng.normal(0, 1, (5, 3, 8, 8))).astype(
        np.uint8 if uint8_input else np.float32)
    a, b = run(fp32, x), run(fp16, x)
    assert b.dtype == np.float32 and b.shape == (5, 1)
    np.testing.assert_allclose(a, b, atol=2e-2)


def test_convert_the_shipped_value_model():
    fp32 = onnx.load(str(VALUE_MODEL))
    fp16 = precision.convert_fp16(fp32)
    assert [(o.name, o.type.tensor_type.elem_type) for o in fp16.graph.output] == [
        ("value", TensorProto.FLOAT), ("policy_logits", TensorProto.FLOAT)]
    head = set(precision.head_nodes(fp32))
    producer_of = {o: n for n in fp16.graph.node for o in n.output}
    for cast in (n for n in fp16.graph.node if n.op_type == "Cast"):  # none between two head nodes
        src = producer_of.get(cast.input[0])
        users = [n.name for n in fp16.graph.node if cast.output[0] in n.input]
        assert not (src is not None and src.name in head and set(users) & head), (cast.name, src.name, users)
    boards = (np.random.default_rng(2).random((64, 2, 6, 7)) < 0.25).astype(np.uint8)
    a, b = run(fp32, boards), run(fp16, boards)
    assert np.abs(a - b).max() < 2e-2


def test_report_on_held_out_boards():
    fp32 = onnx.load(str(VALUE_MODEL))
    r = fp16_report.report(fp32, precision.convert_fp16(fp32), providers=["CPUExecutionProvider"], batches=(1, 8),
                         repeats=2, limit=40)
    assert r["data"].startswith("value network held-out")
    assert r["positions"] == 40 * 6
    assert 0.5 < r["accuracy_fp32"] <= 1 and abs(r["accuracy_loss"]) < 0.02
    assert r["outcome_agreement"] > 0.97 and r["max_abs_diff"] < 0.05
    assert set(r["latency_ms_p50"]["fp16"]) == {1, 8}


def test_cli_convert_fp16(tmp_path, capsys):
    from stack.cli import main

    out, rep = tmp_path / "v16.onnx", tmp_path / "report.json"
    assert main(["convert-fp16", str(VALUE_MODEL), "--out", str(out), "--report", str(rep), "--limit", "20",
                 "--repeats", "2"]) == 0
    text = capsys.readouterr().out
    assert "FP32 head" in text and "accuracy fp32" in text
    assert onnx.load(str(out)).graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert json.loads(rep.read_text())["accuracy_fp16"] is not None


@pytest.mark.skipif(not FRAME_MODEL.exists(), reason="frame model not generated")
def test_convert_the_frame_model_and_its_held_out_accuracy():
    fp32 = onnx.load(str(FRAME_MODEL))
    fp16 = precision.convert_fp16(fp32)
    r = fp16_report.report(fp32, fp16, providers=["CPUExecutionProvider"], batches=(1,), repeats=1, limit=30)
    assert r["data"].startswith("frame model held-out")
    assert r["outcome_agreement"] >= 0.98
    assert abs(r["accuracy_loss"]) <= 0.02


def test_a_session_converts_at_load(tmp_path):
    from reward_service.session import ModelSession
    from tandem.config import ModelConfig, RewardConfig

    cfg = RewardConfig(execution_provider="cpu")
    s32 = ModelSession(ModelConfig(name="v", path=str(VALUE_MODEL)), cfg)
    s16 = ModelSession(ModelConfig(name="v", path=str(VALUE_MODEL), precision="fp16"), cfg)
    assert s16.runtime["precision"].startswith("fp16") and s16.version != s32.version
    assert [o.dtype for o in s16.outputs] == [o.dtype for o in s32.outputs]
    boards = (np.random.default_rng(3).random((16, 2, 6, 7)) < 0.25).astype(np.uint8)
    a, _ = s32.run({"board": boards})
    b, _ = s16.run({"board": boards})
    assert b["value"].dtype == np.float32 and np.abs(a["value"] - b["value"]).max() < 2e-2
