"""Pins that coexist: tandem resolves beside tritonclient[grpc] (protobuf < 7), its
generated modules import under protobuf 6 and 7, and every dependency of an extra
has a wheel for Python 3.13 (and the CPU extra for macOS)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pip_env import REPO, checked, pip
from venvs import build_wheel

pytestmark = pytest.mark.slow

_ROUND_TRIP = """
import google.protobuf, grpc
from tandem.v1 import reward_pb2, reward_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, search_pb2, search_pb2_grpc
req = reward_pb2.EvaluateRequest(model="m", request_class=reward_pb2.REQUEST_CLASS_CRITICAL)
req.inputs.add(name="board", dtype=reward_pb2.DATA_TYPE_FLOAT32, shape=[1, 2], data=b"\\0" * 8)
back = reward_pb2.EvaluateRequest.FromString(req.SerializeToString())
assert back == req and back.inputs[0].shape == [1, 2], back
assert reward_pb2_grpc.RewardServiceStub and search_pb2_grpc.SearchServiceStub
print(google.protobuf.__version__)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(".", tmp_path_factory.mktemp("pins"))


def _resolve(*requirements: str, extra_args: tuple[str, ...] = ()) -> dict[str, str]:
    """What pip would install for ``requirements`` (resolution only): name -> version."""
    res = checked(pip("install", "--dry-run", "--quiet", "--ignore-installed", "--report", "-",
                      *extra_args, *requirements), index_needed=True)
    report = json.loads(res.stdout)
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}


def _platforms(*tags: str) -> list[str]:
    """pip's --platform takes exact tags: one option per tag a wheel may carry."""
    return [arg for tag in tags for arg in ("--platform", tag)]


@pytest.mark.parametrize("spec", ["protobuf==6.31.1", "protobuf>=7,<8"])
def test_generated_modules_import_under_protobuf_6_and_7(tmp_path: Path, spec: str):
    """6.31.1 is the gencode's own version, the oldest runtime that takes it."""
    checked(pip("install", "--quiet", "--no-deps", "--only-binary=:all:", "--target", str(tmp_path), spec),
            index_needed=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), str(REPO / "protos")])}
    res = subprocess.run([sys.executable, "-W", "error", "-c", _ROUND_TRIP], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    major = res.stdout.strip().split(".")[0]
    assert major == spec.split("==")[-1].split(">=")[-1][0], f"{spec} wanted, {res.stdout.strip()} imported"


def test_tandem_resolves_beside_tritonclient_grpc(wheel: Path):
    found = _resolve(f"tandem[cpu] @ {wheel.as_uri()}", "tritonclient[grpc]>=2.73")
    assert "tandem" in found and "tritonclient" in found, found
    assert found["protobuf"].split(".")[0] == "6", f"tritonclient needs protobuf < 7, got {found['protobuf']}"
    assert "onnxruntime" in found and "onnxruntime-gpu" not in found, found


# ids without "gpu": that keyword would mark the test as needing a GPU (conftest).
@pytest.mark.parametrize("extra", ["cpu", "gpu"], ids=["cpu-extra", "cuda-extra"])
def test_every_dependency_has_a_python_3_13_wheel(wheel: Path, tmp_path: Path, extra: str):
    """No upper cap on Python: the extras resolve to binary wheels for CPython 3.13
    on Linux (where python3.13 itself is missing, this is the check that can run)."""
    found = _resolve(f"tandem[{extra}] @ {wheel.as_uri()}", extra_args=(
        "--only-binary=:all:", "--python-version", "3.13", "--implementation", "cp",
        *_platforms("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64",
                    "manylinux_2_28_x86_64"), "--target", str(tmp_path / "t")))
    assert {"grpcio", "protobuf", "numpy"} <= found.keys(), found
    assert ("onnxruntime-gpu" if extra == "gpu" else "onnxruntime") in found, found


def test_cpu_extra_resolves_for_macos(wheel: Path, tmp_path: Path):
    """The base dependencies and the CPU extra have macOS wheels (onnxruntime-gpu has none)."""
    found = _resolve(f"tandem[cpu] @ {wheel.as_uri()}", extra_args=(
        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        *_platforms(*(f"macosx_{v}_0_arm64" for v in range(11, 15))), "--target", str(tmp_path / "t")))
    assert "onnxruntime" in found, found
