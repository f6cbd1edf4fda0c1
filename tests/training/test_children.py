"""The positions one move after a labelled position (training/connect4_data.child_values),
which the training split keeps out of training for every held-out position
(train_connect4_value.split_sources), and the validation openings
(training/validation_openings.py): right labels, no game-over child, and no
held-out position's move scores in the training set."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_data import has_four, replay

from search_service.games import connect4

from training.connect4_data import (
    BENCHMARK_PONS,
    PONS_DIR,
    TRAIN_PONS,
    canonical_keys,
    child_values,
    from_records,
    heldout_mask,
    read_jsonl,
)
from training.connect4_encoding import encode_moves
from training.train_connect4_value import split_sources
from training.validation_openings import SPLIT_SEED, STONES, validation_openings

VALIDATION = Path(__file__).resolve().parents[2] / "data" / "connect4" / "validation" / "openings_05-14.jsonl"


def pons(name: str, rows: slice = slice(None)):
    return from_records(read_jsonl(PONS_DIR / f"{name}.jsonl")[rows])


def test_every_unfinished_child_with_the_negated_move_score():
    """Openings, and end games of 41 stones (whose children fill the board)."""
    end = [r for r in read_jsonl(PONS_DIR / "Test_L3_R1.jsonl") if len(r["moves"]) == 41][:20]
    s = from_records(read_jsonl(PONS_DIR / "Test_L1_R2.jsonl")[:60] + end)
    assert len(end) == 20
    boards, value, parent = child_values(s)
    want = {}
    for i, moves in enumerate(s.moves):
        for c in range(7):
            if not s.legal[i, c]:
                continue
            child = moves + str(c + 1)
            if has_four(replay(child)) or len(child) == 42:
                continue
            want[(i, encode_moves(child).tobytes())] = -np.sign(s.move_scores[i, c])
    got = {(int(p), b.tobytes()): v for p, b, v in zip(parent, boards, value)}
    assert got == want
    assert boards.dtype == np.uint8 and value.dtype == np.float32


def test_a_child_value_is_the_solver_score_of_the_child():
    """Where a child is itself a labelled position (the walks hold some children
    of the Pons openings), its value is the sign of its own solver score."""
    walks = from_records(read_jsonl(VALIDATION.parents[1] / "walks" / "walks_05-11.jsonl.gz"))
    score = dict(zip(canonical_keys(walks.boards), walks.score))
    checked = 0
    for name in TRAIN_PONS:
        boards, value, _ = child_values(pons(name))
        for k, v in zip(canonical_keys(boards), value):
            if k in score:
                assert v == np.sign(score[k])
                checked += 1
    assert checked > 100


def test_a_winning_move_gives_no_child():
    """'445566': columns 3 and 7 win at once; their children are finished games."""
    s = from_records([{"moves": "445566", "score": 18,
                       "move_scores": {"1": -3, "2": -3, "3": 18, "4": -3, "5": -3, "6": -3, "7": 18}}])
    boards, _, _ = child_values(s)
    assert len(boards) == 5
    assert not connect4.is_terminal(connect4.from_observation(boards)).any()


def test_no_training_position_is_a_move_after_a_held_out_one():
    """split_sources drops the children of every held-out position (and of every
    Pons set): their labels are the held-out positions' move scores."""
    walks = VALIDATION.parents[1] / "walks"
    sources = {name: pons(name) for name in (*TRAIN_PONS, *BENCHMARK_PONS)}
    sources["walks"] = from_records(read_jsonl(walks / "walks_05-11.jsonl.gz") + read_jsonl(walks / "walks_12-17.jsonl.gz"))
    train, _, held = split_sources(sources, SPLIT_SEED, ("walks",), ())
    children = set()
    for s in held.values():
        children.update(canonical_keys(child_values(s)[0]))
    train_keys = set(canonical_keys(train.boards))
    assert not children.intersection(train_keys)
    held_walks = held["walks (held-out 10 %)"]
    dropped = len(sources["walks"]) - len(held_walks) - len(train)
    assert dropped > 100  # the walks do hold children of held-out and Pons positions
    assert len(set(canonical_keys(sources["walks"].boards)) & children) >= dropped


@pytest.fixture(scope="module")
def validation():
    return read_jsonl(VALIDATION)


def test_validation_openings_are_held_out_and_not_test_positions(validation):
    s = from_records(validation)
    assert len(s) == 1000
    assert heldout_mask(s.boards, SPLIT_SEED).all()  # the training script's held-out 10 %
    stones = np.array([len(m) for m in s.moves])
    assert ((stones >= STONES[0]) & (stones <= STONES[1])).all()
    assert (s.score >= 0).all() and (s.legal & ~s.good).any(axis=1).all()
    test_keys = set()
    for name in (*TRAIN_PONS, *BENCHMARK_PONS):
        test_keys.update(canonical_keys(pons(name).boards))
    assert not test_keys.intersection(canonical_keys(s.boards))


def test_validation_openings_are_walks_positions(validation):
    walks_dir = VALIDATION.parents[1] / "walks"
    walks = {r["moves"]: r for p in sorted(walks_dir.glob("*.jsonl.gz")) for r in read_jsonl(p)}
    for r in validation:
        assert json.dumps(walks[r["moves"]], sort_keys=True) == json.dumps(r, sort_keys=True)


def test_validation_openings_are_remade_by_their_command(validation):
    """data/README.md's command (default count and seed) gives the shipped file."""
    assert validation_openings(1000, 20261201) == validation
