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
        ({"search": {"coalesce_max_rows": 4096}}, "search.coalesce_max_rows: removed: a wave's leaves"),
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
        ({"reward": {"host_wait": "sleep"}}, "reward.host_wait: must be one of"),
        ({"search": {"host_wait": "busy"}}, "search.host_wait: must be one of"),
        ({"scheduler": {"urgency": {"phase_lat": 2}}}, "scheduler.urgency.phase_lat: unknown key"),
        ({"scheduler": {"urgency": {"lower_threshold": 3.0}}}, "scheduler.urgency: UrgencyWeights.lower_threshold"),
        ({"scheduler": {"urgency": {"slack_weight": -1}}}, "scheduler.urgency: UrgencyWeights.slack_weight"),
        ({"scheduler": {"urgency": {"static_search_percentage": 50.5}}},
         "scheduler.urgency.static_search_percentage: expected an integer"),
        ({"search": {"stream_priorities": [1]}}, "search.stream_priorities: must be distinct CUDA stream priorities"),
        # Issue 13, kind 5: every number finite and within what its consumer can take.
        ({"scheduler": {"lease_ttl_ms": float("nan")}}, "scheduler.lease_ttl_ms: must be a finite number"),
        ({"reward": {"max_queue_delay_us": float("inf")}}, "reward.max_queue_delay_us: must be a finite number"),
        ({"search": {"c_puct": float("-inf")}}, "search.c_puct: must be a finite number"),
        ({"scheduler": {"urgency": {"slack_weight": float("nan")}}}, "scheduler.urgency.slack_weight: must be a finite"),
        ({"reward": {"metrics_port": 70000}}, "reward.metrics_port: must be <= 65535"),
        ({"reward": {"server": {"max_message_bytes": 4294967296}}},
         "reward.server.max_message_bytes: must be <= 2147483647"),
        ({"search": {"max_simulations": 2**32}}, "search.max_simulations: must be <= 4294967295"),
        ({"search": {"parallel_sims": 70000}}, "search.parallel_sims: must be <= 65536"),
        ({"search": {"max_batch_searches": 257}}, "search.max_batch_searches: must be <= 256"),
        ({"search": {"session_ttl_ms": 1e12}}, "search.session_ttl_ms: must be <= 86400000"),
        ({"search": {"max_sessions": 2**40}}, "search.max_sessions: must be <= 2147483647"),
        ({"search": {"value_model_sims_per_warp": 33}}, "search.value_model_sims_per_warp: must be <= 32"),
        ({"search": {"value_model_sims_per_warp": 0}}, "search.value_model_sims_per_warp"),
        # Issue 41: a duration a positive value below its floor cannot mean.
        ({"scheduler": {"lease_ttl_ms": 0.001}}, "scheduler.lease_ttl_ms: must be >= 10.0, got 0.001"),
        ({"search": {"max_deadline_ms": 0.5}}, "search.max_deadline_ms: must be >= 1.0"),
        ({"search": {"wave_target_ms": 0.01}}, "search.wave_target_ms: must be >= 0.1 (or 0)"),
        ({"search": {"max_trees": 0}}, "search.max_trees: must be > 0"),
        ({"search": {"server": {"switch_interval_us": 0.5}}}, "search.server.switch_interval_us: must be >= 1.0"),
        ({"reward": {"server": {"switch_interval_us": 6000}}}, "reward.server.switch_interval_us: must be <= 5000"),
        ({"search": {"max_batch_searches": -1}}, "search.max_batch_searches: must be > 0"),
        ({"search": {"evaluator": "x" * 10_000}}, "search.evaluator: must be one of"),
        ({"reward": {"models": [{"name": "m", "path": "reward_service/models/connect4_value.onnx",
                                 "precision": "fp8"}]}}, "reward.models[0].precision: must be one of fp32, fp16, auto"),
        ({"reward": {"models": [{"name": "m", "path": "reward_service/models/connect4_value.onnx",
                                 "fuse_conv_bias": True}]}}, "reward.models[0].fuse_conv_bias: needs prefer_nhwc"),
    ],
)
def test_bad_values_are_refused_naming_the_key(data, key):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert key in str(info.value)


def test_messages_are_one_short_line():
    with pytest.raises(ConfigError) as info:
        parse_config({"search": {"evaluator": "x" * 10_000}})
    assert "\n" not in str(info.value) and len(str(info.value)) < 200  # the value quoted, truncated


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    """A "billion laughs" document: nine levels of nine aliases, 9**9 strings
    once expanded. The loader refuses the first alias, so nothing is expanded
    (asserting the refusal, not a time: the expansion would take minutes and GBs)."""
    levels = ["a: &a [" + ",".join(['"lol"'] * 9) + "]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        levels.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")
    assert bomb.stat().st_size < 500
    with pytest.raises(ConfigError) as info:
        load_config(bomb)
    message = str(info.value)
    assert "bomb.yaml: not valid YAML: line 2: YAML aliases" in message
    assert "\n" not in message and "lol" not in message and len(message) < 300
    plain = tmp_path / "anchor.yaml"  # an anchor no alias uses expands nothing: it loads
    plain.write_text("search: &s\n  backend: cpu\n")
    assert load_config(plain).search.backend == "cpu"


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
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"search:\n  backend: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"binary.yaml: not UTF-8 text \(byte 19\)"):
        load_config(binary)
    multiline = tmp_path / "multiline.yaml"
    multiline.write_text("search:\n  backend: cpu\n   evaluator: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(multiline)
    assert "not valid YAML" in str(info.value) and "\n" not in str(info.value)


def test_a_key_given_twice_is_refused_naming_its_line(tmp_path):
    """The last of two keys would win silently: a second ``auth_token: ""``
    would turn authentication off."""
    twice = tmp_path / "twice.yaml"
    twice.write_text('auth_token: "s3cret"\nsearch:\n  backend: cpu\nauth_token: ""\n')
    with pytest.raises(ConfigError) as info:
        load_config(twice)
    assert "twice.yaml: not valid YAML: line 4: auth_token: the key is given twice" in str(info.value)
    nested = tmp_path / "nested.yaml"
    nested.write_text("search:\n  backend: cpu\n  backend: cuda\n")
    with pytest.raises(ConfigError, match="line 3: backend: the key is given twice"):
        load_config(nested)
    same_name = tmp_path / "same_name.yaml"  # one name in two mappings is two keys
    same_name.write_text("search:\n  address: 127.0.0.1:50152\nreward:\n  address: 127.0.0.1:50151\n")
    assert load_config(same_name).search.address == "127.0.0.1:50152"


def test_unbounded_and_deeply_nested_input_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"/dev/zero: larger than 1048576 bytes, not a config file"):
        load_config("/dev/zero")
    deep = tmp_path / "deep.yaml"
    deep.write_text("search: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(deep)
    message = str(info.value)
    assert "deep.yaml: not valid YAML: line 1: nested deeper than 32 levels" in message and len(message) < 200


def test_urgency_weights_come_from_the_yaml_and_may_be_zero():
    cfg = parse_config({"scheduler": {"urgency": {"slack_weight": 0, "raise_threshold": 3.0, "phase_late": 2}}})
    w = cfg.scheduler.urgency
    assert (w.slack_weight, w.raise_threshold, w.phase_late, w.lower_threshold) == (0.0, 3.0, 2.0, 1.5)

