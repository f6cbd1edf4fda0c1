"""Shared fixtures: configs on free loopback ports, and the GPU marker."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import socket
import threading
import time

import pytest
from tandem.v1 import reward_pb2_grpc

from tandem.config import TandemConfig, loopback_data, parse_config
from tandem.gpu import cuda_device_count, cupy_module
from tandem.server import channel


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


def cpu_config_file(path):
    """Writes the default config with every server on a free loopback port, the
    reward models on the CPU provider and the CPU search backend, to ``path``
    (a `tandem up --config` file); returns ``path``."""
    import yaml

    data = loopback_data(free_port)
    data["reward"]["execution_provider"] = "cpu"
    data["search"]["backend"] = "cpu"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def cpu_stack():
    """The config of a reward service and a CPU search service on loopback, for the module."""
    from reward_service import server as reward_server
    from search_service import server as search_server

    cfg = loopback_config(search={"backend": "cpu"})
    reward = reward_server.start(cfg, follow_scheduler=False)
    search = search_server.start(cfg, follow_scheduler=False)
    yield cfg
    search.stop()
    reward.stop()


class SilentRequests:
    """A request iterator that never yields until ``release`` is set: the call
    sends its headers and nothing more (a slow or hostile client)."""

    def __init__(self):
        self.release = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        self.release.wait()
        raise StopIteration


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    """Polls ``predicate`` until it is true or ``timeout_s`` passed; its last value."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def own_connection(address: str):
    """A channel with a connection of its own (gRPC shares one between channels
    of equal arguments in a process): another client, to the server."""
    import grpc

    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def closed(peer_text: str, port: int) -> bool:
    """Whether the kernel has the client's socket of ``peer_text`` (a gRPC peer
    string) to the server's ``port`` closing, within 30 s (a closed channel's
    socket is closed on gRPC's own thread)."""
    from tandem import peer

    return wait_for(lambda: peer.connection_open(peer_text, port) is False, timeout_s=30.0)


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


# -- a reward service in a process of its own, on the GPU (CUDA IPC handles open only in another process) --


def serve_reward(cfg, ready, stop) -> None:
    from reward_service import server as reward_server

    service = reward_server.start(cfg, follow_scheduler=False)
    ready.set()
    stop.wait()
    service.stop()


@pytest.fixture(scope="module")
def gpu_reward():
    """(cfg, RewardServiceStub): the reward service in a spawned process on the GPU, for the module."""
    if cupy_module() is None:
        pytest.skip("CuPy sees no GPU")
    cfg = loopback_config(search={"backend": "cuda", "value_model_parallel_sims": 64})
    spawn = mp.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    child = spawn.Process(target=serve_reward, args=(cfg, ready, stop), daemon=True)
    child.start()
    assert ready.wait(300), "the reward service did not start"
    ch = channel(cfg.reward.address)
    yield cfg, reward_pb2_grpc.RewardServiceStub(ch)
    ch.close()
    stop.set()
    child.join(30)
