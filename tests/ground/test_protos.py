"""The checked-in generated modules are what protos/generate.py makes, and import."""
import filecmp
import importlib
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from tandem.paths import REPO_ROOT

STEMS = sorted(p.stem for p in (REPO_ROOT / "protos" / "tandem" / "v1").glob("*.proto"))


def test_generated_modules_are_up_to_date(tmp_path: Path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the modules")
    sys.path.insert(0, str(REPO_ROOT / "protos"))
    from generate import generate, pinned_tools_version

    if (installed := version("grpcio-tools")) != pinned_tools_version():
        pytest.skip(f"grpcio-tools {installed} is installed, not the test extra's {pinned_tools_version()} "
                    "(`make test` installs it)")

    generate(tmp_path)
    fresh = sorted((tmp_path / "tandem" / "v1").iterdir())
    assert [p.name for p in fresh] == sorted(
        f"{stem}{suffix}" for stem in STEMS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    )
    checked_in = REPO_ROOT / "protos" / "tandem" / "v1"
    stale = [p.name for p in fresh if not filecmp.cmp(p, checked_in / p.name, shallow=False)]
    assert not stale, f"regenerate with `python protos/generate.py`: {stale} differ"


def test_generated_modules_import_as_the_proto_package():
    assert {"contract", "reward", "scheduler", "search"} <= set(STEMS)
    for stem in STEMS:
        pb2 = importlib.import_module(f"tandem.v1.{stem}_pb2")
        importlib.import_module(f"tandem.v1.{stem}_pb2_grpc")
        assert pb2.DESCRIPTOR.package == "tandem.v1"
