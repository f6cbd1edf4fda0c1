"""The in-place rewrites of search_service/mcts/backend.py ``model_answer``,
search_service/evaluators.py ``values_and_priors`` give the same arrays bit for bit as the formulas they replaced
(kept here as ``old_*``), for random inputs with NaN, infinities, negatives,
huge values, rows with no legal move and rows whose priors sum to 0."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from search_service.evaluators import values_and_priors
from search_service.mcts.backend import model_answer


def old_model_answer(values, priors, legal):
    """model_answer before commit 3b32e78 (the shape checks left out)."""
    values = np.asarray(values, np.float32).reshape(-1)
    values = np.clip(np.nan_to_num(values), -1.0, 1.0)
    if priors is None:
        return values, None
    priors = np.asarray(priors, np.float32)
    p = np.where(legal & np.isfinite(priors), np.maximum(priors, 0), 0)
    total = p.sum(axis=1, keepdims=True)
    uniform = legal / np.maximum(legal.sum(axis=1, keepdims=True), 1)
    return values, np.where(total > 0, p / np.where(total > 0, total, 1), uniform).astype(np.float32)


def old_values_and_priors(outputs):
    """values_and_priors before commit 3b32e78."""
    values = outputs["value"].reshape(-1).astype(np.float32)
    logits = outputs.get("policy_logits")
    if logits is None:
        return values, None
    z = logits - logits.max(axis=1, keepdims=True)
    priors = np.exp(z)
    return values, (priors / priors.sum(axis=1, keepdims=True)).astype(np.float32)


SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, -1.0, 1e-45, 3e38, -3e38, 1.0, 2.0, 0.5]


def floats32(m: int, a: int):
    """float32 [m, a] arrays mixing ordinary values with the special ones."""
    element = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from(SPECIAL))
    return hnp.arrays(np.float32, (m, a), elements=element)


@st.composite
def answers(draw):
    m, a = draw(st.integers(0, 12)), draw(st.integers(1, 9))
    legal = draw(hnp.arrays(np.bool_, (m, a)))
    if m and draw(st.booleans()):
        legal[draw(st.integers(0, m - 1))] = False  # a row with no legal move
    priors = draw(floats32(m, a))
    if m and draw(st.booleans()):
        row = draw(st.integers(0, m - 1))
        priors[row] = np.where(legal[row], draw(st.sampled_from([0.0, -1.0, np.nan, -np.inf])), 5.0)  # sums to 0
    values = draw(hnp.arrays(np.float32, (m,), elements=st.one_of(st.floats(width=32), st.sampled_from(SPECIAL))))
    return values, priors, legal


@pytest.fixture(autouse=True)
def _quiet():
    with np.errstate(all="ignore"):  # NaN and infinities are the point here
        yield


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    assert got.tobytes() == want.tobytes(), (got, want)


@settings(max_examples=600, deadline=None)
@given(answers())
def test_model_answer_equals_the_old_formulas_bit_for_bit(case):
    values, priors, legal = case
    before = priors.copy(), values.copy()
    got_v, got_p = model_answer(values, priors, legal)
    want_v, want_p = old_model_answer(values, priors, legal)
    same_bits(got_v, want_v)
    same_bits(got_p, want_p)
    assert priors.tobytes() == before[0].tobytes() and values.tobytes() == before[1].tobytes()  # inputs untouched
    got_v, none = model_answer(values, None, legal)
    assert none is None
    same_bits(got_v, want_v)


@pytest.mark.parametrize("a", [1, 2, 3, 7, 64, 1000])
def test_the_uniform_fallback_equals_the_old_one_for_every_count_of_legal_moves(a):
    """Every count 1..a of legal moves in a row whose priors are all 0: the old
    formula divided in float64, the new one in float32."""
    legal = np.tril(np.ones((a, a), bool))  # row i: i + 1 legal moves
    priors = np.zeros((a, a), np.float32)
    same_bits(model_answer(np.zeros(a), priors, legal)[1], old_model_answer(np.zeros(a), priors, legal)[1])


@settings(max_examples=600, deadline=None)
@given(st.integers(0, 12).flatmap(lambda m: st.tuples(floats32(m, 7), floats32(m, 1))))
def test_values_and_priors_equals_the_old_softmax_bit_for_bit(case):
    logits, value = case
    kept = logits.copy()
    got = values_and_priors({"value": value, "policy_logits": logits})
    want = old_values_and_priors({"value": value, "policy_logits": logits})
    same_bits(got[0], want[0])
    same_bits(got[1], want[1])
    assert logits.tobytes() == kept.tobytes()  # the caller's array is not changed in place
    assert values_and_priors({"value": value})[1] is None
