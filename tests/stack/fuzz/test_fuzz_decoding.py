"""Fuzzes the request decoding and validation of each service for a bounded
time (``TANDEM_FUZZ_SECONDS``, default 20 s across all targets): every input is
either refused with the documented error naming the field, or accepted and
handled correctly (see ``tests/stack/fuzz/targets.py``). Figures go to
``runs/reliability/fuzz.json``."""
from __future__ import annotations

import pytest

from loadtest.reliability_figures import FuzzFigures, FuzzTargetFigures, save_figures

from . import targets
from .harness import all_targets, run_target, seconds_budget

TARGETS = {t.name: t for t in all_targets()}
_results: dict[str, FuzzTargetFigures] = {}


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield
    if _results:
        save_figures(FuzzFigures(budget_s=seconds_budget(), targets=list(_results.values())))
    targets.fixtures().close()  # the reward service and scheduler servicer the targets used
    targets.fixtures.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz_target(name):
    result = run_target(TARGETS[name], seconds_budget() / len(TARGETS))
    _results[name] = result
    assert result.examples > 0
