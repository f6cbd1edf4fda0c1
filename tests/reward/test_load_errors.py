"""A model file ONNX Runtime cannot load is one line naming the model and the
file (issue 13, kind 5), from the session and from `tandem serve reward`."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from reward_service.session import ModelSession
from tandem.config import ModelConfig, RewardConfig
from tandem.paths import REPO_ROOT


@pytest.fixture
def corrupt_model(tmp_path):
    path = tmp_path / "corrupt.onnx"
    path.write_bytes(b"\x08\x07not a protobuf\n\nat all" * 10)
    return path


def test_a_corrupt_model_is_a_one_line_runtime_error(corrupt_model):
    with pytest.raises(RuntimeError) as info:
        ModelSession(ModelConfig(name="broken", path=str(corrupt_model)), RewardConfig(execution_provider="cpu"))
    message = str(info.value)
    assert message.startswith(f"model broken: cannot load {corrupt_model}: ")
    assert "\n" not in message


def test_serve_reward_with_a_corrupt_model_says_so_without_a_traceback(corrupt_model, tmp_path):
    config = tmp_path / "tandem.yaml"
    config.write_text(yaml.safe_dump({
        "reward": {"address": "127.0.0.1:1", "metrics_port": 0, "execution_provider": "cpu",
                   "models": [{"name": "broken", "path": str(corrupt_model)}]},
    }))
    done = subprocess.run([sys.executable, "-m", "stack", "serve", "reward", "--config", str(config)],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert f"tandem: model broken: cannot load {corrupt_model}: " in done.stderr
