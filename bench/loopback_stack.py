"""The three real servers as ``tandem up`` starts them (one process each), on
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
from tandem.config import TandemConfig, load_config


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def loopback_stack(sections: dict[str, dict] | None = None) -> Iterator[tuple[TandemConfig, Stack]]:
    """Starts scheduler, reward and search (each in its own process, waited for
    until SERVING) from a temporary config: every server on a free loopback
    port, metrics off, ``sections`` merged in per section (e.g.
    ``{"search": {"backend": "cpu"}}``). Yields the loaded config and the
    running :class:`Stack` (``stack.procs[name].pid``); stops it on exit.

    Raises:
        RuntimeError: a server did not start.
    """
    sections = sections or {}
    data = {name: {"address": _free_address(), "metrics_port": 0, **sections.get(name, {})}
            for name in ("scheduler", "reward", "search")}
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
