"""The answer kernels of the device waves (search_service/cuda/kernels/search.cu):
``mcts_vm_answer``'s EVAL rows, built from a model's outputs on the device,
equal the host way's (the softmax of evaluators.values_and_priors, then
mcts.backend.model_answer), on random rows and on the edge cases: NaN and
infinite logits and values, a row with no legal move, known results, proven
trees, slots past the wave; ``init_trees`` writes the fresh roots' OBS rows
and ``mcts_vm_root_priors`` gives them the host way's priors. Marked ``gpu``.

    pytest -m gpu tests/search/test_device_answer_gpu.py
"""
from __future__ import annotations

import numpy as np
import pytest

from search_service.cuda import abi
from search_service.evaluators import values_and_priors
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
        host_values, host_priors = values_and_priors({"value": values.reshape(n, 1), "policy_logits": logits})
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


def test_fresh_roots_get_their_obs_rows_and_the_host_ways_priors():
    """init_trees with an OBS buffer writes each fresh root's observation at
    its tree's row (connect4.observation's encoding); mcts_vm_root_priors then
    sets the fresh roots' edge priors to the host way's, from the logits of
    those rows. A kept tree's row and root are left alone."""
    cp = cupy_module()
    if cp is None:
        pytest.skip("CuPy sees no GPU")
    from search_service.cuda.module import kernel
    from search_service.games import connect4

    roots = connect4.stack([connect4.parse_moves(m) for m in ("", "4453", "444444", "1")])
    b, cap = len(roots.current), 4
    fresh = np.array([1, 1, 1, 0], np.uint32)  # tree 3 stands for a kept tree
    init = np.zeros(b, abi.INIT.dtype)
    init["current"], init["mask"], init["nodes"], init["fresh"], init["root_visits"] = (
        roots.current, roots.mask, 1, fresh, 1)
    init_dev = cp.asarray(init.view(np.uint32))
    pool = cp.zeros((b, cap * abi.NODE_BYTES), np.uint8)
    pool[3] = 0x55  # the kept tree's bytes
    obs = cp.full((b, abi.OBS.words), 9, np.uint8)
    kernel("init_trees")(
        (1,), (128,),
        (pool, np.int64(cap), np.int32(b), init_dev, cp.zeros(b * abi.TREE_STATE.words, np.int32),
         cp.zeros(b * abi.CYCLES.words, np.uint64), cp.zeros(1, np.uint64), obs),
    )
    got_obs = obs.get()
    np.testing.assert_array_equal(got_obs[:3], connect4.observation(roots).reshape(b, -1)[:3])
    assert (got_obs[3] == 9).all()
    logits = np.random.default_rng(1).normal(0, 3, (b, 7)).astype(np.float32)
    logits[1, 2] = np.nan
    kernel("mcts_vm_root_priors")((1,), (128,), (pool, np.int64(cap), np.int32(b), init_dev, obs, cp.asarray(logits)))
    rows = pool.get()
    priors = rows[:, : abi.ROWS_BYTES].view(np.int32).reshape(b, abi.ROW, 4)[:, : abi.NUM_ACTIONS, 3].view(np.float32)
    with np.errstate(invalid="ignore"):
        values, host = values_and_priors({"value": np.zeros((b, 1), np.float32), "policy_logits": logits})
    _, want = model_answer(values, host, connect4.legal_bits(roots.mask))  # the host way's (_call_model)
    np.testing.assert_allclose(priors[:3], want[:3], rtol=1e-5, atol=1e-7)
    assert priors[2, 3] == 0.0  # column 4 is full
    assert (rows[3] == 0x55).all()
