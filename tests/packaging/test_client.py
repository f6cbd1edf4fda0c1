"""The thin client (clients/python, `tandem-client`): its wheel holds the contract,
the tensor helpers and the channel options only; installed in a fresh venv with
nothing but its declared dependencies (no ONNX Runtime, no CuPy, no server code),
it evaluates a position on a real reward service."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from conftest import loopback_config
from pip_env import REPO, checked, pip
from venvs import Venv, build_wheel, requirements_closure, wheel_requirements

from reward_service import server as reward_server

pytestmark = pytest.mark.slow

_CLIENT = """
import importlib.util, json, sys
import grpc, numpy as np
from tandem import tensors
from tandem.channel_options import CHANNEL_OPTIONS, KEEPALIVE_OPTIONS
from tandem.v1 import reward_pb2, reward_pb2_grpc
absent = [m for m in ("onnxruntime", "cupy", "yaml", "tandem.config", "reward_service")
          if importlib.util.find_spec(m.split(".")[0]) is None or importlib.util.find_spec(m) is None]
with grpc.insecure_channel(sys.argv[1], options=CHANNEL_OPTIONS + KEEPALIVE_OPTIONS) as ch:
    stub = reward_pb2_grpc.RewardServiceStub(ch)
    models = list(stub.ListModels(reward_pb2.ListModelsRequest(), timeout=30).models)
    board = np.zeros((3, 2, 6, 7), np.uint8)
    reply = stub.Evaluate(reward_pb2.EvaluateRequest(model="connect4_value", inputs=[tensors.to_proto("board", board)]),
                          timeout=60)
    outputs = {t.name: tensors.from_proto(t).shape for t in reply.outputs}
    try:
        stub.Evaluate(reward_pb2.EvaluateRequest(model="nope"), timeout=30)
        refused = None
    except grpc.RpcError as exc:
        refused = exc.code().name
print(json.dumps({"models": models, "outputs": outputs, "refused": refused, "absent": absent}))
"""


@pytest.fixture(scope="module")
def client_env(tmp_path_factory) -> tuple[Venv, Path]:
    root = tmp_path_factory.mktemp("tandem-client")
    wheel = build_wheel("clients/python", root)
    env = Venv(root / "venv", dependencies=tuple(sorted(requirements_closure(wheel_requirements(wheel)))))
    env.install(wheel)
    return env, wheel


def test_client_wheel_holds_only_the_client_modules(client_env):
    _, wheel = client_env
    modules = sorted(n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n)
    stems = [p.stem for p in (REPO / "protos" / "tandem" / "v1").glob("*.proto")]
    contract = [f"tandem/v1/{stem}{suffix}" for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    assert modules == sorted(["tandem/__init__.py", "tandem/tensors.py", "tandem/channel_options.py",
                              "tandem/engine_client.py", "tandem/failover.py", "tandem/v1/__init__.py", *contract])
    assert wheel_requirements(wheel) == ["grpcio", "protobuf", "numpy"]


def test_client_venv_has_its_dependencies_and_nothing_of_the_server(client_env, tmp_path):
    env, _ = client_env
    checked(pip("--python", env.python, "check"))  # every declared requirement is there
    res = env.run(env.python, "-c", "import onnxruntime", cwd=tmp_path)
    assert res.returncode != 0 and "No module named 'onnxruntime'" in res.stderr
    helped = env.run(env.python, "-m", "tandem.engine_client", "--help", cwd=tmp_path)  # the reference client
    assert helped.returncode == 0 and "--search" in helped.stdout, helped.stderr


def test_client_evaluates_on_a_real_reward_service(client_env, tmp_path):
    env, _ = client_env
    models = [{"name": "connect4_value", "path": "reward_service/models/connect4_value.onnx", "max_batch_size": 64}]
    cfg = loopback_config(reward={"models": models})
    service = reward_server.start(cfg, follow_scheduler=False)
    try:
        res = env.run(env.python, "-c", _CLIENT, cfg.reward.address, cwd=tmp_path, timeout_s=180)
    finally:
        service.stop()
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)
    assert found["models"] == ["connect4_value"]
    assert found["outputs"] == {"value": [3, 1], "policy_logits": [3, 7]}, found
    assert found["refused"] == "NOT_FOUND"
    assert found["absent"] == ["onnxruntime", "cupy", "yaml", "tandem.config", "reward_service"], found
