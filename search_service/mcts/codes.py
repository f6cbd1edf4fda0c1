"""The codes of a search tree: an edge's child, and a node's known result.

Edge child codes: ``>= 0`` child node index, ``UNEXPANDED`` (-1) a legal move
whose child is not in the tree, ``ILLEGAL`` (-2) a move that may not be played.

Node result codes (``Tree.node_terminal``), for the side to move at the node:
``NOT_TERMINAL``; a finished position lost (``TERMINAL_LOSS``) or drawn
(``TERMINAL_DRAW``); or a result known exactly: proven by the solver
(MCTS-Solver, Winands, Bjornsson & Saito 2008, "Monte-Carlo Tree Search
Solver": ``PROVEN_WIN``, ``PROVEN_LOSS``, ``PROVEN_DRAW``), or a finished
position the side to move has won (``PROVEN_WIN``; Othello's last move may
leave the side to move ahead).
"""
from __future__ import annotations

import numpy as np

from search_service.games import connect4

UNEXPANDED = -1
ILLEGAL = -2
NOT_TERMINAL, TERMINAL_LOSS, TERMINAL_DRAW = 0, 1, 2
PROVEN_WIN, PROVEN_LOSS, PROVEN_DRAW = 3, 4, 5
OUTCOME_VALUE = np.array([0.0, -1.0, 0.0, 1.0, -1.0, 0.0], np.float32)  # by code; the value of a known result
LOST = (TERMINAL_LOSS, PROVEN_LOSS)  # codes of a node whose side to move has lost


def connect4_terminal_code(current: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """int8 [...]: NOT_TERMINAL, TERMINAL_LOSS or TERMINAL_DRAW for Connect
    Four positions (current, mask), uint64 [...] each."""
    lost = connect4.has_four(current ^ mask)
    full = mask == connect4.BOARD_MASK
    return np.where(lost, TERMINAL_LOSS, np.where(full, TERMINAL_DRAW, NOT_TERMINAL)).astype(np.int8)
