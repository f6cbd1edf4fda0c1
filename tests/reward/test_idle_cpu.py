"""ONNX Runtime's thread pools do not busy-wait between runs (issue 13, kind 8):
spinning cost the reward service 0.75-1.09 cores at 60 one-board Evaluate/s
against 0.05 of model time (bench/service_cpu.py measures it)."""
from __future__ import annotations

import pytest

from reward_service.session import ModelSession
from tandem.config import ModelConfig, RewardConfig

MODEL = ModelConfig(name="m", path="reward_service/models/connect4_value.onnx", batch_buckets=(1, 2))
SPIN_KEYS = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")


def _spinning(session: ModelSession) -> set[str]:
    """The allow_spinning entries of every ONNX Runtime session the model runs on."""
    entries = set()
    for runner in session.lane_runners():
        sessions = [slot.session for slot in runner._slots.values()] if hasattr(runner, "_slots") else [runner.session]
        for s in sessions:
            options = s.get_session_options()
            entries |= {options.get_session_config_entry(key) for key in SPIN_KEYS}
    return entries


@pytest.mark.parametrize("host_binding", [False, True], ids=["plain", "bound"])
def test_thread_pools_do_not_spin_by_default(host_binding):
    session = ModelSession(MODEL, RewardConfig(execution_provider="cpu"), host_binding=host_binding)
    assert _spinning(session) == {"0"}


def test_spinning_can_be_turned_back_on():
    session = ModelSession(MODEL, RewardConfig(execution_provider="cpu", ort_thread_spinning=True))
    assert _spinning(session) == {"1"}
