"""When waves are gated (tandem/outputs_gate.py, ``enabled``); the gate
itself runs on the GPU: tests/reward/test_outputs_gate_gpu.py."""
from __future__ import annotations

import pytest

from tandem import outputs_gate


@pytest.mark.parametrize("env, want", [
    ({"TANDEM_OUTPUTS_GATE": "1"}, True),
    ({"TANDEM_OUTPUTS_GATE": "0", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}, False),
    ({"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}, True),  # an MPS client: both services share the GPU
    ({}, False),  # contexts time-slice: a spinning gate would hold the GPU from the reward service
])
def test_waves_are_gated_where_mps_runs_or_the_environment_says(monkeypatch, env, want):
    for name in ("TANDEM_OUTPUTS_GATE", "CUDA_MPS_PIPE_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert outputs_gate.enabled() is want
