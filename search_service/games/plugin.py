"""Loading a game plug-in: a folder with ``game.yaml`` and ``rules.py``.

:func:`load_game` reads the metadata (:mod:`search_service.games.metadata`),
imports ``rules.py`` from wherever the folder is, checks that it offers the
:class:`~search_service.games.protocol.GameRules` functions, and plays one
move from the starting state to check that the rules agree with the metadata
(dtypes and shapes, the starting state, the notation). A folder that fails
any of this raises :class:`GameError` before anything else uses it.

The bundled games are folders beside this module (``othello/``, ``gomoku/``), loaded the
same way as any other (:func:`bundled_folder`).
"""
from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from search_service.games.metadata import GameError, GameMeta, read_metadata
from search_service.games.protocol import OPENSPIEL, REQUIRED, GameRules
from tandem.paths import package_path

__all__ = ["GameError", "GameMeta", "GamePlugin", "bundled_folder", "load_game", "resolve_folder"]

_BUNDLED = package_path("search_service", "games")  # the bundled game folders beside this module
_NAME_OK = re.compile(r"[A-Za-z0-9_]+")  # a plain folder name: no path tricks through bundled_folder
_SERIAL = itertools.count()  # a fresh module name per load: loading a folder again re-reads its rules.py


@dataclass(frozen=True)
class GamePlugin:
    """A loaded game: its metadata and its NumPy rules (the imported rules.py)."""

    meta: GameMeta
    rules: GameRules

    @property
    def name(self) -> str:
        return self.meta.name


def bundled_folder(name: str) -> Path:
    """The folder of a game bundled with tandem (``"othello"``).

    Raises:
        GameError: no bundled game has that name.
    """
    folder = _BUNDLED / name
    if not (_NAME_OK.fullmatch(name) and (folder / "game.yaml").is_file()):
        known = sorted(p.parent.name for p in _BUNDLED.glob("*/game.yaml"))
        raise GameError(repr(name), f"no bundled game of that name; bundled: {', '.join(known)}")
    return folder


def resolve_folder(name_or_folder: str | Path) -> Path:
    """``name_or_folder`` as a game folder: an existing folder as given, else
    the bundled game of that name.

    Raises:
        GameError: neither a folder nor a bundled game.
    """
    path = Path(name_or_folder)
    if path.is_dir() or len(path.parts) != 1:
        return path
    return bundled_folder(str(name_or_folder))


def load_game(folder: str | Path) -> GamePlugin:
    """The game plug-in in ``folder``.

    Raises:
        GameError: the folder, game.yaml or rules.py is missing; the metadata
            is malformed (:func:`~search_service.games.metadata.read_metadata`);
            rules.py raises on import or lacks a protocol function; or the
            rules disagree with the metadata (a function raising, or returning
            the wrong dtype or shape, on the starting state and one move).
    """
    meta = read_metadata(Path(folder))
    rules = _import_rules(meta)
    needed = REQUIRED + (OPENSPIEL if meta.openspiel else ())
    missing = [f for f in needed if not callable(getattr(rules, f, None))]
    if missing:
        del sys.modules[rules.__name__]
        raise GameError(meta.label, f"rules.py lacks the function(s) {', '.join(missing)}")
    try:
        _check_rules(meta, rules)
    except GameError:
        del sys.modules[rules.__name__]  # a plug-in that failed leaves nothing behind
        raise
    return GamePlugin(meta, rules)  # type: ignore[arg-type]  (a module is the rules object)


def _import_rules(meta: GameMeta) -> ModuleType:
    path = meta.folder / "rules.py"
    if not path.is_file():
        raise GameError(meta.label, "the folder has no rules.py")
    # Imported by path under a name of its own: folders anywhere, two games'
    # rules.py never collide, and nothing needs to be on sys.path.
    name = f"_tandem_game_{re.sub(r'[^A-Za-z0-9_]', '_', meta.name)}_{next(_SERIAL)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a class's module up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise GameError(meta.label, f"rules.py raised on import: {type(e).__name__}: {e}") from e
    return module


def _check_rules(meta: GameMeta, rules: Any) -> None:
    """Runs every protocol function on the starting state and after its first
    legal move; GameError on an exception or a result of the wrong kind."""
    w, a = meta.state_words, meta.num_actions

    def call(fn: str, *args):
        try:
            return getattr(rules, fn)(*args)
        except Exception as e:
            raise GameError(meta.label, f"rules.{fn} raised {type(e).__name__}: {e}") from e

    def expect(what: str, value: Any, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        want = f"{np.dtype(dtype).name} {list(shape)}"
        if not isinstance(value, np.ndarray):
            raise GameError(meta.label, f"{what} returned {type(value).__name__}, expected an array {want}")
        if value.dtype != dtype or value.shape != shape:
            why = "game.yaml and rules.py disagree" if value.dtype == dtype else "the protocol's dtype"
            raise GameError(meta.label, f"{what} returned {value.dtype.name} {list(value.shape)}, expected {want} "
                                        f"({why})")
        return value

    one = expect("initial(1)", call("initial", 1), np.uint64, (1, w))
    states = expect("initial(2)", call("initial", 2), np.uint64, (2, w))
    if not (states == one).all():
        raise GameError(meta.label, "initial(2) holds states other than initial(1)'s")
    legal = expect("legal_mask", call("legal_mask", states), np.bool_, (2, a))
    if not legal[0].any():
        raise GameError(meta.label, "the starting state has no legal action")
    if expect("is_terminal", call("is_terminal", states), np.bool_, (2,)).any():
        raise GameError(meta.label, "is_terminal says the starting state is over")
    expect("returns", call("returns", states), np.float32, (2,))
    if (expect("to_play", call("to_play", states), np.int8, (2,)) != 0).any():
        raise GameError(meta.label, "to_play of the starting state is not player 0")
    expect("observation", call("observation", states), np.uint8, (2, *meta.observation))

    action = int(np.flatnonzero(legal[0])[0])
    nxt, terminal, reward = _triple(meta, call("step", states, np.full(2, action, np.int64)))
    expect("step's next states", nxt, np.uint64, (2, w))
    expect("step's terminal", terminal, np.bool_, (2,))
    expect("step's reward", reward, np.float32, (2,))

    if not (expect('parse_moves("")', call("parse_moves", ""), np.uint64, (1, w)) == one).all():
        raise GameError(meta.label, 'parse_moves("") is not the starting state')
    text = _text(meta, "move_to_text", call("move_to_text", action))
    if _text(meta, "moves_to_text", call("moves_to_text", [action])) != text:
        raise GameError(meta.label, f"moves_to_text([{action}]) differs from move_to_text({action}) = {text!r}")
    if not (expect(f"parse_moves({text!r})", call("parse_moves", text), np.uint64, (1, w)) == nxt[:1]).all():
        raise GameError(meta.label, f"parse_moves({text!r}) is not the state after action {action}")
    if meta.openspiel and not isinstance(call("to_openspiel_action", action), (int, np.integer)):
        raise GameError(meta.label, "to_openspiel_action does not return an integer")


def _triple(meta: GameMeta, value: Any) -> tuple[Any, Any, Any]:
    if not (isinstance(value, tuple) and len(value) == 3):
        raise GameError(meta.label, f"step returned {type(value).__name__}, expected (next, terminal, reward)")
    return value


def _text(meta: GameMeta, fn: str, value: Any) -> str:
    if not isinstance(value, str):
        raise GameError(meta.label, f"{fn} returned {type(value).__name__}, expected str")
    return value
