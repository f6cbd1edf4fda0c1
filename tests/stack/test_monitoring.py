"""Metrics and the monitoring files: a real stack (``tandem up``) is called,
its three /metrics endpoints are scraped, and the families, values and labels
are checked; the Grafana dashboard, the alert rules, the Prometheus config,
the compose ``monitoring`` profile and the Prometheus Operator objects are
validated offline against the project and against what the servers export
(PromQL parsed by ``promql-parser``, the operator's kinds by the
``cloudcoil-models-prometheus-operator`` models, round-tripped so that an
unknown field counts too)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from functools import cache
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families
from tandem.v1 import reward_pb2, reward_pb2_grpc

from tandem import tensors
from tandem.config import load_config, loopback_data
from tandem.paths import REPO_ROOT
from tandem.server import channel

pydantic = pytest.importorskip("pydantic", reason="the test extra (deploy validation) is not installed")

MONITORING = REPO_ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "tandem.json"
ALERTS = MONITORING / "alerts.yml"
PROMETHEUS = MONITORING / "prometheus.yml"
K8S = REPO_ROOT / "deploy" / "k8s"
PODMONITOR = K8S / "monitoring" / "podmonitor.yaml"
PROMETHEUS_RULE = K8S / "monitoring" / "prometheusrule.yaml"
MODEL = "connect4_value"
# Exported only where a GPU is (NVML, CuPy's pool): absent on a CPU host, not zero.
GPU_ONLY = {"tandem_scheduler_gpu_utilisation_ratio", "tandem_scheduler_gpu_memory_used_bytes",
            "tandem_search_pool_bytes"}


def scrape(port: int) -> dict:
    """Family name -> family, from http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, sample_name: str, **labels) -> float:
    """The one sample called ``sample_name`` whose labels include ``labels``."""
    family = sample_name
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        family = family.removesuffix(suffix) if family not in families else family
    got = [s.value for s in families[family].samples
           if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(got) == 1, f"{sample_name}{labels}: {len(got)} samples"
    return got[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """``tandem up`` on free ports, called for real; yields the config and the
    three servers' scrapes taken right after the calls below (before ``play``)
    and after a short ``tandem play``."""
    tmp = tmp_path_factory.mktemp("monitoring")
    data = loopback_data(free_port, metrics=True, bulk_server=False)
    data["search"]["backend"] = "cpu"
    data["scheduler"]["report_interval_ms"] = 100
    path = tmp / "tandem.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    up = subprocess.Popen([sys.executable, "-m", "stack", "up", "--config", str(path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, "tandem up exited early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("tandem is up"):
                break
        ports = {name: getattr(cfg, name).metrics_port for name in ("scheduler", "reward", "search")}
        # Both services hold a lease within a few report intervals.
        for _ in range(600):
            if all(value(scrape(ports[n]), "tandem_scheduler_client_lease_held") == 1 for n in ("reward", "search")):
                break
            time.sleep(0.1)
        with channel(cfg.reward.address) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            board = (np.arange(2 * 2 * 6 * 7).reshape(2, 2, 6, 7) % 3 == 0).astype(np.uint8)

            def call(**kw):
                request = dict(model=MODEL, inputs=[tensors.to_proto("board", board)])
                request.update(kw)
                return stub.Evaluate(reward_pb2.EvaluateRequest(**request), timeout=30)

            call(request_class=reward_pb2.REQUEST_CLASS_CRITICAL)
            call()
            call(request_class=reward_pb2.REQUEST_CLASS_BULK)
            for bad in (dict(inputs=[tensors.to_proto("board", board.astype(np.float32))]), dict(model="nope")):
                with pytest.raises(grpc.RpcError):
                    call(**bad)
        before_play = {name: scrape(port) for name, port in ports.items()}
        play = subprocess.run([sys.executable, "-m", "stack", "play", "--config", str(path), "--frames", "5",
                               "--fps", "30", "--late-answers"], capture_output=True, text=True, timeout=120)
        assert play.returncode == 0, play.stdout + play.stderr
        after_play = {name: scrape(port) for name, port in ports.items()}
        yield cfg, before_play, after_play
    finally:
        up.terminate()
        up.wait(timeout=60)


# ================================================================ what the servers export

@pytest.mark.slow
def test_per_model_request_counters_count_the_calls(stack):
    cfg, m, _ = stack
    r = m["reward"]
    assert value(r, "tandem_reward_model_requests_total", model=MODEL, lane="critical") == 1
    assert value(r, "tandem_reward_model_requests_total", model=MODEL, lane="bulk") == 3  # two good, one bad
    assert value(r, "tandem_reward_model_request_successes_total", model=MODEL, lane="critical") == 1
    assert value(r, "tandem_reward_model_request_successes_total", model=MODEL, lane="bulk") == 2
    assert value(r, "tandem_reward_model_request_failures_total", model=MODEL, lane="bulk",
                 reason="invalid_input") == 1
    # The unknown model is not a model label (client text): it is in the RPC histogram's NOT_FOUND.
    # Every served model's series exist from start-up, at 0 (reward_service/model_metrics.py).
    assert {s.labels["model"] for s in r["tandem_reward_model_requests"].samples} == {x.name for x in cfg.reward.models}
    assert value(r, "tandem_reward_model_requests_total", model="frame_reward", lane="bulk") == 0
    assert value(r, "tandem_rpc_latency_seconds_count", method="/tandem.v1.RewardService/Evaluate",
                 code="NOT_FOUND") == 1


@pytest.mark.slow
def test_per_model_histograms_and_pending_gauge(stack):
    _, m, _ = stack
    r = m["reward"]
    for lane, successes in (("critical", 1), ("bulk", 2)):
        runs = value(r, "tandem_reward_model_executions_total", model=MODEL, lane=lane)
        assert 1 <= runs <= successes
        assert value(r, "tandem_reward_model_queue_seconds_count", model=MODEL, lane=lane) == successes
        assert value(r, "tandem_reward_model_compute_seconds_count", model=MODEL, lane=lane) == runs
        assert value(r, "tandem_reward_model_compute_seconds_sum", model=MODEL, lane=lane) > 0
        assert value(r, "tandem_reward_model_batch_size_count", model=MODEL, lane=lane) == runs
        assert value(r, "tandem_reward_model_batch_size_sum", model=MODEL, lane=lane) == 2 * successes  # 2 rows each
        fill = value(r, "tandem_reward_model_batch_fill_ratio_sum", model=MODEL, lane=lane) / runs
        assert 0 < fill <= 1
        assert value(r, "tandem_reward_model_pending_requests", model=MODEL, lane=lane) == 0
        le_inf = value(r, "tandem_reward_model_queue_seconds_bucket", model=MODEL, lane=lane, le="+Inf")
        assert le_inf == successes


@pytest.mark.slow
def test_scheduler_exports_mps_decisions_and_assignments(stack):
    _, _, m = stack
    s = m["scheduler"]
    assert value(s, "tandem_scheduler_mps_active") == 0  # no GPU, no MPS daemon here
    assert value(s, "tandem_scheduler_decisions_total") >= 1
    assert value(s, "tandem_scheduler_services") == 2
    instances = {x.labels.get("service_instance") for x in s["tandem_scheduler_stream_priority"].samples}
    assert len(instances) == 2 and None not in instances


@pytest.mark.slow
def test_services_hold_their_lease(stack):
    _, _, m = stack
    for name in ("reward", "search"):
        assert value(m[name], "tandem_scheduler_client_lease_held") == 1
        assert value(m[name], "tandem_scheduler_client_leases_lost_total") == 0


@pytest.mark.slow
def test_search_and_frame_latency_families(stack):
    _, _, m = stack
    assert value(m["search"], "tandem_rpc_latency_seconds_count", method="/tandem.v1.SearchService/Search",
                 code="OK") >= 5
    steps = {x.labels["step"] for x in m["search"]["tandem_search_step_seconds"].samples}
    assert steps


@pytest.mark.slow
def test_names_follow_prometheus_conventions_and_leave_instance_alone(stack):
    _, _, m = stack
    for server, families in m.items():
        for name, family in families.items():
            if not name.startswith("tandem_") or name.endswith("_created"):  # _created: a series' start time
                continue
            labels = {k for s in family.samples for k in s.labels}
            assert not labels & {"instance", "job"}, f"{server}: {name} uses a label Prometheus sets: {labels}"
            if family.type == "counter":
                assert {s.name for s in family.samples} <= {f"{name}_total", f"{name}_created"}, name
            if re.search(r"latency|duration|_time|_ms$|_us$", name):
                assert name.endswith("_seconds"), f"{server}: {name}: times are in seconds"
            assert not name.endswith("_percent"), f"{server}: {name}: ratios are 0-1 (_ratio)"
            if name.endswith("_ratio") and family.type == "gauge":
                assert all(0 <= s.value <= 1 for s in family.samples), name


# ================================================================ the monitoring files

def exprs_of_dashboard() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


@cache
def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def parse_promql(expr: str):
    import promql_parser

    return promql_parser.parse(expr.replace("$__rate_interval", "1m"))  # Grafana's variable -> a real range


@pytest.mark.slow
@pytest.mark.parametrize("where, expr", [("dashboard", e) for e in exprs_of_dashboard()]
                         + [("alerts", r["expr"]) for r in alert_rules()])
def test_every_expression_parses_and_names_exported_metrics(stack, where, expr):
    parse_promql(expr)  # raises on a syntax error
    _, _, m = stack
    families = {name: f for server in m.values() for name, f in server.items()}
    for metric in set(re.findall(r"\btandem_[a-z0-9_]+", expr)):
        family = re.sub(r"_(total|bucket|sum|count)$", "", metric)
        if family in GPU_ONLY:
            continue
        assert family in families, f"{where}: {metric} is exported by no server"
        labels = {k for s in families[family].samples for k in s.labels} | {"job", "instance"}
        for group in re.findall(r"by \(([^)]*)\)", expr):
            used = {x.strip() for x in group.split(",")} - {"le"}
            if metric in re.findall(r"\btandem_[a-z0-9_]+", expr[expr.index(group):]):
                assert used <= labels, f"{where}: {metric} has no label(s) {used - labels}"


def test_promql_checker_rejects_a_planted_mistake():
    import promql_parser  # noqa: F401

    with pytest.raises(Exception):
        parse_promql("histogram_quantile(0.99, sum by (le) (rate(tandem_rpc_latency_seconds_bucket[5m]))")


def test_dashboard_shows_what_operators_need():
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for wanted in ("frame latency", "search latency", "reward latency", "queue", "gpu memory", "gpu utilisation",
                   "scheduler decisions", "deadline left as searches join"):
        assert wanted in titles, f"no panel for {wanted}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"]
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {uid}
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_alert_rules_cover_the_conditions_and_match_the_operator_copy():
    names = {r["alert"] for r in alert_rules()}
    assert names == {"TandemFrameP99OverBudget", "TandemMpsInactive", "TandemLeaseLost", "TandemSearchesArriveSpent"}
    for r in alert_rules():
        assert re.fullmatch(r"\d+[smh]", r["for"]) and r["labels"]["severity"] and r["annotations"]["summary"]
    operator = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert operator["spec"] == yaml.safe_load(ALERTS.read_text())


def operator_problems(doc: dict) -> str | None:
    """None when ``doc`` is a valid PodMonitor or PrometheusRule: it
    validates against the operator's models and loses no field on the way
    (pydantic would drop an unknown, e.g. misspelt, field silently)."""
    from cloudcoil.models.prometheus_operator import v1

    kind = {"PodMonitor": v1.PodMonitor, "PrometheusRule": v1.PrometheusRule}.get(doc.get("kind"))
    if kind is None:
        return f"unknown kind {doc.get('kind')!r}"
    try:
        model = kind.model_validate(doc)
    except pydantic.ValidationError as exc:
        return str(exc)
    back = model.model_dump(by_alias=True, exclude_none=True, mode="json")
    return None if back == doc else f"fields lost or changed: {json.dumps(back)} != {json.dumps(doc)}"


@pytest.mark.parametrize("path", [PODMONITOR, PROMETHEUS_RULE], ids=lambda p: p.name)
def test_operator_objects_are_valid(path):
    assert operator_problems(yaml.safe_load(path.read_text())) is None


@pytest.mark.parametrize("path, old, new", [
    (PODMONITOR, "podMetricsEndpoints:", "podMetricEndpoints:"),
    (PODMONITOR, "interval: 5s", "interval: [5]"),
    (PROMETHEUS_RULE, "alert: TandemMpsInactive", "alrt: TandemMpsInactive"),
    (PROMETHEUS_RULE, "kind: PrometheusRule", "kind: PrometheusRules"),
])
def test_operator_validation_rejects_planted_mistakes(path, old, new):
    text = path.read_text()
    assert old in text
    assert operator_problems(yaml.safe_load(text.replace(old, new, 1))) is not None


def test_kustomization_and_podmonitor_match_the_deployment():
    k = yaml.safe_load((K8S / "monitoring" / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == sorted(p.name for p in (K8S / "monitoring").glob("*.yaml")
                                            if p.name != "kustomization.yaml")
    deployment = next(d for d in yaml.safe_load_all((K8S / "deployment.yaml").read_text()) if d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for c in spec["containers"] + spec["initContainers"] for p in c["ports"]}
    podmonitor = yaml.safe_load(PODMONITOR.read_text())
    scraped = {ports[e["port"]] for e in podmonitor["spec"]["podMetricsEndpoints"]}
    cfg = load_config(REPO_ROOT / "deploy" / "config" / "tandem.container.yaml")
    assert scraped == {cfg.scheduler.metrics_port, cfg.reward.metrics_port, cfg.search.metrics_port}
    selector = podmonitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_prometheus_config_scrapes_the_three_servers_and_loads_the_rules():
    prom = yaml.safe_load(PROMETHEUS.read_text())
    cfg = load_config(REPO_ROOT / "deploy" / "config" / "tandem.container.yaml")
    targets = {t for job in prom["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    # reward and search share the scheduler's network namespace in compose.
    assert targets == {f"scheduler:{getattr(cfg, n).metrics_port}" for n in ("scheduler", "reward", "search")}
    assert prom["rule_files"] == ["/etc/prometheus/alerts.yml"]


def test_compose_monitoring_profile_mounts_the_files():
    sys.path.insert(0, str(Path(__file__).parent))
    from test_deploy import compose_model

    services = compose_model()["services"]
    mounts = {}
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        mounts[name] = {v["target"]: Path(v["source"]).resolve() for v in services[name]["volumes"]}
    assert mounts["prometheus"]["/etc/prometheus/prometheus.yml"] == PROMETHEUS.resolve()
    assert mounts["prometheus"]["/etc/prometheus/alerts.yml"] == ALERTS.resolve()
    assert mounts["grafana"]["/var/lib/grafana/dashboards"] == DASHBOARD.parent.resolve()
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/tandem.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
