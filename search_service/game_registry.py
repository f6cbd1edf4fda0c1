"""The games one search service serves: Connect Four, built in, and every
game folder its config lists (``search.games``).

Each folder loads through :func:`search_service.games.plugin.load_game`
(metadata checked field by field, rules.py imported from wherever the folder
is and checked against it) and is searched through
:class:`~search_service.mcts.games.PluginSearch`, so a folder outside the
repository loads exactly as a bundled one does.
"""
from __future__ import annotations

from typing import Sequence

from search_service.games.plugin import GameError, load_game
from search_service.mcts.games import CONNECT_FOUR, PluginSearch, SearchGame
from tandem.config import resolve_path

CONFIG_KEY = "search.games"


def load_games(folders: Sequence[str], key: str = CONFIG_KEY) -> dict[str, SearchGame]:
    """name -> game: Connect Four, then the game in each of ``folders``
    (config paths: :func:`tandem.config.resolve_path`), in order.

    Raises:
        RuntimeError: a folder does not load (its GameError: the game and the
            cause), or its game's name is taken (Connect Four's, or an earlier
            folder's); one line, naming the config entry (``search.games[1]``),
            the folder and the cause.
    """
    games: dict[str, SearchGame] = {CONNECT_FOUR.name: CONNECT_FOUR}
    where: dict[str, str] = {CONNECT_FOUR.name: "built in"}
    for i, folder in enumerate(folders):
        entry = f"{key}[{i}]"
        try:
            plugin = load_game(resolve_path(folder))
        except GameError as exc:
            raise RuntimeError(f"{entry}: {exc}") from None
        name = plugin.name
        if name in games:
            raise RuntimeError(f"{entry}: game {plugin.meta.label}: the name {name!r} is taken "
                               f"({where[name]}); rename the game in its game.yaml")
        games[name] = PluginSearch(plugin)
        where[name] = entry
    return games
