"""The real servers as ``tandem up`` starts them (one process each), on
free loopback ports with no metrics endpoints, for benchmarks that measure the
services from outside."""
from __future__ import annotations

import contextlib
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import yaml

from stack.supervisor import Stack
from tandem.config import TandemConfig, load_config, loopback_data


def free_port() -> int:
    """A loopback TCP port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_stack_data(sections: dict[str, dict] | None = None) -> dict:
    """The config data of :func:`loopback_stack`: every server (the reward
    service's bulk server too, which the shipped defaults enable on their own
    fixed ports) on a free loopback port, metrics off, ``sections`` merged in."""
    return loopback_data(free_port, sections=sections)


@contextlib.contextmanager
def loopback_stack(sections: dict[str, dict] | None = None) -> Iterator[tuple[TandemConfig, Stack]]:
    """Starts scheduler, reward (and its bulk server) and search (each in its
    own process, waited for until SERVING) from a temporary config
    (:func:`loopback_stack_data`): every server on a free loopback port,
    metrics off, ``sections`` merged in per section (e.g.
    ``{"search": {"backend": "cpu"}}``). Yields the loaded config and the
    running :class:`Stack` (``stack.procs[name].pid``); stops it on exit.

    Raises:
        RuntimeError: a server did not start.
    """
    data = loopback_stack_data(sections)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        path = Path(tmp) / "tandem.yaml"
        path.write_text(yaml.safe_dump(data))
        cfg = load_config(path)
        stack = Stack(cfg, path)
        stack.start()
        try:
            yield cfg, stack
        finally:
            stack.stop()
