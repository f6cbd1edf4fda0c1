"""bench/value_search_quality.py --quick: the shipped network in the CPU
reference's search, on the validation openings and the four Pons sets; one
row per set, with the result file's fields."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("onnxruntime")

from bench import value_search_quality as vsq  # noqa: E402


def test_quick_run_writes_one_row_per_set(tmp_path):
    rows = vsq.main(["--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "value_search_quality.json").read_text())
    assert doc["benchmark"] == "value_search_quality" and doc["rows"] == rows
    assert [r["position_set"] for r in rows] == ["openings_05-14", *vsq.PONS]
    for r in rows:
        assert r["model"] == "connect4_value.onnx" and len(r["model_sha256"]) == 16 and r["provider"] == "cpu"
        assert r["positions"] == 8 and r["simulations"] == 50 and r["parallel_sims"] == 32 and r["c_puct"] == 1.5
        assert r["misses"] == round(r["positions"] * (1 - r["optimal_move_rate"])) == len(r["missed"])



def test_cuda_provider_refused_where_onnx_runtime_has_none():
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this ONNX Runtime has the CUDA provider")
    with pytest.raises(RuntimeError, match="no CUDAExecutionProvider"):
        vsq.onnx_evaluator(vsq.MODEL, threads=1, provider="cuda")


@pytest.mark.gpu
def test_cuda_provider_plays_the_cpu_providers_moves(tmp_path):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this ONNX Runtime has no CUDA provider")
    cpu = vsq.main(["--quick", "--out", str(tmp_path / "cpu")])
    cuda = vsq.main(["--quick", "--out", str(tmp_path / "cuda"), "--provider", "cuda"])
    assert [r["provider"] for r in cuda] == ["cuda"] * len(cpu)
    # FP32 on both; a close choice may flip with the last digits, so within one position a set
    assert all(abs(a["misses"] - b["misses"]) <= 1 for a, b in zip(cpu, cuda))


def test_missed_names_the_positions_whose_move_gives_the_result_away():
    from bench.search_quality import missed, played
    from tandem.positions import load_set

    recs = [r for r in load_set("Test_L1_R1") if r.score > 0][:3]
    good = [next(c for c in range(7) if r.keeps_result(c)) for r in recs]
    bad = [next((c for c in range(7) if not r.keeps_result(c)), None) for r in recs]
    assert missed(recs, good) == []
    i = next(i for i, c in enumerate(bad) if c is not None)
    actions = list(good)
    actions[i] = bad[i]
    assert missed(recs, actions) == [recs[i].moves]
    assert played(recs, good) == {} and played(recs, actions) == {recs[i].moves: bad[i] + 1}
