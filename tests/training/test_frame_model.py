"""The frame renderer (training/frames.py) and the shipped frame reward
model (reward_service/models/frame_reward.onnx and its card)."""
from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tandem.paths import REPO_ROOT
from training import frames as F
from training.connect4_encoding import encode_moves

MODEL = REPO_ROOT / "reward_service" / "models" / "frame_reward.onnx"
CARD = MODEL.with_suffix(".md")


def centre(row: int, col: int) -> tuple[int, int]:
    """Pixel (y, x) of the centre of board cell (row 0 = bottom) in an unjittered frame."""
    return F.TOP + (F.ROWS - 1 - row) * F.CELL + F.CELL // 2, col * F.CELL + F.CELL // 2


def test_frames_are_uint8_nhwc_224():
    f = F.render_moves(["", "4", "4453"])
    assert f.shape == (3, 224, 224, 3) and f.dtype == np.uint8 and f.flags.c_contiguous
    assert F.render_moves([]).shape == (0, 224, 224, 3)


def test_discs_holes_board_and_turn_indicator_are_where_they_belong():
    (f,) = F.render_moves(["4453"])  # red 4, yellow 4, red 5, yellow 3: red to move
    assert tuple(f[centre(0, 3)]) == F.RED and tuple(f[centre(0, 4)]) == F.RED
    assert tuple(f[centre(1, 3)]) == F.YELLOW and tuple(f[centre(0, 2)]) == F.YELLOW
    assert tuple(f[centre(5, 0)]) == F.EMPTY and tuple(f[centre(2, 6)]) == F.EMPTY
    assert tuple(f[F.TOP + 1, 1]) == F.BOARD  # a cell's corner shows the board
    assert tuple(f[F.TOP // 2, 3 * F.CELL + F.CELL // 2]) == F.RED  # turn indicator: red to move
    assert tuple(f[2, 2]) == F.BACKGROUND
    (g,) = F.render_moves(["44531"])
    assert tuple(g[F.TOP // 2, 3 * F.CELL + F.CELL // 2]) == F.YELLOW


def test_cells_agree_with_the_value_model_encoding():
    for moves in ("", "4", "4453", "1122334455667", "4444441"):
        cells = F.cells_from_moves(moves)
        planes = encode_moves(moves)  # [0]: side to move, [1]: opponent
        mover = F.RED_DISC if len(moves) % 2 == 0 else F.YELLOW_DISC
        other = F.YELLOW_DISC if mover == F.RED_DISC else F.RED_DISC
        np.testing.assert_array_equal(cells == mover, planes[0] == 1)
        np.testing.assert_array_equal(cells == other, planes[1] == 1)


def test_rendering_is_deterministic_and_jitter_is_small():
    moves = ["4453", "1234567", ""]
    a = F.render_moves(moves, np.random.default_rng(5))
    b = F.render_moves(moves, np.random.default_rng(5))
    np.testing.assert_array_equal(a, b)
    c = F.render_moves(moves, np.random.default_rng(6))
    assert not np.array_equal(a, c)
    plain = F.render_moves(moves)
    np.testing.assert_array_equal(plain, F.render_moves(moves))
    # Jittered frames are the plain ones shifted by at most JITTER_PX and scaled by at most ±8 %.
    for jit, ref in zip(a, plain):
        tolerance = 255 * F.BRIGHTNESS_JITTER + 1
        best = max(
            (np.abs(jit[8:-8, 8:-8].astype(float) - np.roll(ref, (dy, dx), (0, 1))[8:-8, 8:-8]) <= tolerance).mean()
            for dy in range(-F.JITTER_PX, F.JITTER_PX + 1) for dx in range(-F.JITTER_PX, F.JITTER_PX + 1)
        )
        assert best > 0.999


def test_bad_positions_are_refused():
    with pytest.raises(ValueError, match="bad move"):
        F.render_moves(["48"])
    with pytest.raises(ValueError, match="full"):
        F.render_moves(["4444444"])
    with pytest.raises(ValueError):
        F.render_cells(np.full((1, 6, 7), 3), np.array([True]))


def test_mirror_moves():
    assert F.mirror_moves("1234567") == "7654321"
    np.testing.assert_array_equal(F.cells_from_moves(F.mirror_moves("4453"))[:, ::-1], F.cells_from_moves("4453"))


# -- the shipped model --------------------------------------------------------------------------


def test_model_file_and_card_ship():
    assert MODEL.stat().st_size < 5 * 1024 * 1024
    text = CARD.read_text()
    for needle in ("Held-out accuracy", "Test_L2_R1", "Test_L3_R1", "uint8", "[N, 224, 224, 3]", "python -m"):
        assert needle in text
    assert re.search(r"accuracy \d+\.\d %", text)


def test_model_interface_and_in_model_normalisation():
    s = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    (i,), (o,) = s.get_inputs(), s.get_outputs()
    assert (i.name, i.type, i.shape[1:]) == ("frame", "tensor(uint8)", [224, 224, 3])
    assert (o.name, o.type, o.shape[1:]) == ("value", "tensor(float)", [1])
    ops = [n.op_type for n in onnx.load(str(MODEL)).graph.node]
    assert {"Transpose", "Cast"} <= set(ops[:4])  # NHWC uint8 -> NCHW float inside the model
    params = sum(int(np.prod(t.dims)) for t in onnx.load(str(MODEL)).graph.initializer)
    assert 50_000 < params < 200_000


def _accuracy(moves, target, seed=7):
    from training.train_frame_reward import outcome_class

    s = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    v = s.run(None, {"frame": F.render_moves(moves, np.random.default_rng(seed))})[0]
    assert v.shape == (len(moves), 1) and v.dtype == np.float32 and (np.abs(v) <= 1).all()
    return float((outcome_class(v) == np.sign(target)).mean())


@pytest.mark.slow
def test_model_beats_the_majority_class_on_held_out_positions():
    from training.train_frame_reward import heldout_sets

    held = heldout_sets()
    moves, target = held["uci (held-out 10 %)"]
    moves, target = moves[:400], target[:400]
    majority = max(float((np.sign(target) == k).mean()) for k in (-1, 0, 1))
    assert _accuracy(moves, target) > majority + 0.03


def test_held_out_split_keeps_the_benchmark_sets_out():
    from training.train_frame_reward import heldout_sets

    held = heldout_sets()
    assert len(held["Test_L2_R1"][0]) == 1000 and len(held["Test_L3_R1"][0]) == 1000


def test_shipped_config_serves_the_frame_model():
    from tandem.config import DEFAULT_CONFIG, load_config

    models = {m.name: m for m in load_config(DEFAULT_CONFIG).reward.models}
    assert models["frame_reward"].path == "reward_service/models/frame_reward.onnx"
    assert models["frame_reward"].cuda_graph
