"""loadtest/reliability_figures.py: every section's figures saved, loaded back
unchanged and rendered by loadtest/reliability_report.py, in a temporary
directory; and from_json's handling of missing, defaulted and unknown fields."""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import subprocess
import sys

import pytest

from loadtest import reliability_figures as rf
from loadtest import reliability_report
from loadtest.reliability_figures import (
    AccessFigures,
    BadInputFigures,
    CancelFigures,
    ClientDeadlineFigures,
    FaultFigures,
    FaultsFigures,
    FloodFigures,
    FuzzFigures,
    FuzzTargetFigures,
    Host,
    KeepaliveFigures,
    LatencyMs,
    LimitsFigures,
    LoadFigures,
    LoopbackFigures,
    MutualTlsFigures,
    NoPickleFigures,
    RequestCounts,
    RpcOutcomes,
    ServerSoakFigures,
    SessionsFigures,
    SoakFigures,
    SoakRequests,
    Stamp,
    TokenFigures,
    WatchStreamsFigures,
    from_json,
    load_figures,
    save_figures,
)


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """save_figures, load_figures and the report read ``RESULTS_DIR`` when called:
    point it at a temporary directory."""
    d = tmp_path / "reliability"
    monkeypatch.setattr(rf, "RESULTS_DIR", d)
    return d


def _server(rss: float) -> ServerSoakFigures:
    return ServerSoakFigures(rss_mib_start=rss - 10, rss_mib_after_warmup=rss, rss_mib_end=rss + 0.5,
                             rss_mib_max=rss + 1, rss_growth_mib=0.5, rss_slope_mib_per_min=0.01,
                             fds_after_warmup=30, fds_end=30, fds_max=31, fds_growth=0,
                             threads_after_warmup=12, threads_end=12, threads_growth=0, samples=60)


SAMPLES: list = [
    BadInputFigures(examples_per_property=50, rpcs={
        "Search": RpcOutcomes(inputs=500, outcomes={"OK": 146, "INVALID_ARGUMENT": 279, "NOT_FOUND": 75}),
        "Evaluate": RpcOutcomes(inputs=10, outcomes={"OK": 1, "INVALID_ARGUMENT": 8, "INTERNAL": 1}),
    }),
    FuzzFigures(budget_s=30.0, targets=[
        FuzzTargetFigures(target="search", code="SearchRequest validation", examples=1200, elapsed_s=15.2,
                          outcomes={"INVALID_ARGUMENT": 1100, "decode_error": 100}),
    ]),
    LimitsFigures(
        flood=FloodFigures(search_deadline_ms=500.0, max_concurrent_rpcs=8, max_workers=4, sent=20, answered=8,
                           refused_resource_exhausted=12, lost=0, refused_latency_ms_max=3.5,
                           answered_latency_ms_min=501.0, answered_latency_ms_max=1010.2,
                           health_probe_while_saturated="SERVING"),
        cancel=CancelFigures(budget_simulations=10_000_000, cancelled_after_ms=500.0, stopped_after_cancel_ms=4.1,
                             simulations_done=3000, waves=12),
        client_deadline=ClientDeadlineFigures(grpc_timeout_ms=300, outcome="OK", answered_after_ms=290.5,
                                              search_deadline_ms=270.0, simulations_done=900),
        watch_streams=WatchStreamsFigures(max_workers=6, streams_admitted=2, third_stream="RESOURCE_EXHAUSTED"),
        sessions=None,  # its test did not run
    ),
    FaultsFigures(
        outage_s=2.0,
        load=LoadFigures(engines=2, fps=10.0, simulations=16, evaluator="value_model", timeout_s=2.0, duration_s=12.0),
        faults=[FaultFigures(killed="reward",
                             while_down={"search": RequestCounts(sent=40, answered=40,
                                                                 evaluators={"EVALUATOR_ROLLOUT": 40}),
                                         "evaluate": RequestCounts(sent=40, answered=0,
                                                                   refused={"UNAVAILABLE": 40}, lost=0)},
                             recovery_s={"restart_to_serving": 1.2, "restart_to_value_model": 2.5})],
        totals={"search": RequestCounts(sent=240, answered=240, lost=0),
                "evaluate": RequestCounts(sent=240, answered=200, refused={"UNAVAILABLE": 40}, lost=0)},
    ),
    SoakFigures(duration_s=60.0, warmup_s=10.0, engines=2, fps=10.0, simulations=16, evaluator="rollout",
                frames=False, stack_startup_s=3.2,
                requests={"search": SoakRequests(sent=1200, answered=1200, refused={}, lost=0, in_flight=0,
                                                 latency_from_schedule_ms=LatencyMs(4.1, 9.8, 15.0, 4.6)),
                          "evaluate": SoakRequests(sent=1200, answered=1198, refused={"UNAVAILABLE": 2}, lost=0,
                                                   in_flight=0,
                                                   latency_from_schedule_ms=LatencyMs(2.0, 5.5, 7.25, 2.5))},
                servers={"search": _server(300.0), "reward": _server(500.0)},
                server_exited_during_soak=None, exit_codes={"search": 0, "reward": 0, "scheduler": None}),
    AccessFigures(
        loopback=LoopbackFigures(config="deploy/config/tandem.yaml", grpc_listeners=["0100007F"],
                                 metrics_listeners=["0100007F", "00000000000000000000000001000000"]),
        tls={"no_tls_client": "UNAVAILABLE", "tls_client": "OK"},
        mutual_tls=MutualTlsFigures(outcomes={"no_certificate": "UNAVAILABLE", "certificate": "OK"},
                                    search_to_reward="EVALUATOR_VALUE_MODEL", services_registered_with_scheduler=2),
        token=TokenFigures(calls={"Search/none": "UNAUTHENTICATED", "Search/wrong": "UNAUTHENTICATED",
                                  "Search/right": "OK"}, health_without_token="SERVING"),
        no_pickle_eval=NoPickleFigures(files_checked=40, hits=[]),
        keepalive=KeepaliveFigures(server_min_ping_interval_ms=10000, flooder_ping_ms=100, polite_ping_ms=20000,
                                   flooder_outcome="UNAVAILABLE: too_many_pings", flooder_cut_after_s=0.3,
                                   polite_connected_after_s=5.0),
    ),
]


