"""train_connect4_value.train_model: the training loop fits its data, on the CPU
and (marked gpu) on a CUDA device, and hands back a CPU model for export."""
from __future__ import annotations

import numpy as np
import pytest

from training.connect4_data import PONS_DIR, from_records, read_jsonl
from training.train_connect4_value import evaluate, train_model

torch = pytest.importorskip("torch")


def fit(device: str):
    s = from_records(read_jsonl(PONS_DIR / "Test_L3_R1.jsonl")[:64])
    model = train_model(s, channels=8, blocks=1, epochs=30, batch=16, lr=1e-2, seed=3, wdl=True,
                        device=device, log=lambda _: None)
    assert next(model.parameters()).device.type == "cpu" and not model.training
    with torch.no_grad():
        value, logits = model(torch.from_numpy(s.boards))
    assert value.shape == (64, 1) and logits.shape == (64, 7)
    return evaluate(value[:, 0].numpy(), logits.numpy(), s)


def test_fits_64_end_games_on_the_cpu():
    # 64 positions, 30 epochs: memorised far above the 1/3 of a constant guess
    assert fit("cpu")["value_accuracy"] >= 0.8


@pytest.mark.gpu
def test_fits_64_end_games_on_a_cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert fit("cuda")["value_accuracy"] >= 0.8
