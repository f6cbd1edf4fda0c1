"""Wave timeline: named instants on both sides of the leaf channel, to see
where a neural search's time goes between the search and the reward service.

With ``TANDEM_TIMELINE`` set to a folder when this module is first imported
(a benchmark sets it before it starts the services' processes), :func:`mark`
appends (``time.perf_counter_ns()``, name) to a list of this process;
:func:`take` hands the list over, :func:`dump` writes it to
``<folder>/timeline-<pid>.json`` (a child process's, for its parent to
read). Unset, :func:`mark` is a call and one test (~50 ns) and nothing is
kept. ``perf_counter_ns`` is CLOCK_MONOTONIC on Linux, one clock for every
process of a host, so the marks of the two services interleave into one
timeline (bench/neural_search.py ``--timeline``: the median time between
consecutive marks).

The marks (docs/benchmarks.md, "Where a wave's time goes"):

* search service: ``search.start`` (a CUDA search call), ``search.allocated``,
  ``search.initialised`` (init_trees launched), ``wave.select`` (a wave
  begins: its selection is launched next), ``wave.staged`` (its META rows on the host),
  ``wave.backed_up`` (its backup launched), ``search.finish``,
  ``search.results`` (the RES rows on the host), ``search.end``; the leaf
  channel's client: ``wave.sent``, ``wave.answered``;
* reward service: ``channel.received`` (the connection's thread has the
  message), ``channel.leased`` (its regions held and checked),
  ``channel.submitted`` (to the critical lane), ``batch.taken`` (by the
  lane's worker), ``batch.copied`` (inputs copied into the bound buffers),
  ``batch.launched`` (ONNX Runtime's run returned: the graph is queued),
  ``batch.synced`` (the outputs are in place), ``channel.replied`` (the
  worker sent the reply).

For benchmarks: the list grows with every mark until taken, so a long-lived
service should not run with it. Not thread-safe beyond what ``list.append``
is (atomic in CPython); a benchmark reads the list once the work is done.
"""
from __future__ import annotations

import json
import os
import time

FOLDER = os.environ.get("TANDEM_TIMELINE", "")
ENABLED = bool(FOLDER)
_marks: list[tuple[int, str]] = []
_now = time.perf_counter_ns


def enable(folder: str) -> None:
    """Turns the timeline on here and, through the environment, in the
    processes started from now on; their :func:`dump` writes into ``folder``."""
    global FOLDER, ENABLED
    os.environ["TANDEM_TIMELINE"] = FOLDER = folder
    ENABLED = True


def mark(name: str) -> None:
    """Records ``name`` at this instant, when the timeline is enabled."""
    if ENABLED:
        _marks.append((_now(), name))


def take() -> list[tuple[int, str]]:
    """This process's marks so far (ns, name), oldest first; the list starts empty again."""
    global _marks
    taken, _marks = _marks, []
    return taken


def dump() -> str | None:
    """Writes this process's marks (as :func:`take` returns them) to
    ``<TANDEM_TIMELINE>/timeline-<pid>.json`` and returns the path; None
    when the timeline is off.

    Raises:
        OSError: the file cannot be written.
    """
    if not ENABLED:
        return None
    path = os.path.join(FOLDER, f"timeline-{os.getpid()}.json")
    with open(path, "w") as fh:
        json.dump(take(), fh)
    return path


def load(path: str) -> list[tuple[int, str]]:
    """The marks :func:`dump` wrote to ``path``."""
    with open(path) as fh:
        return [(int(t), str(n)) for t, n in json.load(fh)]
