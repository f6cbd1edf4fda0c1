"""A game folder's ``game.yaml``: read and checked field by field.

Fields (all required unless marked optional)::

    name: othello              # letters, digits, "_", "-" and "."
    num_actions: 65            # 1 .. 4096, passes included
    state_words: 3             # uint64 words per state
    observation: [2, 8, 8]     # planes, rows, columns
    players: 2                 # two-player games only, for now
    max_moves: 120             # no game lasts longer (plies, passes included)
    openspiel: othello         # optional: the pyspiel game with the same rules
    positions: positions.jsonl # optional: a file in the folder, for `tandem play --game`
    endgames: endgames.jsonl   # optional: a file in the folder, positions labelled with their exact
                               # results (search_service/games/endgames.py), to score moves against

Unknown fields are errors, so a misspelt optional field is not silently ignored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tandem.config import ConfigError, load_yaml

MAX_ACTIONS = 4096
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_REQUIRED = ("name", "num_actions", "state_words", "observation", "players", "max_moves")
_OPTIONAL = ("openspiel", "positions", "endgames")


class GameError(ValueError):
    """A game folder that cannot be used; the message names the game (its
    name, or its folder before the name is known) and the cause."""

    def __init__(self, game: str, cause: str):
        super().__init__(f"game {game}: {cause}")
        self.game = game
        self.cause = cause


@dataclass(frozen=True)
class GameMeta:
    """What ``game.yaml`` declares."""

    name: str
    folder: Path  # the game folder, resolved
    num_actions: int
    state_words: int
    observation: tuple[int, int, int]  # planes, rows, columns
    players: int
    max_moves: int
    openspiel: str | None = None
    positions: Path | None = None  # resolved inside the folder
    endgames: Path | None = None  # resolved inside the folder

    @property
    def label(self) -> str:
        """How error messages name the game: ``'othello' (/path/to/folder)``."""
        return f"{self.name!r} ({self.folder})"


def read_metadata(folder: Path) -> GameMeta:
    """The checked contents of ``folder/game.yaml``.

    Raises:
        GameError: the folder or its game.yaml is missing, game.yaml is not
            read by :func:`tandem.config.load_yaml` (unreadable, over 1 MiB,
            not YAML, aliases, a key given twice, nested too deep: the message
            names the file and the line and key) or is not a mapping, a field
            is missing, unknown, of the wrong type or out of range, or
            ``positions`` names no file in the folder.
    """
    folder = Path(folder).resolve()
    where = str(folder)
    if not folder.is_dir():
        raise GameError(where, "no such game folder")
    path = folder / "game.yaml"
    if not path.exists():
        raise GameError(where, "the folder has no game.yaml")
    try:
        data = load_yaml(path)  # tandem.yaml's checks: size, aliases, keys given twice, depth
    except ConfigError as exc:
        raise GameError(where, str(exc)) from None
    if not isinstance(data, dict):
        raise GameError(where, f"game.yaml must be a mapping of fields, got {type(data).__name__}")

    name = data.get("name")
    if isinstance(name, str) and _NAME.fullmatch(name):
        where = f"{name!r} ({folder})"
    unknown = sorted(str(k) for k in data if k not in _REQUIRED + _OPTIONAL)
    if unknown:
        raise GameError(where, f"game.yaml has unknown field(s) {', '.join(unknown)}; "
                               f"known: {', '.join(_REQUIRED + _OPTIONAL)}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise GameError(where, f"game.yaml lacks field(s) {', '.join(missing)}")

    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise GameError(where, f"field name must be a string of letters, digits, '_', '-' or '.', got {name!r}")
    observation = data["observation"]
    if (not isinstance(observation, list) or len(observation) != 3
            or not all(_is_int(v) and v >= 1 for v in observation)):
        raise GameError(where, f"field observation must be [planes, rows, columns] of positive integers, "
                               f"got {observation!r}")
    players = data["players"]
    if not _is_int(players) or players != 2:
        raise GameError(where, f"field players must be 2 (two-player games only, for now), got {players!r}")
    openspiel = data.get("openspiel")
    if openspiel is not None and (not isinstance(openspiel, str) or not openspiel):
        raise GameError(where, f"field openspiel must be a pyspiel game name, got {openspiel!r}")
    return GameMeta(
        name=name,
        folder=folder,
        num_actions=_int_field(where, data, "num_actions", 1, MAX_ACTIONS),
        state_words=_int_field(where, data, "state_words", 1, None),
        observation=tuple(observation),
        players=players,
        max_moves=_int_field(where, data, "max_moves", 1, None),
        openspiel=openspiel,
        positions=_folder_file(where, folder, "positions", data.get("positions")),
        endgames=_folder_file(where, folder, "endgames", data.get("endgames")),
    )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # YAML's true/false are not counts


def _int_field(where: str, data: dict, key: str, low: int, high: int | None) -> int:
    v = data[key]
    if not _is_int(v):
        raise GameError(where, f"field {key} must be an integer, got {v!r}")
    if v < low or (high is not None and v > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise GameError(where, f"field {key} must be in {span}, got {v}")
    return v


def _folder_file(where: str, folder: Path, key: str, value: object) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise GameError(where, f"field {key} must be a file name, got {value!r}")
    path = (folder / value).resolve()
    if not path.is_relative_to(folder):  # the folder is the plug-in: it must not reach outside itself
        raise GameError(where, f"field {key} ({value}) points outside the game folder")
    if not path.is_file():
        raise GameError(where, f"field {key} names {value}, which is not a file in the game folder")
    return path
