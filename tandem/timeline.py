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

The marks (`python -m bench.neural_search --timeline` prints them as rows):

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

GPU marks (:func:`gpu_mark`, with ``TANDEM_TIMELINE_GPU=1`` as well): the
instant a CUDA stream reaches a point, as the GPU's ``%globaltimer`` (ns;
one clock for every process on the GPU) written by a one-thread kernel
queued there, so each costs its stream one small kernel (~2 µs). They show
what the hand-off costs the GPU: ``gpu.selected`` (the search's selection,
or init_trees for the roots, is done) → ``gpu.model_start`` (the reward
service's stream starts the wave's copies and run) and ``gpu.model_end``
(its output copies done) → ``gpu.backup`` (the search's stream passed its
wait for them). :func:`take_gpu` and :func:`dump` hand them over apart from
the host marks (another clock).

For benchmarks: the list grows with every mark until taken, so a long-lived
service should not run with it. Not thread-safe beyond what ``list.append``
is (atomic in CPython); a benchmark reads the list once the work is done.
"""
from __future__ import annotations

import itertools
import json
import os
import time

FOLDER = os.environ.get("TANDEM_TIMELINE", "")
ENABLED = bool(FOLDER)
GPU_ENABLED = ENABLED and os.environ.get("TANDEM_TIMELINE_GPU") == "1"
GPU_SLOTS = 1 << 20  # GPU marks kept per process (8 MiB of device memory)
_marks: list[tuple[int, str]] = []
_now = time.perf_counter_ns
_gpu_names: list[tuple[int, str]] = []  # (slot of the device buffer, name) of the GPU marks not yet taken
_gpu: tuple | None = None  # (the stamp kernel, uint64 [GPU_SLOTS] on the device) once a GPU mark was made
_next_slot = itertools.count().__next__  # atomic in CPython: marks from several threads get distinct slots
_STAMP = r"""
extern "C" __global__ void tandem_timeline_stamp(unsigned long long* at, long long slot) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    at[slot] = t;
}
"""


def enable(folder: str, gpu: bool = False) -> None:
    """Turns the timeline on here and, through the environment, in the
    processes started from now on; their :func:`dump` writes into ``folder``.
    ``gpu``: GPU marks too."""
    global FOLDER, ENABLED, GPU_ENABLED
    os.environ["TANDEM_TIMELINE"] = FOLDER = folder
    os.environ["TANDEM_TIMELINE_GPU"] = "1" if gpu else "0"
    ENABLED, GPU_ENABLED = True, gpu


def mark(name: str) -> None:
    """Records ``name`` at this instant, when the timeline is enabled."""
    if ENABLED:
        _marks.append((_now(), name))


def gpu_mark(name: str) -> None:
    """Queues a GPU mark ``name`` on CuPy's current stream (see the module
    docstring), when GPU marks are enabled; past GPU_SLOTS marks, nothing."""
    global _gpu
    if not GPU_ENABLED:
        return
    slot = _next_slot()
    if slot >= GPU_SLOTS:
        return
    import cupy  # noqa: PLC0415 - only where GPU marks are on

    if _gpu is None:
        _gpu = (cupy.RawKernel(_STAMP, "tandem_timeline_stamp"), cupy.zeros(GPU_SLOTS, cupy.uint64))
    kernel, at = _gpu
    kernel((1,), (1,), (at, cupy.int64(slot)))
    _gpu_names.append((slot, name))


def take_gpu() -> list[tuple[int, str]]:
    """This process's GPU marks so far (ns of the GPU's clock, name), oldest
    first, once the device has run them (it is synchronised); the list
    starts empty again."""
    global _gpu_names, _next_slot
    if _gpu is None:
        return []
    import cupy  # noqa: PLC0415

    names, _gpu_names = _gpu_names, []
    cupy.cuda.Device().synchronize()
    at = _gpu[1].get()
    _next_slot = itertools.count().__next__  # the slots are free again
    return sorted((int(at[slot]), name) for slot, name in names)


def take() -> list[tuple[int, str]]:
    """This process's marks so far (ns, name), oldest first; the list starts empty again."""
    global _marks
    taken, _marks = _marks, []
    return taken


def dump() -> str | None:
    """Writes this process's marks (as :func:`take` returns them) to
    ``<TANDEM_TIMELINE>/timeline-<pid>.json`` and returns the path (and its
    GPU marks, :func:`take_gpu`'s, to ``gpu-timeline-<pid>.json`` beside it);
    None when the timeline is off.

    Raises:
        OSError: the file cannot be written.
    """
    if not ENABLED:
        return None
    path = os.path.join(FOLDER, f"timeline-{os.getpid()}.json")
    with open(path, "w") as fh:
        json.dump(take(), fh)
    if _gpu is not None:
        with open(os.path.join(FOLDER, f"gpu-timeline-{os.getpid()}.json"), "w") as fh:
            json.dump(take_gpu(), fh)
    return path


def load(path: str) -> list[tuple[int, str]]:
    """The marks (host or GPU) :func:`dump` wrote to ``path``."""
    with open(path) as fh:
        return [(int(t), str(n)) for t, n in json.load(fh)]
