"""The bundled labelled Connect Four positions (``data/connect4``).

Each record: ``moves`` (1-indexed columns from the empty board), ``score``
(Pons' convention, for the side to move: > 0 win, 0 draw, < 0 loss),
``move_scores`` ({"1".."7": score after that move, None for a full column}) and
``best_moves``. Sources and licences: ``data/README.md``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tandem.paths import bundled

PONS_DIR = bundled("positions")  # package data; data/connect4/pons in the checkout
DEFAULT_SETS = ("Test_L3_R1", "Test_L2_R1")


@dataclass(frozen=True)
class LabelledPosition:
    moves: str
    score: int
    move_scores: dict[int, int | None]  # 0-based column -> solver score of that move
    source: str

    def keeps_result(self, action: int) -> bool:
        """Does 0-based ``action`` keep the solver's result (a win stays a win, a draw a draw)?"""
        s = self.move_scores.get(action)
        return s is not None and (s > 0) == (self.score > 0) and (s >= 0) == (self.score >= 0)

    def is_best(self, action: int) -> bool:
        """Does ``action`` have exactly the solver's best score?"""
        return self.move_scores.get(action) == self.score


def load_set(name_or_path: str) -> list[LabelledPosition]:
    """Loads a JSONL file: a bundled set name (``Test_L3_R1``) or a path.

    Raises:
        FileNotFoundError: no such set or file.
        ValueError: a line is not a labelled position.
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = PONS_DIR / f"{name_or_path}.jsonl"
    out = []
    with path.open() as f:
        for i, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
                scores = {int(k) - 1: v for k, v in rec["move_scores"].items()}
                out.append(LabelledPosition(rec["moves"], int(rec["score"]), scores, f"{path.stem}:{i}"))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: not a labelled position ({exc})") from None
    return out
