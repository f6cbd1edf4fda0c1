"""Helpers that games' NumPy rules (a folder's ``rules.py``) have in common.

The protocol (:mod:`search_service.games.protocol`) asks every rules module
for the same input checks and the same kinds of error message; these give
them in one wording: the checked states and actions, the bits of uint64
boards, and the replay of a move string with its 1-based character in every
error. The bundled games use them; a game folder elsewhere may import them
too wherever tandem is installed (``from search_service.games import
rules_helpers``).
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

_U64 = np.uint64


def checked_states(states: np.ndarray, words: int) -> np.ndarray:
    """``states`` once it is a batch of states of ``words`` words, uint64 [B, words].

    Raises:
        ValueError: another dtype or shape (both named).
    """
    states = np.asarray(states)
    if states.dtype != _U64 or states.ndim != 2 or states.shape[1] != words:
        raise ValueError(f"states must be uint64 [B, {words}], got {states.dtype} {list(states.shape)}")
    return states


def checked_action(action: int, num_actions: int) -> int:
    """``action`` as an int once it is in ``0 .. num_actions - 1``.

    Raises:
        ValueError: it is not.
    """
    action = int(action)
    if not 0 <= action < num_actions:
        raise ValueError(f"action {action} is outside 0..{num_actions - 1}")
    return action


def checked_actions(actions: np.ndarray, legal: np.ndarray, describe: Callable[[int], str]) -> np.ndarray:
    """int64 [B]: ``actions`` once each is legal in its state.

    ``legal`` is the states' ``legal_mask``, bool [B, A]; ``describe`` gives
    an action's notation for the message (``move_to_text``).

    Raises:
        ValueError: ``actions`` is not integers [B], or an action is outside
            ``0 .. A-1`` or not legal in its state; the message names the
            first such state and its action.
    """
    batch, num_actions = legal.shape
    actions = np.asarray(actions)
    if actions.shape != (batch,) or not np.issubdtype(actions.dtype, np.integer):
        raise ValueError(f"actions must be integers [{batch}], got {actions.dtype} {list(actions.shape)}")
    actions = actions.astype(np.int64)
    outside = (actions < 0) | (actions >= num_actions)
    if outside.any():
        b = int(np.flatnonzero(outside)[0])
        raise ValueError(f"state {b}: action {actions[b]} is outside 0..{num_actions - 1}")
    ok = legal[np.arange(batch), actions]
    if not ok.all():
        b = int(np.flatnonzero(~ok)[0])
        raise ValueError(f"state {b}: action {actions[b]} ({describe(int(actions[b]))}) is not legal there")
    return actions


def popcount(bits: np.ndarray) -> np.ndarray:
    """int32 [...]: the set bits of each uint64 in ``bits`` (uint64 [...])."""
    if hasattr(np, "bitwise_count"):  # NumPy >= 2.0
        return np.bitwise_count(bits).astype(np.int32)
    return unpack_bits(np.asarray(bits, _U64)[..., None], 64).sum(axis=-1, dtype=np.int32)


def unpack_bits(words: np.ndarray, bits: int) -> np.ndarray:
    """bool [..., bits]: the first ``bits`` bits of a board held in uint64
    [..., W] words, bit ``i`` being bit ``i % 64`` of word ``i // 64``
    (``bits`` at most 64 * W)."""
    # Little-endian bytes whatever the machine's order: byte k then holds bits 8k .. 8k+7.
    as_bytes = np.ascontiguousarray(words, dtype="<u8").view(np.uint8)
    return np.unpackbits(as_bytes, axis=-1, count=bits, bitorder="little").view(np.bool_)


def replay(state: np.ndarray, moves: Iterable[tuple[int, str, int]],
           legal_mask: Callable[[np.ndarray], np.ndarray],
           step: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]],
           why_illegal: Callable[[int], str]) -> np.ndarray:
    """uint64 [1, W]: ``state`` (uint64 [1, W]) after ``moves``, each
    ``(1-based character where it starts, its text, its action)``, played in
    turn with the game's ``legal_mask`` and ``step``.

    ``moves`` may be a generator that raises on malformed text: a move is read
    only once those before it have been played, so the first error in the
    string is the one reported.

    Raises:
        ValueError: a move comes after the game ended (no legal action left),
            or is not legal, ``why_illegal(action)`` saying why; the message
            names the move's character.
    """
    for at, text, action in moves:
        legal = legal_mask(state)[0]
        if not legal.any():  # the protocol: no legal action exactly where the game is over
            raise ValueError(f"character {at}: {text} comes after the game ended")
        if not legal[action]:
            raise ValueError(f"character {at}: {text} is not legal there ({why_illegal(action)})")
        state = step(state, np.array([action], np.int64))[0]
    return state