def test_every_section_is_in_the_samples_and_the_report():
    assert [type(f) for f in SAMPLES] == [cls for cls, _ in reliability_report.SECTIONS]


@pytest.mark.parametrize("figures", SAMPLES, ids=lambda f: f.NAME)
def test_save_then_load_gives_the_same_figures(results_dir, figures):
    path = save_figures(figures)
    assert path == results_dir / f"{figures.NAME}.json"
    doc = json.loads(path.read_text())
    assert doc["name"] == figures.NAME
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["date"])
    loaded = load_figures(type(figures))
    assert loaded is not None
    stamp, back = loaded
    assert back == figures  # nested dataclasses come back as dataclasses, Nones as None
    assert stamp.host == Host(os.cpu_count(), platform.python_version(), platform.machine())
    assert stamp.date == doc["date"]
    assert load_figures(type(figures), results_dir) == loaded  # the directory given explicitly


def test_load_figures_without_a_file_is_none(results_dir, tmp_path):
    assert load_figures(LimitsFigures) is None
    assert load_figures(LimitsFigures, tmp_path / "elsewhere") is None


def test_the_report_renders_what_was_saved(results_dir):
    assert reliability_report.render() == "\n"  # nothing saved: no sections
    for figures in SAMPLES:
        save_figures(figures)
    text = reliability_report.render()
    stamp, _ = load_figures(BadInputFigures)
    headings = [line for line in text.splitlines() if line.startswith("### ")]
    assert headings == ["### Bad input over gRPC (`tests/stack/test_bad_input_properties.py`)",
                        "### Fuzzing of request decoding (`tests/stack/fuzz/`)",
                        "### Limits (`tests/stack/test_limits.py`)",
                        "### Faults (`tests/stack/test_faults.py`)",
                        "### Soak (`tests/stack/test_soak.py`, `loadtest/soak.py`)",
                        "### Access (`tests/stack/test_access.py`)"]
    assert f"_{stamp.date}, {os.cpu_count()} CPUs, Python {platform.python_version()}_" in text
    # Rows computed from the figures, as the page shows them.
    assert "| `Search` | 500 | 146 | INVALID_ARGUMENT 279, NOT_FOUND 75 | 0 |" in text
    assert "| `Evaluate` | 10 | 1 | INVALID_ARGUMENT 8 | 1 |" in text  # INTERNAL counted as a failure
    assert "510 inputs in all (50 per property)" in text
    assert "| `search` | SearchRequest validation | 1200 | 15.2 | INVALID_ARGUMENT 1100, decode_error 100 |" in text
    assert "20 concurrent 500-ms searches" in text and "12 RESOURCE_EXHAUSTED within 3.5 ms" in text
    assert "| watch streams | `max_workers` 6 | 2 admitted, the next RESOURCE_EXHAUSTED; unary RPCs still served |" \
        in text
    assert "| sessions |" not in text  # its part is None
    assert ("| reward | search 40/40 answered (EVALUATOR_ROLLOUT 40); evaluate 0/40 answered (refused: UNAVAILABLE 40) "
            "| restart to serving: 1.2; restart to value model: 2.5 |") in text
    assert "| evaluate | 240 | 200 | UNAVAILABLE 40 | 0 |" in text
    assert "| search | 1200 | 1200 | none | 0 | 4.1 / 9.8 / 15.0 |" in text
    assert "| evaluate | 1200 | 1198 | UNAVAILABLE 2 | 0 | 2.0 / 5.5 / 7.25 |" in text
    assert "| reward | 500.0 → 500.5 | 0.5 | 0.01 | 30 → 30 | 12 → 12 |" in text
    assert "gRPC listens on 127.0.0.1, metrics on 127.0.0.1, ::1" in text
    assert "UNAUTHENTICATED on 2 of 2 calls tried" in text and "| no pickle/eval | 40 serving files, 0 hits |" in text


