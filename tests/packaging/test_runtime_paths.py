"""What the servers and the `tandem` command run finds its files as package data
(importlib.resources, tandem/paths.py), never by the checkout's layout."""
from __future__ import annotations

import ast
from pathlib import Path

from tandem.config import DEFAULT_CONFIG, resolve_path
from tandem.paths import PACKAGES, REPO_ROOT, bundled, package_path
from tandem.positions import PONS_DIR

RUNTIME = ("tandem", "scheduler", "reward_service", "search_service", "stack")
CHECKOUT_NAMES = {"REPO_ROOT", "DATA_DIR", "__file__"}


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    found |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return found & CHECKOUT_NAMES


def test_runtime_code_reads_no_checkout_paths():
    offenders = {}
    for room in RUNTIME:
        for path in sorted((REPO_ROOT / room).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT)
            if rel.parts[:2] == ("tandem", "v1") or rel == Path("tandem/paths.py"):
                continue  # the generated modules; paths.py defines the checkout names for tools and tests
            if names := _names(path):
                offenders[str(rel)] = sorted(names)
    assert not offenders, f"runtime modules using checkout paths: {offenders}"


def test_bundled_files_are_the_checkouts_through_the_package_links():
    assert DEFAULT_CONFIG.resolve() == (REPO_ROOT / "deploy" / "config" / "tandem.yaml").resolve()
    assert PONS_DIR.resolve() == (REPO_ROOT / "data" / "connect4" / "pons").resolve()
    assert bundled("positions", "Test_L3_R1.jsonl").is_file()
    contract = package_path("tandem", "v1", "reward_pb2.py")
    assert contract.resolve() == (REPO_ROOT / "protos" / "tandem" / "v1" / "reward_pb2.py").resolve()


def test_config_paths_under_a_package_are_package_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: package paths must not depend on it
    assert resolve_path("reward_service/models/frame_reward.onnx") == package_path("reward_service", "models",
                                                                                   "frame_reward.onnx")
    assert resolve_path("reward_service/models/frame_reward.onnx").is_file()
    assert resolve_path("certs/tls.crt") == tmp_path / "certs" / "tls.crt"  # other relative paths: the working dir
    assert resolve_path("/etc/tandem/x.pem") == Path("/etc/tandem/x.pem")
    assert set(PACKAGES) >= set(RUNTIME)
