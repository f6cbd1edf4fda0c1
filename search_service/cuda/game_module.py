"""A game folder's CUDA module: its ``rules.cu`` compiled with tandem's
kernels, one module per game (issue 42's device half; decision 0010).

The module's source is the header ``game.h`` generated from the folder's
``game.yaml`` (:class:`~.game_abi.GameAbi`), ``common.cu`` and
``philox.cu``, the folder's ``rules.cu``, ``wide.cu`` (the rules as the
search's game module, with nodes of any width), then the search kernels
(``select.cu`` ... ``reroot.cu``) and ``playout.cu``: the kernels Connect
Four's module holds (:mod:`.module`), with the game's sizes as compile-time
constants and without the value model's kernels. Compiled by CuPy's
``RawModule`` (NVRTC, the current device's architecture) when the game is
loaded for the GPU (:func:`device_module`), so a ``rules.cu`` that does not
compile stops that game's load with a :class:`GameError` naming it, and
other games keep serving.

Importing this module needs no CuPy; compiling does.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

from search_service.cuda.game_abi import GameAbi
from search_service.cuda.module import KERNEL_DIR, OPTIONS, assemble
from search_service.games.metadata import GameError, GameMeta

RULES_FILE = "rules.cu"  # a game folder's device rules
HEADER_NAME = "game.h"
BEFORE_RULES = ("common.cu", "philox.cu")
AFTER_RULES = ("wide.cu", "select.cu", "expand.cu", "backup.cu", "search.cu", "reroot.cu", "playout.cu")
KERNELS = ("init_trees", "mcts_rollout_global", "mcts_rollout_aggregated", "finish_trees", "reroot_bfs",
           "reroot_copy", "game_playouts")  # a game module's extern "C" kernels


def has_device_rules(meta: GameMeta) -> bool:
    """Whether the game folder holds ``rules.cu``."""
    return (meta.folder / RULES_FILE).is_file()


def source(meta: GameMeta, rules: str | None = None) -> str:
    """The module's whole source (what NVRTC compiles) for game ``meta``,
    with ``rules`` as its rules.cu (None: the folder's).

    Raises:
        GameError: no rules.cu in the folder, or an action count over the kernels' limit.
    """
    game = GameAbi.of(meta)
    if rules is None:
        path = meta.folder / RULES_FILE
        if not path.is_file():
            raise GameError(meta.label, f"the folder has no {RULES_FILE} (its searches run on the CPU reference)")
        rules = path.read_text()
    parts = [(HEADER_NAME, game.header())]
    parts += [(name, (KERNEL_DIR / name).read_text()) for name in BEFORE_RULES]
    parts += [(f"{meta.name}/{RULES_FILE}", rules)]
    parts += [(name, (KERNEL_DIR / name).read_text()) for name in AFTER_RULES]
    return assemble(parts)


@dataclass
class GameModule:
    """One game's compiled kernels (:func:`device_module`): ``abi`` its
    sizes, :meth:`kernel` its functions."""

    meta: GameMeta
    abi: GameAbi
    module: object  # cupy.RawModule
    _kernels: dict = field(default_factory=dict)

    def kernel(self, name: str):
        """The compiled kernel ``name`` (a cupy.RawKernel)."""
        fn = self._kernels.get(name)
        if fn is None:
            fn = self._kernels[name] = self.module.get_function(name)
        return fn


_lock = threading.Lock()
_modules: dict[tuple[Path, str], GameModule] = {}  # (folder, sha256 of the source) -> module; guarded by _lock


def device_module(meta: GameMeta) -> GameModule:
    """The game's compiled module, built once per process and source (the
    folder's rules.cu changing makes a new one).

    Raises:
        GameError: no rules.cu, an action count over the limit, or NVRTC
            rejects the source (the message holds the compiler's log, whose
            file names say where: ``NAME/rules.cu`` is the folder's).
    """
    text = source(meta)
    key = (meta.folder, hashlib.sha256(text.encode()).hexdigest())
    with _lock:
        found = _modules.get(key)
        if found is not None:
            return found
        import cupy

        try:
            module = cupy.RawModule(code=text, options=OPTIONS)
            module.compile()
        except cupy.cuda.compiler.CompileException as e:
            raise GameError(meta.label, f"{RULES_FILE} does not compile with tandem's kernels:\n{e}") from e
        found = _modules[key] = GameModule(meta, GameAbi.of(meta), module)
    return found
