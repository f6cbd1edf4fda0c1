"""The bundled Gomoku plug-in folder (game.yaml and rules.py).

This file only makes the folder a package so that the wheel ships it; the
rules are loaded by path like any other game folder
(:func:`search_service.games.plugin.load_game`), never imported from here.
"""
