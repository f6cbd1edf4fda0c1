"""bench/engines.py's variants (``--variants``): each parsed to the settings its
`tandem up` runs with, a bad one refused naming the key or the value."""
from __future__ import annotations

import pytest

from bench.engines import games_per_gpu, parse_variants, variant_label, variant_settings


def test_variants_parse_to_their_settings_and_name_their_rows():
    variants = parse_variants("queue_wait_target_ms=0;;workers=4,reward-workers=2,host_wait=yield")
    assert variants == [{"queue_wait_target_ms": 0.0}, {}, {"workers": 4, "reward_workers": 2, "host_wait": "yield"}]
    assert [variant_label(v) for v in variants] == ["queue_wait_target_ms=0.0", "",
                                                    "workers=4,reward_workers=2,host_wait=yield"]
    assert parse_variants("") == [{}]  # no --variants: one run with the flags' settings


@pytest.mark.parametrize("text, words", [("bogus=1", "'bogus' is not one of"), ("workers=x", "workers='x' is not a int")])
def test_a_bad_variant_is_refused_naming_it(text, words):
    with pytest.raises(SystemExit) as info:
        parse_variants(text)
    assert words in str(info.value)


def _row(variant: str, engines: int, missed: float) -> dict:
    return {"variant": variant, "engines": engines, "agents_per_engine": 1, "evaluator": "value_model",
            "trainer": "none", "missed_frame_share": missed, "simulations_per_frame": 300.0}


def test_games_per_gpu_counts_the_first_variant_only():
    rows = [_row("", 8, 0.0), _row("", 32, 0.5), _row("workers=4", 32, 0.0)]
    assert games_per_gpu(rows) == 8
    assert games_per_gpu(rows[2:]) == 32


def test_the_trainer_runs_until_the_engines_last_frame(monkeypatch, tmp_path):
    """A contended row's trainer starts 5 s before the engines are started and
    must run past their last frame, which comes only after their start lead
    (``--start-at``: 3 s + 0.1 s an engine) and ``frames / fps``."""
    from bench import engines

    asked = []

    class Stop(Exception):
        pass

    def trainer(config, seconds, report):
        asked.append(seconds)
        raise Stop

    monkeypatch.setattr(engines, "_trainer", trainer)
    with pytest.raises(Stop):
        engines.run_row(tmp_path / "tandem_default.yaml", tmp_path, 64, 1, "rollout", 600, 60.0, "shm")
    last_frame_s = 5 + engines.START_LEAD_S + engines.START_LEAD_PER_ENGINE_S * 64 + 600 / 60.0
    assert asked[0] > last_frame_s


def test_a_variants_settings_go_over_the_flags_workers_over_each_services():
    flags = {"workers": None, "search_workers": 2, "reward_workers": None, "host_wait": "yield",
             "switch_interval_us": None, "queue_wait_target_ms": None, "engines": [8]}
    got = variant_settings(flags, {"workers": 4})
    assert got["workers"] == 4 and got["search_workers"] is None and got["host_wait"] == "yield"
    assert variant_settings(flags, {})["search_workers"] == 2  # no variant: the flags as given
    assert variant_settings(flags, {"queue_wait_target_ms": 0.0})["queue_wait_target_ms"] == 0.0


def test_a_variants_search_settings_reach_the_config_it_runs(tmp_path):
    """A search setting of a variant (SEARCH_KEYS) is written into the search
    section of the config its `tandem up` reads, which the loader accepts."""
    import yaml

    from bench import engines
    from tandem.config import load_config

    variant = parse_variants("wave_target_ms=0,value_model_parallel_sims=64")[0]
    settings = variant_settings({"engines": [8]}, variant)
    path = engines._config("default", tmp_path, server={}, search={k: settings[k] for k in engines.SEARCH_KEYS
                                                                    if settings.get(k) is not None})
    assert yaml.safe_load(path.read_text())["search"]["value_model_parallel_sims"] == 64
    cfg = load_config(path)
    assert cfg.search.wave_target_ms == 0 and cfg.search.value_model_parallel_sims == 64


def test_a_variants_server_settings_reach_both_services_configs(tmp_path):
    """A server setting of a variant (SERVER_KEYS) is written into both
    services' server sections, which the loader accepts; None keeps the shipped value."""
    from bench import engines
    from tandem.config import load_config

    settings = variant_settings({"engines": [8]}, parse_variants("queue_wait_target_ms=0")[0])
    path = engines._config("default", tmp_path, server={key: settings[key] for key in engines.SERVER_KEYS})
    cfg = load_config(path)
    assert cfg.search.server.queue_wait_target_ms == 0 and cfg.reward.server.queue_wait_target_ms == 0
    assert cfg.search.server.switch_interval_us == 200.0  # None: the shipped value
