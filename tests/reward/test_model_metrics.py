"""The per-model metrics (reward_service/model_metrics.py) keep each
family's labelled children after their first use: the exported series and
their values are those of ``labels()`` on every call."""
from __future__ import annotations

import uuid

import pytest
from prometheus_client import REGISTRY

from reward_service.model_metrics import ModelMetrics


def sample(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@pytest.fixture
def model() -> str:
    return f"metrics-{uuid.uuid4().hex[:8]}"  # series of their own: the families are the process's


def test_each_record_lands_in_its_series_made_at_start_failures_at_their_first(model):
    m = ModelMetrics([model])
    m.requested(model, "critical")  # not started: nothing recorded, no series made
    assert sample("tandem_reward_model_requests_total", model=model, lane="critical") is None
    m.start()
    assert sample("tandem_reward_model_executions_total", model=model, lane="bulk") == 0  # every lane's, at 0
    assert sample("tandem_reward_model_request_failures_total", model=model, lane="bulk", reason="queue_full") is None
    for _ in range(3):
        m.requested(model, "critical")
    m.requested(model, "bulk")
    m.succeeded(model, "critical", 4, 0.002, 0.001)
    m.succeeded(model, "critical", 2, 0.003, 0.0005)
    m.failed(model, "bulk", "queue_full", 0.001)
    m.executed(model, "critical", 6, 8, 0.004)
    m.executed(model, "critical", 2, 2, 0.001)
    crit, bulk = {"model": model, "lane": "critical"}, {"model": model, "lane": "bulk"}
    assert sample("tandem_reward_model_requests_total", **crit) == 3
    assert sample("tandem_reward_model_requests_total", **bulk) == 1
    assert sample("tandem_reward_model_request_successes_total", **crit) == 2
    assert sample("tandem_reward_model_request_successes_total", **bulk) == 0  # made at start, never recorded
    assert sample("tandem_reward_model_request_failures_total", **bulk, reason="queue_full") == 1
    assert sample("tandem_reward_model_request_failures_total", **bulk, reason="run_failed") is None
    assert sample("tandem_reward_model_queue_seconds_count", **crit) == 2
    assert sample("tandem_reward_model_queue_seconds_sum", **crit) == pytest.approx(0.0015)
    assert sample("tandem_reward_model_executions_total", **crit) == 2
    assert sample("tandem_reward_model_compute_seconds_sum", **crit) == pytest.approx(0.005)
    assert sample("tandem_reward_model_batch_size_sum", **crit) == 8
    assert sample("tandem_reward_model_batch_fill_ratio_sum", **crit) == pytest.approx(6 / 8 + 1)
    t = m.totals(model)
    assert (t.inference_count, t.execution_count, t.success.count, t.fail.count) == (6, 2, 2, 1)
    assert {rows: d.count for rows, d in t.batches.items()} == {6: 1, 2: 1}


def test_two_instances_record_into_the_same_series(model):
    """Each server's ModelMetrics keeps its own children; both are the family's one child per labels."""
    first, second = ModelMetrics([model]), ModelMetrics([model])
    first.start()
    second.start()
    first.requested(model, "bulk")
    second.requested(model, "bulk")
    first.requested(model, "bulk")
    assert sample("tandem_reward_model_requests_total", model=model, lane="bulk") == 3
    assert first.totals(model).inference_count == second.totals(model).inference_count == 0


def test_an_unknown_reason_is_refused(model):
    m = ModelMetrics([model])
    m.start()
    with pytest.raises(ValueError, match="not one of"):
        m.failed(model, "bulk", "bogus", 0.1)
