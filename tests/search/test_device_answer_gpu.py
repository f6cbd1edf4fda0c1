"""The device waves' answer on the GPU (search_service/cuda/kernels/search.cu):
the backup kernel reading a wave's values and priors straight from the
model's outputs (``vm_backup``'s from_outputs) leaves the trees exactly as a
backup of the host way's EVAL rows (the softmax of
evaluators.values_and_priors, then mcts.backend.model_answer) does -- the
priors within float32 rounding -- on real selections with shared leaves,
known results and a proven root, one warp or four per tree, both backups,
and on NaN and infinite logits and values; ``init_trees`` writes the fresh
roots' OBS rows and ``mcts_vm_root_priors`` gives them the host way's
priors. Marked ``gpu``.

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

CAP = 2048  # node slots per tree
ROOTS = ("", "4453", "445566", "2252576253462244111563365343671351441")  # an opening, a win in one, an end game


def _cupy():
    cp = cupy_module()
    if cp is None:
        pytest.skip("CuPy sees no GPU")
    return cp


def _trees_mid_wave(shape: tuple[int, int, int], waves: int, seed: int):
    """The ROOTS' fresh trees after ``waves`` waves backed up from random host
    rows, then one more wave selected, by waves of ``shape`` = (K, k_wave, G)
    (W = ceil(K / G) warps per tree, as CudaBackend.split gives them): (pool,
    tsa, meta, paths, obs) on the device, META as int32 [n, 4]."""
    from search_service.cuda.module import kernel
    from search_service.games import connect4

    cp = _cupy()
    roots = connect4.stack([connect4.parse_moves(m) for m in ROOTS])
    k_max = shape[0]
    b, n = len(ROOTS), len(ROOTS) * k_max
    init = np.zeros(b, abi.INIT.dtype)
    init["current"], init["mask"], init["nodes"], init["fresh"], init["root_visits"] = roots.current, roots.mask, 1, 1, 1
    pool = cp.zeros((b, CAP * abi.NODE_BYTES), np.uint8)
    tsa = cp.zeros(b * abi.TREE_STATE.words, np.int32)
    kernel("init_trees")((1,), (128,), (pool, np.int64(CAP), np.int32(b), cp.asarray(init.view(np.uint32)), tsa,
                                        cp.zeros(b * abi.CYCLES.words, np.uint64), cp.zeros(1, np.uint64),
                                        np.uint64(0)))
    meta, paths = cp.zeros((n, abi.META.words), np.int32), cp.zeros(n * abi.MAX_DEPTH, np.int32)
    obs = cp.zeros((n, abi.OBS.words), np.uint8)
    rng = np.random.default_rng(seed)
    for wave in range(waves + 1):
        kernel("mcts_vm_select")(*_launch(b, shape), (pool, np.int64(CAP), np.int32(CAP), *_sizes(b, shape),
                                                      np.float64(1.5), np.float64(1.0), tsa, meta, paths, obs,
                                                      np.uint64(0)))
        if wave == waves:
            return pool, tsa, meta, paths, obs
        vin = np.zeros(n, abi.EVAL.dtype)
        vin["value"] = rng.integers(-8, 9, n) / 8  # eighths: exact sums in any order (_outputs)
        priors = rng.uniform(0, 1, (n, abi.NUM_ACTIONS)).astype(np.float32)
        vin["priors"] = priors / priors.sum(axis=1, keepdims=True)
        _backup("mcts_vm_backup_aggregated", shape, pool, tsa, meta, paths, cp.asarray(vin.view(np.float32)),
                has_priors=True)


def _sizes(b: int, shape: tuple[int, int, int]) -> tuple:
    """The kernels' (n_trees, W, G, K, k_wave) arguments."""
    k_max, k, g = shape
    return np.int32(b), np.int32(-(-k_max // g)), np.int32(g), np.int32(k_max), np.int32(k)


def _launch(b: int, shape: tuple[int, int, int]) -> tuple:
    """(grid, block) of a wave's kernels: one warp per (tree, warp of the tree)."""
    warps = b * -(-shape[0] // shape[2])
    return ((warps + abi.WARPS_PER_BLOCK - 1) // abi.WARPS_PER_BLOCK,), (32 * abi.WARPS_PER_BLOCK,)


def _backup(name, shape, pool, tsa, meta, paths, vin, has_priors=False, outputs=None, obs=None):
    """Backup kernel ``name`` of a wave of ``shape``: from the host's EVAL rows
    ``vin``, or from ``outputs`` (values, logits or None) on the device."""
    from search_service.cuda.module import kernel

    cp, null = _cupy(), np.uint64(0)
    b = pool.shape[0]
    values, logits = (null if x is None else x for x in outputs or (None, None))
    kernel(name)(*_launch(b, shape), (
        pool, np.int64(CAP), np.int32(CAP), *_sizes(b, shape), tsa, meta, paths,
        cp.zeros(1, np.float32) if vin is None else vin, np.int32(has_priors), np.int32(outputs is not None), values,
        logits, null if obs is None else obs, null))


def _host_rows(meta: np.ndarray, obs: np.ndarray, values: np.ndarray, logits: np.ndarray | None,
               shape: tuple[int, int, int]) -> np.ndarray:
    """The EVAL rows the host way builds from the model's outputs for a wave
    of ``shape`` (CudaBackend's _model_values: each evaluating simulation's
    row through values_and_priors and model_answer, known results' exact values)."""
    n = len(meta)
    term, leader = meta[:, 2], meta[:, 3]
    ran = (np.arange(n) % shape[0] < shape[1]) & (term != abi.NO_SIMULATION)
    open_ = ran & (term == tr.NOT_TERMINAL)
    rows = np.flatnonzero(open_ & (leader == np.arange(n)))
    outputs = {"value": values} if logits is None else {"value": values, "policy_logits": logits}
    with np.errstate(invalid="ignore", over="ignore"):
        host_values, host_priors = values_and_priors({k: v[rows] for k, v in outputs.items()})
    top = obs.reshape(n, 2, 6, 7)[rows, :, -1, :]
    v, p = model_answer(host_values, host_priors, (top[:, 0] | top[:, 1]) == 0)
    vin = np.zeros(n, abi.EVAL.dtype)
    vin["value"] = np.where(ran, tr.OUTCOME_VALUE[np.maximum(term, 0)], 0.0)
    by_slot = np.zeros(n, np.float32)
    by_slot[rows] = v
    vin["value"][open_] = by_slot[leader[open_]]
    if p is not None:
        vin["priors"][rows] = p
    return vin


def _outputs(n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """A model's outputs for n rows, with the edge cases: NaN and infinite
    values and logits, an overflowing logit. The values are eighths in
    [-2, 2]: their sums are exact in float32 in any order, so backups whose
    warps' atomics land in another order still agree bit for bit."""
    values = (rng.integers(-16, 17, (n, 1)) / 8).astype(np.float32)
    values[2], values[4] = np.nan, np.inf
    logits = rng.normal(0, 3, (n, abi.NUM_ACTIONS)).astype(np.float32)
    logits[0::5, 2] = np.nan
    logits[1::7] = -np.inf
    logits[3::11, 1] = np.inf
    logits[5::13, 3] = 80.0  # exp overflows without the max subtracted
    return values, logits


def _prior_words(b: int) -> np.ndarray:
    """bool over a pool's int32 words: the edges' prior words (.w of edge records a < 7)."""
    words = np.zeros((b, CAP * abi.NODE_BYTES // 4), bool)
    rows = words[:, : CAP * abi.ROWS_BYTES // 4].reshape(b, CAP, abi.ROW, 4)
    rows[:, :, : abi.NUM_ACTIONS, 3] = True
    return words


@pytest.mark.parametrize("name, shape, policy", [
    ("mcts_vm_backup_aggregated", (32, 32, 32), True),
    ("mcts_vm_backup_aggregated", (32, 32, 32), False),
    ("mcts_vm_backup_global", (32, 32, 32), True),
    ("mcts_vm_backup_global", (32, 28, 8), False),
    ("mcts_vm_backup_aggregated", (32, 28, 8), False),
])
@pytest.mark.parametrize("waves, seed", [(0, 0), (3, 1), (6, 2)])
def test_the_backup_reading_the_outputs_leaves_the_trees_the_host_rows_leave(waves, seed, name, shape, policy):
    """(K, k_wave, G): one warp per tree, every slot in the wave; or four
    warps per tree of 8 simulations each, the last 4 slots past the wave --
    there without a policy head: two warps may each evaluate one new node
    (racing writers of its priors, which a model answers alike for the same
    position but these random logits do not)."""
    cp = _cupy()
    pool, tsa, meta, paths, obs = _trees_mid_wave(shape, waves, seed)
    host_meta, host_obs = meta.get(), obs.get()
    term, in_wave = host_meta[:, 2], np.arange(len(host_meta)) % shape[0] < shape[1]
    assert (term[in_wave] == tr.NOT_TERMINAL).any()
    values, logits = _outputs(len(term), np.random.default_rng(seed + 10))
    if waves == 0:  # fresh roots: the simulations share a few leaves; rows 2 and 4 (NaN, inf) lead theirs
        assert (host_meta[:, 3] != np.arange(len(term)))[in_wave & (term == tr.NOT_TERMINAL)].any()
        if shape[2] == shape[0]:  # one warp, in order: the first seven take the root's seven edges
            assert (host_meta[[2, 4], 3] == [2, 4]).all() and (term[[2, 4]] == tr.NOT_TERMINAL).all()
    else:  # a known result, or a proven root (the win in one), in the wave
        assert (term[in_wave] != tr.NOT_TERMINAL).any()
    if not policy:
        logits = None
    vin = _host_rows(host_meta, host_obs, values, logits, shape)
    before = pool.get().view(np.int32)
    pool_b, tsa_b = pool.copy(), tsa.copy()
    _backup(name, shape, pool, tsa, meta, paths, None, outputs=(cp.asarray(values), None if logits is None else
                                                                 cp.asarray(logits)), obs=obs)
    _backup(name, shape, pool_b, tsa_b, meta, paths, cp.asarray(vin.view(np.float32)), has_priors=policy)
    np.testing.assert_array_equal(tsa.get(), tsa_b.get())
    a, b = pool.get().view(np.int32), pool_b.get().view(np.int32)
    priors = _prior_words(len(ROOTS))
    assert not ((a != b) & ~priors).any()  # values, visits, virtual losses, solver codes: bit for bit
    np.testing.assert_allclose(a[priors].view(np.float32), b[priors].view(np.float32), rtol=1e-5, atol=1e-7)
    assert (a[priors] != before[priors]).any() == policy  # priors written with a policy head, else none


def test_fresh_roots_get_their_obs_rows_and_the_host_ways_priors():
    """init_trees with an OBS buffer writes each fresh root's observation at
    its tree's row (connect4.observation's encoding); mcts_vm_root_priors then
    sets the fresh roots' edge priors to the host way's, from the logits of
    those rows. A kept tree's row and root are left alone."""
    cp = _cupy()
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
    _, want = model_answer(values, host, connect4.legal_bits(roots.mask))  # the host way's (answers.call_model)
    np.testing.assert_allclose(priors[:3], want[:3], rtol=1e-5, atol=1e-7)
    assert priors[2, 3] == 0.0  # column 4 is full
    assert (rows[3] == 0x55).all()
