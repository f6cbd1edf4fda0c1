"""Shared fixtures: configs on free loopback ports, and the GPU marker."""
from __future__ import annotations

import dataclasses
import socket
import time

import pytest

from tandem.config import TandemConfig, loopback_data, parse_config
from tandem.gpu import cuda_device_count


def pytest_collection_modifyitems(config, items):
    if cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_HANDED_OUT: set[int] = set()  # ports free_port returned in this test process


def free_port() -> int:
    """A free loopback port, never one handed out before in this process: the
    kernel may offer a just-released port again, and two servers of one config
    (an address and a metrics port) must not get the same one."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def loopback_config(**sections) -> TandemConfig:
    """The default config with every server (the reward service's bulk server
    too) on a free loopback port and no metrics endpoint; ``sections``
    override fields, e.g. ``search={"backend": "cpu"}``."""
    return parse_config(loopback_data(free_port, sections=sections))


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    """Polls ``predicate`` until it is true or ``timeout_s`` passed; its last value."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def lines_until(proc, prefix: str, timeout_s: float = 180.0) -> list[str]:
    """The lines a process prints on its (text) stdout up to and including the first
    that starts with ``prefix``, e.g. ``tandem up``'s "tandem is up"; fails the test
    when the process closes its output first or ``timeout_s`` passes."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"{proc.args} exited early:\n" + "".join(lines)
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"no line starting {prefix!r} within {timeout_s} s:\n" + "".join(lines))


@pytest.fixture
def cfg() -> TandemConfig:
    return loopback_config(search={"backend": "cpu"})


def replace(cfg: TandemConfig, section: str, **fields) -> TandemConfig:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)})
