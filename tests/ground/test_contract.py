"""The tandem.v1 contract: ``buf lint`` and ``buf breaking`` against the
committed image of the last release (protos/baseline/tandem-v1.binpb), run
with the buf CLI from the npm registry (``npx @bufbuild/buf``; skipped, with
the reason, only where npx or that package cannot be had); and the Handshake
every server answers."""
from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
from conftest import loopback_config
from google.protobuf import descriptor_pb2
from tandem.v1 import contract_pb2, contract_pb2_grpc

from reward_service import server as reward_server
from scheduler import main as scheduler_main
from search_service import server as search_server
from tandem import contract, engine_client
from tandem.paths import REPO_ROOT
from tandem.server import channel

PROTOS = REPO_ROOT / "protos"
BASELINE = PROTOS / "baseline" / "tandem-v1.binpb"
BUF = "@bufbuild/buf@1.75.0"


@cache
def buf_command() -> list[str]:
    npx = shutil.which("npx")
    if npx is None:
        pytest.skip("npx (Node.js) is not installed: buf comes from the npm registry (apt-get install npm)")
    cmd = [npx, "--yes", BUF]
    r = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.skip(f"npx could not run {BUF}: {r.stderr.strip()[-300:]}")
    return cmd


def buf(*args: str, cwd: Path = PROTOS) -> subprocess.CompletedProcess:
    return subprocess.run([*buf_command(), *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def copy_protos(tmp_path: Path) -> Path:
    root = tmp_path / "protos"
    shutil.copytree(PROTOS, root, ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    return root


def test_buf_lint_passes():
    r = buf("lint")
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_breaking_change_since_the_last_release():
    r = buf("breaking", "--against", str(BASELINE))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("file, old, new, complaint", [
    ("reward.proto", "  uint32 padded_batch_size = 7;", "", "padded_batch_size"),  # a field removed
    ("search.proto", "  uint64 seed = 9;", "  uint32 seed = 9;", "seed"),  # a type changed
    ("reward.proto", "rpc ListModels(", "rpc ListAllModels(", "ListModels"),  # an RPC renamed
])
def test_buf_breaking_catches_a_planted_breaking_change(tmp_path, file, old, new, complaint):
    root = copy_protos(tmp_path)
    path = root / "tandem" / "v1" / file
    text = path.read_text()
    assert old in text, f"anchor {old!r} is gone from {file}"
    path.write_text(text.replace(old, new, 1))
    r = buf("breaking", "--against", str(BASELINE), cwd=root)
    assert r.returncode != 0 and complaint in r.stdout + r.stderr, r.stdout + r.stderr


def test_buf_lint_catches_a_planted_problem(tmp_path):
    root = copy_protos(tmp_path)
    path = root / "tandem" / "v1" / "contract.proto"
    path.write_text(path.read_text().replace("service ContractService", "service Contract"))
    r = buf("lint", cwd=root)
    assert r.returncode != 0 and "Contract" in r.stdout, r.stdout + r.stderr


def test_baseline_is_the_released_v1_files():
    images = descriptor_pb2.FileDescriptorSet.FromString(BASELINE.read_bytes())
    names = sorted(f.name for f in images.file)
    assert names == ["tandem/v1/reward.proto", "tandem/v1/scheduler.proto", "tandem/v1/search.proto"]
    assert {f.package for f in images.file} == {"tandem.v1"}


def test_client_and_servers_agree_on_the_revision():
    assert contract.API_VERSION == engine_client.API_VERSION == contract_pb2.DESCRIPTOR.package
    assert contract.API_REVISION == engine_client.API_REVISION


@pytest.fixture(scope="module")
def three_servers():
    cfg = loopback_config(search={"backend": "cpu"})
    scheduler = scheduler_main.start(cfg)
    reward = reward_server.start(cfg, follow_scheduler=False)
    search = search_server.start(cfg, follow_scheduler=False)
    yield cfg, {"scheduler": scheduler.running.services, "reward": reward.running.services,
                "search": search.running.services}
    search.stop()
    reward.stop()
    scheduler.stop()


@pytest.mark.parametrize("name, service, capability", [
    ("scheduler", "tandem.v1.Scheduler", "scheduler.leases"),
    ("reward", "tandem.v1.RewardService", "reward.request_classes"),
    ("search", "tandem.v1.SearchService", "search.sessions"),
])
def test_every_server_answers_handshake(three_servers, name, service, capability):
    cfg, services = three_servers
    with channel(getattr(cfg, name).address) as ch:
        reply = contract_pb2_grpc.ContractServiceStub(ch).Handshake(
            contract_pb2.HandshakeRequest(client="test/1"), timeout=10)
    assert reply.api_version == "tandem.v1" and reply.api_revision == contract.API_REVISION
    assert set(reply.services) == set(services[name]) and service in reply.services
    assert capability in reply.capabilities
    server_cfg = getattr(cfg, name).server
    assert reply.max_message_bytes == server_cfg.max_message_bytes
    assert reply.keepalive_min_ping_interval_ms == server_cfg.keepalive_min_ping_interval_ms
    assert reply.auth_required is False and reply.server_version