def test_the_report_leaves_out_sections_without_a_file(results_dir):
    save_figures(SAMPLES[2])  # limits only
    text = reliability_report.render()
    assert [line for line in text.splitlines() if line.startswith("### ")] == \
        ["### Limits (`tests/stack/test_limits.py`)"]


def test_results_dir_follows_the_environment_variable(tmp_path):
    env = {**os.environ, "TANDEM_RELIABILITY_DIR": str(tmp_path / "x")}
    out = subprocess.run([sys.executable, "-c", "from loadtest.reliability_figures import RESULTS_DIR; "
                          "print(RESULTS_DIR)"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "x")


# -- from_json -----------------------------------------------------------------------------------------------
def test_from_json_refuses_a_missing_field_naming_it():
    with pytest.raises(KeyError, match="WatchStreamsFigures: missing streams_admitted, third_stream"):
        from_json(WatchStreamsFigures, {"max_workers": 6})
    doc = {"outage_s": 1.0, "load": {"engines": 1, "fps": 10.0, "simulations": 8, "evaluator": "rollout",
                                     "timeout_s": 1.0}, "faults": [], "totals": {}}
    with pytest.raises(KeyError, match="LoadFigures: missing duration_s"):  # nested too
        from_json(FaultsFigures, doc)


def test_from_json_fills_defaults_and_ignores_unknown_keys():
    counts = from_json(RequestCounts, {"sent": 3, "answered": 2, "added_in_a_later_version": True})
    assert counts == RequestCounts(sent=3, answered=2, refused={}, lost=None, evaluators={})
    limits = from_json(LimitsFigures, {"name": "limits", "date": "x",
                                       "sessions": {"games": 3, "max_sessions": 2, "kept_after_games": 2,
                                                    "max_session_id_chars": 256}})
    assert limits == LimitsFigures(sessions=SessionsFigures(3, 2, 2, 256))


def test_from_json_builds_nested_lists_dicts_and_optionals():
    stamp = from_json(Stamp, {"date": "2026-01-01T00:00:00Z", "host": {"cpus": None, "python": "3.11.7",
                                                                          "machine": "x86_64"}})
    assert stamp == Stamp("2026-01-01T00:00:00Z", Host(None, "3.11.7", "x86_64"))
    fuzz = from_json(FuzzFigures, {"budget_s": 1.0, "targets": [
        {"target": "t", "code": "c", "examples": 1, "elapsed_s": 0.1, "outcomes": {"OK": 1}}]})
    assert fuzz.targets == [FuzzTargetFigures("t", "c", 1, 0.1, {"OK": 1})]
    bad = from_json(BadInputFigures, {"examples_per_property": 1, "rpcs": {"Search": {"inputs": 1, "outcomes": {}}}})
    assert bad.rpcs == {"Search": RpcOutcomes(1, {})}
    assert from_json(LimitsFigures, {"flood": None}) == LimitsFigures()


def test_from_json_refuses_a_non_object_where_a_dataclass_is_expected():
    with pytest.raises(TypeError, match="LatencyMs: expected an object, got list"):
        from_json(LatencyMs, [1, 2, 3, 4])
    with pytest.raises(TypeError, match="LoadFigures: expected an object, got str"):
        from_json(FaultsFigures, {"outage_s": 1.0, "load": "fast", "faults": [], "totals": {}})


def test_a_file_missing_a_figure_does_not_load(results_dir):
    path = save_figures(SAMPLES[0])
    doc = json.loads(path.read_text())
    del doc["examples_per_property"]
    path.write_text(json.dumps(doc))
    with pytest.raises(KeyError, match="examples_per_property"):
        load_figures(BadInputFigures)
    path.write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        load_figures(BadInputFigures)


def test_soak_figures_from_a_soak_report():
    soak = SAMPLES[4]
    doc = json.loads(json.dumps(dataclasses.asdict(soak)))
    # run_soak's report: the duration as "seconds", the requests inside the generator's report.
    report = {k: v for k, v in doc.items() if k not in ("duration_s", "requests")}
    report["seconds"] = doc["duration_s"]
    report["load"] = {"requests": doc["requests"], "frames": 1200}
    assert SoakFigures.from_report(report) == soak
    del report["seconds"]
    with pytest.raises(KeyError):
        SoakFigures.from_report(report)
