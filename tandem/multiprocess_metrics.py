"""Prometheus metrics of a service that runs as several worker processes
(tandem/workers.py): prometheus-client's multiprocess mode.

With ``workers`` > 1 every process of the service writes its metrics to
files of its own in one directory (``PROMETHEUS_MULTIPROC_DIR``, a fresh
private one per service start: :func:`begin`), and worker 0's ``/metrics``
serves them all merged (:func:`registry`, ``MultiProcessCollector``):
counters and histograms summed over every process that ever ran, a worker
that died and was started again included; each gauge as its
``multiprocess_mode`` says (``livesum``: summed over the live processes;
``livemin``; ``liveall``: one series a live process, with a ``pid`` label).
prometheus-client chooses the mode once, when it is first imported: the
variable must be set before then (``tandem serve``, stack/cli.py, sets it
before it imports the service), and the spawned workers inherit it. With
one process nothing is set and the metrics are the process's own, as
prometheus-client keeps them by default.

A gauge that reads its value from a function (``Gauge.set_function``) has no
value in the files, so in multiprocess mode :func:`set_function` sets it from
its function every ``REFRESH_S`` in each process, and worker 0 once more just
before each scrape. This module does not import prometheus-client at import
time, so that it can be imported before the mode is chosen.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

ENV = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "tandem-metrics-"  # tandem-metrics-<first process's pid>-<random>, in the temporary directory
REFRESH_S = 1.0  # a function-valued gauge's value in the files is at most this old (worker 0's own: fresh)

_functions: dict[object, Callable[[], float]] = {}  # gauge (or labelled child) -> its function (multiprocess mode)
_lock = threading.Lock()
_refresher: threading.Thread | None = None


def begin(workers: int) -> str | None:
    """Where a service is to run as ``workers`` processes (> 1): makes a fresh
    private directory, sets ``PROMETHEUS_MULTIPROC_DIR`` to it in this
    process's environment (which its workers inherit) and returns it; removes
    directories that earlier services left behind (their first process died
    unasked). With one worker it does nothing and returns None.

    Raises:
        RuntimeError: prometheus-client is imported already (its mode is chosen).
    """
    if workers <= 1:
        return None
    if "prometheus_client" in sys.modules:
        raise RuntimeError(f"{ENV} must be set before prometheus_client is imported")
    _sweep(tempfile.gettempdir())
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    os.environ[ENV] = path
    return path


def end(path: str | None) -> None:
    """Removes ``path`` (from :func:`begin`), once the service's processes have ended."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _sweep(tmp: str) -> None:
    """Removes this user's directories from :func:`begin` whose first process is gone."""
    for entry in os.listdir(tmp):
        if not entry.startswith(PREFIX):
            continue
        path = os.path.join(tmp, entry)
        try:
            pid = int(entry[len(PREFIX):].partition("-")[0])
            if os.stat(path).st_uid != os.getuid() or (pid != os.getpid() and _alive(pid)):
                continue
        except (ValueError, OSError):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def active() -> bool:
    """prometheus-client is in multiprocess mode in this process."""
    from prometheus_client import values

    return bool(getattr(values.ValueClass, "_multiprocess", False))


def registry():
    """What ``/metrics`` serves: in multiprocess mode a registry merging every
    process's files; else prometheus-client's default registry."""
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    if not active():
        return REGISTRY
    merged = CollectorRegistry()
    MultiProcessCollector(merged)
    return merged


def set_function(gauge, function: Callable[[], float]) -> None:
    """``gauge.set_function(function)`` in single-process mode. In
    multiprocess mode (where prometheus-client reads no function) ``gauge``
    is set from ``function`` now, every ``REFRESH_S`` and at each scrape of
    this process (:func:`refresh`); a later call for the same gauge replaces
    its function."""
    if not active():
        gauge.set_function(function)
        return
    global _refresher
    with _lock:
        _functions[gauge] = function
        if _refresher is None:
            _refresher = threading.Thread(target=_refresh_forever, name="metrics-refresh", daemon=True)
            _refresher.start()
    _set(gauge, function)


def refresh() -> None:
    """Sets every gauge of :func:`set_function` from its function (multiprocess mode; else nothing)."""
    with _lock:
        items = list(_functions.items())
    for gauge, function in items:
        _set(gauge, function)


def _set(gauge, function: Callable[[], float]) -> None:
    try:
        gauge.set(float(function()))
    except Exception:  # a function over a service being stopped: the value stays the last one
        log.debug("gauge %s: its function failed", gauge, exc_info=True)


def _refresh_forever() -> None:
    while True:
        time.sleep(REFRESH_S)
        refresh()


def mark_dead(pid: int) -> None:
    """A worker process ``pid`` has ended: its ``live*`` gauges leave the
    merged values (its counters and histograms stay in the sums). Nothing in
    single-process mode."""
    if active():
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid)
