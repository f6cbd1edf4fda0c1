"""The YAML schema refuses unknown keys and bad values, naming the key."""
import pytest

from tandem.config import DEFAULT_CONFIG, ConfigError, load_config, parse_config


def test_shipped_config_loads_and_matches_defaults():
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg == parse_config({})
    assert cfg.search.address.startswith("127.0.0.1:")  # loopback unless configured otherwise


@pytest.mark.parametrize(
    "data, key",
    [
        ({"rewrd": {}}, "rewrd: unknown key"),
        ({"search": {"parallel_simz": 4}}, "search.parallel_simz: unknown key"),
        ({"search": {"parallel_sims": "many"}}, "search.parallel_sims: expected an integer"),
        ({"search": {"parallel_sims": 0}}, "search.parallel_sims: must be > 0"),
        ({"search": {"c_puct": -1}}, "search.c_puct: must be > 0"),
        ({"search": {"backend": "tpu"}}, "search.backend: must be one of"),
        ({"scheduler": {"policy": "fastest"}}, "scheduler.policy: must be one of"),
        ({"scheduler": {"address": "localhost"}}, "scheduler.address: expected HOST:PORT"),
        ({"scheduler": {"address": "127.0.0.1:70000"}}, "scheduler.address: expected HOST:PORT"),
        ({"reward": {"models": {}}}, "reward.models: expected a list"),
        ({"reward": {"models": []}}, "reward.models: at least one model"),
        ({"reward": {"models": [{"name": "m", "path": "nope.onnx"}]}}, "reward.models[0].path: file not found"),
        ({"reward": {"models": [{"name": "m", "path": "x", "colour": 1}]}}, "reward.models[0].colour: unknown key"),
        ({"reward": {"nonfinite_inputs": "maybe"}}, "reward.nonfinite_inputs: must be one of"),
        ({"tls": {"cert_path": "c.pem"}}, "tls: cert_path and key_path must be set together"),
        ({"search": {"server": {"max_workers": True}}}, "search.server.max_workers: expected an integer"),
        ([1, 2], "config: expected a mapping"),
        ({"scheduler": {"mps": "on"}}, "scheduler.mps: must be one of"),
        ({"scheduler": {"urgency": {"phase_lat": 2}}}, "scheduler.urgency.phase_lat: unknown key"),
        ({"scheduler": {"urgency": {"lower_threshold": 3.0}}}, "scheduler.urgency: UrgencyWeights.lower_threshold"),
        ({"scheduler": {"urgency": {"slack_weight": -1}}}, "scheduler.urgency: UrgencyWeights.slack_weight"),
        ({"scheduler": {"urgency": {"static_search_percentage": 50.5}}},
         "scheduler.urgency.static_search_percentage: expected an integer"),
        ({"search": {"stream_priorities": [1]}}, "search.stream_priorities: must be distinct CUDA stream priorities"),
    ],
)
def test_bad_values_are_refused_naming_the_key(data, key):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert key in str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("search: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("search:\n  evaluatr: rollout\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: search.evaluatr: unknown key"):
        load_config(typo)


def test_urgency_weights_come_from_the_yaml_and_may_be_zero():
    cfg = parse_config({"scheduler": {"urgency": {"slack_weight": 0, "raise_threshold": 3.0, "phase_late": 2}}})
    w = cfg.scheduler.urgency
    assert (w.slack_weight, w.raise_threshold, w.phase_late, w.lower_threshold) == (0.0, 3.0, 2.0, 1.5)
