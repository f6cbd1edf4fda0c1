"""In-process waves: where a search service finds the reward service of its
own process (co-located mode, stack/colocated.py) and hands it its leaves
with no socket, no gRPC call and no shared-memory region.

Co-located mode offers the reward service's in-process server
(reward_service/in_process.py) under the reward service's gRPC address
(:func:`offer`, stack/colocated.py); a search service whose
``search.handoff`` is ``auto`` asks for that address
(:func:`find`) and, when it is offered in this process, sends its waves
there (search_service/evaluators.py). This module is only the meeting
point: both services import it, neither imports the other (tests/test_layers.py).

What a search calls on the offered server (duck-typed: the reward
service's object is passed, never imported):

* ``server.link(model, max_rows, device) -> link``: one caller's way to
  ``model``, its rows checked as the leaf channel checks them (``max_rows``
  narrowed to what the model takes). Raises
  :class:`tandem.leaf_channel.LeafChannelError` (NOT_FOUND: no such model;
  INVALID_ARGUMENT: ``max_rows`` not an integer >= 1; FAILED_PRECONDITION: a
  model whose signature does not fit; UNAVAILABLE: the reward service stopped).
* ``link.evaluate(inputs, deadline) -> {output name: ndarray}``: one host wave
  (``deadline``: a :class:`tandem.deadline.Deadline`, or None).
* ``link.evaluate_device(rows, deadline) -> {output name: CuPy view}``: one
  device wave whose rows ``[0, rows)`` of ``link.inputs`` were written by
  kernels queued on the caller's current CUDA stream; on return that stream
  is made to wait (on the GPU) for the run's outputs: the caller queues its
  next kernels without a host wait.
* ``link.queue_ms``, ``link.compute_ms``, ``link.bucket``: the last wave's
  figures, as a leaf-channel reply gives them.

Why a GPU-side wait is safe here and not across processes
(tandem/cuda_events.py): the event waited for belongs to this process, so
no peer can die with its record pending; a broken context breaks both
services alike.
"""
from __future__ import annotations

import threading

HANDOFF_IN_PROCESS = "in_process"  # the hand-off's name in SearchResponse.handoff and play reports

_lock = threading.Lock()
_offered: dict[str, object] = {}  # reward address -> its in-process server; guarded by _lock


def offer(address: str, server) -> None:
    """Offers ``server`` to searches of this process that call ``address``."""
    with _lock:
        _offered[address] = server


def withdraw(server) -> None:
    """Withdraws ``server`` from every address it is offered under (another
    server offered under one of them since stays)."""
    with _lock:
        for address in [a for a, s in _offered.items() if s is server]:
            del _offered[address]


def find(address: str):
    """The reward service's in-process server offered under ``address`` in
    this process, or None (another process's: the leaf channel or gRPC)."""
    with _lock:
        return _offered.get(address)
