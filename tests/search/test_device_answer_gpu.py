"""The answer kernel of the device waves (``mcts_vm_answer``,
search_service/cuda/kernels/search.cu): the EVAL rows it builds from a
model's outputs on the device equal the host way's (the softmax of
evaluators._values_and_priors, then mcts.backend.model_answer), on random
rows and on the edge cases: NaN and infinite logits and values, a row with
no legal move, known results, proven trees, slots past the wave. Marked ``gpu``.

    pytest -m gpu tests/search/test_device_answer_gpu.py
"""
from __future__ import annotations

import numpy as np
import pytest

from search_service.cuda import abi
from search_service.evaluators import _values_and_priors
from search_service.mcts import tree as tr
from search_service.mcts.backend import model_answer
from tandem.gpu import cupy_module

pytestmark = pytest.mark.gpu

UNTOUCHED = -7.0  # what the EVAL rows hold before the kernel: rows it must not write keep it


def test_the_answer_kernel_builds_the_rows_the_host_way_builds():
    cp = cupy_module()
    if cp is None:
        pytest.skip("CuPy sees no GPU")
    from search_service.cuda.module import kernel

    rng = np.random.default_rng(0)
    k_max, k, n = 64, 60, 128  # two trees of 64 slots; slots 60..63 of each are past the wave
    term = rng.choice([tr.NOT_TERMINAL] * 5 + [tr.TERMINAL_LOSS, tr.TERMINAL_DRAW, tr.PROVEN_WIN, tr.PROVEN_LOSS,
                                               tr.PROVEN_DRAW], n).astype(np.int32)
    term[100:] = abi.NO_SIMULATION  # as if the second tree's root were proven from slot 100 on
    leader = np.arange(n, dtype=np.int32)
    for q in range(1, n):  # every third open slot shares an earlier open slot's leaf
        earlier = np.flatnonzero(term[(q // k_max) * k_max : q] == tr.NOT_TERMINAL)
        if q % 3 == 0 and term[q] == tr.NOT_TERMINAL and earlier.size:
            leader[q] = (q // k_max) * k_max + earlier[0]
    meta = np.stack([np.arange(n), np.full(n, 3), term, leader], axis=1).astype(np.int32)
    obs = rng.integers(0, 2, (n, 2, 6, 7)).astype(np.uint8)
    obs[:, :, -1, :] &= rng.integers(0, 2, (n, 2, 7)).astype(np.uint8)  # empty top cells: legal moves
    obs[1, :, -1, :] = 1  # no legal move at all
    values = (rng.normal(0, 1, n) * 2).astype(np.float32)
    values[2], values[4] = np.nan, np.inf
    logits = rng.normal(0, 3, (n, 7)).astype(np.float32)
    logits[5, 2] = np.nan
    logits[6] = -np.inf
    logits[7, 1] = np.inf
    logits[8, 3] = 80.0  # exp overflows without the max subtracted
    vin = cp.full((n, abi.EVAL.words), UNTOUCHED, np.float32)
    kernel("mcts_vm_answer")(
        ((n + 127) // 128,), (128,),
        (np.int32(n), np.int32(k_max), np.int32(k), cp.asarray(meta), cp.asarray(obs),
         cp.asarray(values.reshape(n, 1)), cp.asarray(logits), vin),
    )
    got = vin.get()
    with np.errstate(invalid="ignore", over="ignore"):
        host_values, host_priors = _values_and_priors({"value": values.reshape(n, 1), "policy_logits": logits})
    top = obs[:, :, -1, :]
    v, p = model_answer(host_values, host_priors, (top[:, 0] | top[:, 1]) == 0)
    checked = 0
    for q in range(n):
        if q % k_max >= k or term[q] == abi.NO_SIMULATION:
            assert (got[q] == UNTOUCHED).all(), q
        elif term[q] != tr.NOT_TERMINAL:
            assert got[q, 0] == tr.OUTCOME_VALUE[term[q]], q
        else:
            assert got[q, 0] == v[leader[q]], q
            if leader[q] == q:
                np.testing.assert_allclose(got[q, 1:], p[q], rtol=1e-5, atol=1e-7, err_msg=str(q))
                checked += 1
            else:
                assert (got[q, 1:] == UNTOUCHED).all(), q
    assert checked > 20


def test_without_a_policy_head_only_the_values_are_written():
    cp = cupy_module()
    if cp is None:
        pytest.skip("CuPy sees no GPU")
    from search_service.cuda.module import kernel

    n = 8
    meta = np.stack([np.arange(n), np.ones(n), np.zeros(n), np.arange(n)], axis=1).astype(np.int32)
    values = np.linspace(-2, 2, n, dtype=np.float32)
    vin = cp.full((n, abi.EVAL.words), UNTOUCHED, np.float32)
    kernel("mcts_vm_answer")(
        ((n + 127) // 128,), (128,),
        (np.int32(n), np.int32(n), np.int32(n), cp.asarray(meta), cp.zeros((n, 84), np.uint8),
         cp.asarray(values.reshape(n, 1)), np.uint64(0), vin),
    )
    got = vin.get()
    np.testing.assert_array_equal(got[:, 0], np.clip(values, -1, 1))
    assert (got[:, 1:] == UNTOUCHED).all()
