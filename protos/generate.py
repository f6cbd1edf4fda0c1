"""Regenerate the Python modules of the gRPC contract.

Usage: ``python protos/generate.py`` (needs grpcio-tools, the version pinned in
pyproject.toml's ``test`` extra). tests/ground/test_protos.py fails when the checked-in
modules differ from what this writes.

The pinned grpcio-tools is deliberately older than the newest: its protoc writes
gencode that protobuf 6.x and 7.x both import (a runtime accepts gencode of its own
version or older), so tandem installs beside packages that need protobuf < 7
(tritonclient[grpc], kserve, mlserver).
"""
from __future__ import annotations

import re
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROTOS = sorted((ROOT / "tandem" / "v1").glob("*.proto"))
PYPROJECT = ROOT.parent / "pyproject.toml"


def pinned_tools_version() -> str:
    """The ``grpcio-tools==X`` pin of pyproject.toml's ``test`` extra.

    Raises:
        LookupError: the extra has no exact grpcio-tools pin.
    """
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for req in extras["test"]:
        m = re.fullmatch(r"grpcio-tools==([\w.]+)", req.replace(" ", ""))
        if m:
            return m.group(1)
    raise LookupError(f"{PYPROJECT}: no grpcio-tools==X in the test extra")


def generate(out_dir: Path) -> None:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_dir``.

    Raises:
        RuntimeError: the installed grpcio-tools is not the pinned one (its gencode
            would differ), or protoc failed.
    """
    installed, pinned = version("grpcio-tools"), pinned_tools_version()
    if installed != pinned:
        raise RuntimeError(f"grpcio-tools {installed} is installed; the contract is generated with "
                           f"{pinned} (pyproject.toml, test extra): pip install grpcio-tools=={pinned}")
    from grpc_tools import protoc

    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(ROOT)) for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
