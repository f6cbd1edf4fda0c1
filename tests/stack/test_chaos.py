"""A short chaos run on the CPU (loadtest/chaos.py): `tandem up`, two engines
and a trainer, each server SIGKILLed in turn and the search service stopped
for 2 s: no request lost (each answered or refused with a status), the frames'
Evaluates answered through every kill but the search service's, and every
server SERVING at the end. The 10-minute run of 64 engines is the GPU's
(docs/reliability.md)."""
from __future__ import annotations

import pytest
import yaml
from conftest import cpu_config_file

from loadtest import chaos

pytestmark = pytest.mark.slow


def test_a_short_chaos_run_loses_nothing_and_ends_serving(tmp_path):
    config = cpu_config_file(tmp_path / "chaos.yaml")
    out = tmp_path / "chaos.json"
    code = chaos.main(["--config", str(config), "--minutes", "0.75", "--engines", "2", "--fps", "10",
                       "--simulations", "16", "--kill-every-s", "10", "--stop-s", "2", "--trainer-batch", "4",
                       "--timeout-s", "5", "--log-dir", str(tmp_path / "logs"), "--out", str(out)])
    result = yaml.safe_load(out.read_text())
    assert code == 0, result
    assert result["lost"] == 0 and set(result["serving_at_the_end"].values()) == {"SERVING"}
    kills = [f for f in result["faults"] if f["signal"] == "SIGKILL"]
    assert [f["server"] for f in kills][:3] == ["reward", "reward_bulk", "search"]
    for f in kills:
        assert f["serving_again_after_s"] is not None, f
        evaluate = f["requests"]["evaluate"]
        if f["server"] != "search":  # the reward service's standby answers while it is down
            assert set(evaluate["refused"]) <= {"DEADLINE_EXCEEDED"}, f
