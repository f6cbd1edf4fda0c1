"""Game folders written by the tests: tic-tac-toe (tic_tac_toe_rules.py) and
variants of it, anywhere a test asks (a tmp_path, outside the repository)."""
from __future__ import annotations

from pathlib import Path

import yaml

TIC_TAC_TOE_RULES = (Path(__file__).resolve().parent / "tic_tac_toe_rules.py").read_text()
TIC_TAC_TOE = {
    "name": "tic_tac_toe",
    "num_actions": 9,
    "state_words": 1,
    "observation": [2, 3, 3],
    "players": 2,
    "max_moves": 9,
    "openspiel": "tic_tac_toe",
}


def write_game(folder: Path, rules: str = TIC_TAC_TOE_RULES, drop: tuple[str, ...] = (), **fields) -> Path:
    """``folder`` holding game.yaml (tic-tac-toe's fields, less ``drop``, with
    ``fields`` replacing or adding) and ``rules`` as rules.py; the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in {**TIC_TAC_TOE, **fields}.items() if k not in drop}
    (folder / "game.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    (folder / "rules.py").write_text(rules)
    return folder


def broken(old: str, new: str) -> str:
    """Tic-tac-toe's rules with ``old`` replaced by ``new`` (which must occur once)."""
    assert TIC_TAC_TOE_RULES.count(old) == 1, old
    return TIC_TAC_TOE_RULES.replace(old, new)


HERE = Path(__file__).resolve().parent
PARITY = {  # parity_rules.py: few actions, one state word, every game max_moves long
    "name": "parity",
    "num_actions": 8,
    "state_words": 1,
    "observation": [1, 1, 2],
    "players": 2,
    "max_moves": 4,
}


def write_parity(folder: Path, device_rules: bool = True) -> Path:
    """``folder`` holding the parity game (parity_rules.py, and with
    ``device_rules`` its rules.cu); the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "game.yaml").write_text(yaml.safe_dump(PARITY, sort_keys=False))
    (folder / "rules.py").write_text((HERE / "parity_rules.py").read_text())
    if device_rules:
        (folder / "rules.cu").write_text((HERE / "parity_rules.cu").read_text())
    return folder
