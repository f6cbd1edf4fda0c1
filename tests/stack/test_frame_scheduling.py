"""The 60 FPS scheduling load test and its benchmark, in their tiny CPU form
(``python -m bench.frame_scheduling --quick``): real stacks, one per policy."""
from __future__ import annotations

import json

import pytest

from bench import frame_scheduling
from loadtest.background import TRANSPORTS
from loadtest.frame_scheduling import ROW_FIELDS, SCENARIOS, run_scenario, write_config
from stack.supervisor import Stack
from tandem.config import bulk_address, load_config


PANELS = [(t, on) for t in TRANSPORTS for on in (True, False)]  # --bulk-server on,off (the default)


@pytest.mark.slow
def test_quick_run_writes_a_row_per_policy_transport_and_bulk_server_and_a_plot(tmp_path):
    frame_scheduling.main(["--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "frame_scheduling.json").read_text())
    assert doc["benchmark"] == "frame_scheduling"
    rows = {(r["policy"], r["background_transport"], r["bulk_server"]): r for r in doc["rows"]}
    with_trainer = [s for s in SCENARIOS if s != "uncontended"]
    assert list(rows) == [("uncontended", None, True)] + [(s, t, on) for t, on in PANELS for s in with_trainer]
    for r in doc["rows"]:
        assert set(ROW_FIELDS) <= set(r)
        if r["lever_samples"]:  # the bulk server registers with the scheduler as a reward service of its own
            assert r["reward_services"] == (2 if r["bulk_server"] else 1)
    for (name, transport, _), r in rows.items():
        if name == "background_alone":
            assert r["frame_ms_p50"] is None and r["clients"] == 0
            continue
        assert r["clients"] == 1 and r["fps"] == 10.0
        assert 0 < r["frame_ms_p50"] <= r["frame_ms_p99"] and r["frame_ms_avg"] > 0
        assert 0 <= r["missed_frame_share"] <= 1
        assert r["simulations_per_frame"] == 16  # the fixed budget, completed (the cap is a whole frame)
        assert r["requests"]["evaluate"]["answered"] == r["requests"]["evaluate"]["sent"] > 0
        assert r["critical_queue_ms_p99"] >= 0 and r["critical_model_ms_p99"] > 0
        # The bulk lever as sampled from the scheduler: none under default, the fixed share under static,
        # the live one (between its floor and 100) under dynamic. Whether frames were at risk depends on the
        # machine's speed: only its range is checked.
        if r["lever_samples"]:
            expected = {"default": 100, "static": 50}.get(name)
            if expected is not None:
                assert r["bulk_share_mean_percent"] == expected
            assert 10 <= r["bulk_share_mean_percent"] <= 100 and 0 <= r["frames_at_risk_share"] <= 1
    assert rows[("uncontended", None, True)]["background_per_s"] is None
    for key, r in rows.items():
        if key[0] != "uncontended":
            assert r["background_per_s"] > 0 and not r["background"]["refused"]
            assert r["background"]["transport"] == key[1]
    lat = json.loads((tmp_path / "frame_scheduling_latencies.json").read_text())
    names = [f"{t}, {'bulk server' if on else 'one reward process'}" for t, on in PANELS]
    assert lat["fps"] == 10.0 and list(lat["latencies_ms"]) == names
    for name in names:
        panel = lat["latencies_ms"][name]
        assert set(panel) == set(SCENARIOS)
        assert panel["background_alone"] == [] and len(panel["dynamic"]) >= 10
        assert panel["uncontended"] == lat["latencies_ms"][names[0]]["uncontended"]  # one run, every panel
    try:
        import matplotlib  # noqa: F401 - the loadtest extra
    except ImportError:
        return
    png = tmp_path / "frame_scheduling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()
    frame_scheduling.main(["--plot-only", str(tmp_path)])  # again, from the latencies file alone
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_stack_that_fails_costs_only_its_own_rows(tmp_path, monkeypatch):
    """uncontended plays on one stack, dynamic on another, which cannot start: its log
    directory's name is taken by a file. The uncontended row is written all the same."""
    monkeypatch.setattr(frame_scheduling.common, "FAILED", [])
    logs = tmp_path / "logs"
    (logs / "grpc-one").mkdir(parents=True)
    (logs / "grpc-one" / "dynamic").write_text("not a directory")
    with pytest.raises(SystemExit) as exit_info:
        frame_scheduling.main(["--quick", "--scenarios", "uncontended,dynamic", "--background-transport", "grpc",
                               "--bulk-server", "off", "--logs", str(logs), "--out", str(tmp_path), "--no-plot"])
    assert exit_info.value.code == 1 and frame_scheduling.common.FAILED == ["dynamic (grpc, bulk server off)"]
    rows = json.loads((tmp_path / "frame_scheduling.json").read_text())["rows"]
    assert [(r["policy"], r["bulk_server"]) for r in rows] == [("uncontended", False)]
    panel = json.loads((tmp_path / "frame_scheduling_latencies.json").read_text())["latencies_ms"]["grpc, one reward process"]
    assert set(panel) == {"uncontended"} and panel["uncontended"]


def test_an_unknown_transport_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        frame_scheduling.main(["--quick", "--background-transport", "grpc,pigeon"])
    assert exit_info.value.code == 2 and "--background-transport" in capsys.readouterr().err


def test_an_unknown_bulk_server_choice_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        frame_scheduling.main(["--quick", "--bulk-server", "on,maybe"])
    assert exit_info.value.code == 2 and "--bulk-server" in capsys.readouterr().err


def test_the_trainer_goes_to_the_bulk_server_where_one_runs(tmp_path):
    on = load_config(write_config(None, "default", tmp_path / "on.yaml", free_ports=True, bulk_server=True))
    off = load_config(write_config(None, "default", tmp_path / "off.yaml", free_ports=True, bulk_server=False))
    assert bulk_address(on) == on.reward.bulk_server.address != on.reward.address
    assert bulk_address(off) == off.reward.address
    assert Stack(on, None).processes() == ("scheduler", "reward", "reward_bulk", "search")
    assert Stack(off, None).processes() == ("scheduler", "reward", "search")


def test_static_starts_each_server_with_its_mps_thread_share(tmp_path):
    cfg = load_config(write_config(None, "static", tmp_path / "t.yaml"))
    stack = Stack(cfg, None)
    assert stack._env("search")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert stack._env("reward")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert stack._env("reward_bulk")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"  # the bulk server: reward's share
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in stack._env("scheduler")
    dynamic = load_config(write_config(None, "dynamic", tmp_path / "d.yaml"))
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in Stack(dynamic, None)._env("search")


def test_config_per_policy_on_free_ports(tmp_path):
    cfg = load_config(write_config(None, "dynamic", tmp_path / "t.yaml", free_ports=True))
    assert cfg.scheduler.policy == "dynamic" and cfg.scheduler.metrics_port == 0
    assert len({cfg.scheduler.address, cfg.reward.address, cfg.reward.bulk_server.address, cfg.search.address}) == 4
    assert cfg.reward.bulk_server.metrics_port == 0


def test_unknown_scenario_is_refused():
    with pytest.raises(ValueError, match="scenario"):
        run_scenario("fastest", frame_scheduling.QUICK)


def test_the_benchmarks_loopback_stack_puts_the_bulk_server_on_a_free_port_too():
    from bench.loopback_stack import loopback_stack_data
    from tandem.config import TandemConfig, endpoints, parse_config

    cfg = parse_config(loopback_stack_data({"reward": {"execution_provider": "cpu"}}))
    shipped = {address for address, _ in endpoints(TandemConfig()).values()}
    got = endpoints(cfg)
    assert "reward_bulk" in got and cfg.reward.execution_provider == "cpu"
    # Beside a running `tandem up` (the shipped ports, 127.0.0.1:50053 the bulk server's): none of its ports.
    assert not {address for address, _ in got.values()} & shipped
    assert {metrics for _, metrics in got.values()} == {0}
