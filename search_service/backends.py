"""Choosing the search backend: the CUDA kernels where CuPy sees a GPU and they
are built in, else the NumPy CPU reference (what CI runs); and, per game, the
backend that searches it (:class:`GameBackends`: the CUDA backend searches
Connect Four and every game folder with a ``rules.cu`` that compiles; the
other games go to the CPU reference)."""
from __future__ import annotations

import importlib.util
import logging
import threading

from search_service.games.metadata import GameError
from search_service.mcts.games import ConnectFourSearch, SearchGame
from tandem.gpu import cuda_device_count, host_fact

log = logging.getLogger(__name__)

CUDA_MODULE = "search_service.cuda"


def cuda_available() -> str | None:
    """None if the CUDA backend can run here, else the reason it cannot."""
    if importlib.util.find_spec(CUDA_MODULE) is None:
        return "this build has no CUDA search backend"
    if cuda_device_count() == 0:  # before CuPy: on a CPU host, installing CuPy is no fix
        return "no CUDA GPU is visible"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'tandem[gpu]')"
    return None


def make_backend(choice: str, rollout_slice_ms: float | None = None, **cuda_options):
    """A SearchBackend for ``choice`` ("auto", "cpu" or "cuda"), its rollout
    waves in a batch of trees sliced by ``rollout_slice_ms`` (None: not); the
    CUDA backend also gets ``cuda_options`` (``CudaBackend``'s arguments; the
    CPU reference takes no others: it runs a tree's wave in order always).

    Raises:
        RuntimeError: "cuda" was asked for and cannot run here (the reason is given).
    """
    if choice in ("auto", "cuda"):
        reason = cuda_available()
        if reason is None:
            return importlib.import_module(CUDA_MODULE).CudaBackend(rollout_slice_ms=rollout_slice_ms, **cuda_options)
        if choice == "cuda":
            raise RuntimeError(f"search.backend is 'cuda' but {reason}")
        host_fact(log)("search backend: CPU reference (%s)", reason)
    from search_service.mcts.cpu_reference import CpuReferenceBackend

    return CpuReferenceBackend(rollout_slice_ms)


def cuda_serves(game: SearchGame) -> str | None:
    """None where the CUDA backend searches ``game``, else why not: Connect
    Four's kernels are built in; a game folder's are its ``rules.cu``
    compiled with tandem's kernels (:func:`search_service.cuda.game_module.device_module`,
    once per process), so a folder without rules.cu, or whose rules.cu does
    not compile, is searched by the CPU reference (the reason, naming the
    game and the cause, is logged once and said by ``ListGames``' backend_note)."""
    if isinstance(game, ConnectFourSearch):
        return None
    plugin = getattr(game, "plugin", None)
    if plugin is None:
        return f"game {game.name} has no device rules"
    with _serves_lock:
        key = (plugin.meta.folder, plugin.meta.name)
        if key not in _serves:
            import search_service.cuda.game_module as game_module  # the module, not the package (its __init__ reaches cuda.backend)

            if not game_module.has_device_rules(plugin.meta):
                why = (f"game {plugin.meta.label}: the folder has no {game_module.RULES_FILE}, "
                       "so the CPU reference searches it")
            elif (reason := cuda_available()) is not None:  # no kernels to compile here: not cached
                return f"game {plugin.meta.label}: its {game_module.RULES_FILE} needs the CUDA backend, but {reason}"
            else:
                try:
                    game_module.device_module(plugin.meta)
                    why = None
                except GameError as e:
                    why = f"{e} (the CPU reference searches it)"
                    log.error("search backend: %s", why)
            _serves[key] = why
        return _serves[key]


_serves_lock = threading.Lock()
_serves: dict = {}  # (folder, name) -> cuda_serves' answer; guarded by _serves_lock


class GameBackends:
    """The backend of each game: ``primary`` (:func:`make_backend`'s) where
    it serves the game (its ``serves(game)`` is None), else a CPU reference
    (made on first need, with ``rollout_slice_ms``), which serves every game.
    Thread safe: the CPU reference is made under a lock."""

    def __init__(self, primary, rollout_slice_ms: float | None = None):
        self.primary = primary
        self.rollout_slice_ms = rollout_slice_ms
        self._lock = threading.Lock()
        self._cpu = primary if primary.name == "cpu_reference" else None  # guarded by _lock

    def why_not_primary(self, game: SearchGame) -> str | None:
        """None where the primary backend searches ``game``, else why not."""
        serves = getattr(self.primary, "serves", None)
        return serves(game) if serves is not None else (None if isinstance(game, ConnectFourSearch)
                                                        else f"backend {self.primary.name} serves Connect Four only")

    def for_game(self, game: SearchGame):
        """The backend that searches ``game``."""
        if self.why_not_primary(game) is None:
            return self.primary
        with self._lock:
            if self._cpu is None:
                from search_service.mcts.cpu_reference import CpuReferenceBackend

                self._cpu = CpuReferenceBackend(self.rollout_slice_ms)
            return self._cpu
