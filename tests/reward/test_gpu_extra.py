"""A GPU install (`pip install '.[gpu]'`: the Dockerfile's, `make` with
FLAVOUR=gpu) can serve the shipped configs: a model whose precision is fp16
there (``fp16``, or ``auto`` on CUDA) is converted at load, which needs the
``fp16`` extra's packages (reward_service/session.py ``_to_fp16``)."""
from __future__ import annotations

import tomllib

import pytest

from reward_service.session import resolve_precision
from tandem.config import DEFAULT_CONFIG, load_config, resolve_path


@pytest.mark.parametrize("config", [DEFAULT_CONFIG, "deploy/config/tandem.container.yaml"])
def test_the_gpu_extra_brings_what_fp16_models_of_the_shipped_config_need(config):
    extras = tomllib.loads(resolve_path("pyproject.toml").read_text())["project"]["optional-dependencies"]
    fp16 = [m.name for m in load_config(config).reward.models if resolve_precision(m.precision, cuda=True) == "fp16"]
    assert fp16, "no model of the shipped config runs in fp16 on a GPU: this test checks nothing"
    missing = sorted(set(extras["fp16"]) - set(extras["gpu"]))
    assert not missing, f"{fp16} convert to FP16 on a GPU, but the gpu extra lacks {missing}"
