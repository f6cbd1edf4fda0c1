"""A non-editable install works: the wheel holds the generated contract, the
models, the CUDA kernels, the default config and the position sets, and installed
in a fresh venv (outside the checkout, no PYTHONPATH) `tandem --help`,
`tandem --version`, `tandem up` and `tandem play --frames 60` run."""
from __future__ import annotations

import json
import signal
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import free_port, lines_until
from pip_env import REPO
from venvs import Venv, build_wheel

from tandem.config import loopback_data

pytestmark = pytest.mark.slow

PACKAGE_DATA = [
    *(f"tandem/v1/{p.stem}{suffix}" for p in (REPO / "protos" / "tandem" / "v1").glob("*.proto")
      for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")),
    "tandem/bundled/tandem.yaml",
    "tandem/bundled/positions/Test_L3_R1.jsonl",
    "tandem/bundled/positions/Test_L2_R1.jsonl",
    "reward_service/models/connect4_value.onnx",
    "reward_service/models/frame_reward.onnx",
    *(f"search_service/cuda/kernels/{name}" for name in ("common.cu", "search.cu", "reroot.cu")),
    "search_service/games/othello/game.yaml",
    "search_service/games/othello/rules.py",
    "search_service/games/othello/positions.jsonl",
    "search_service/games/gomoku/game.yaml",
    "search_service/games/gomoku/rules.py",
    "search_service/games/gomoku/positions.jsonl",
]

# What the installed code finds through importlib.resources, printed as JSON.
_FOUND = """
import json, tandem
from tandem.config import load_config
from tandem.positions import load_set
from search_service.cuda.module import source
cfg = load_config()
print(json.dumps({"tandem": tandem.__file__, "models": [m.path for m in cfg.reward.models],
                  "positions": len(load_set("Test_L3_R1")), "kernels": len(source())}))
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    root = tmp_path_factory.mktemp("tandem-wheel")
    env = Venv(root / "venv")
    env.install(build_wheel(".", root))
    return env


def test_the_wheel_holds_the_package_data(tmp_path: Path):
    names = set(zipfile.ZipFile(build_wheel(".", tmp_path)).namelist())
    assert not [n for n in PACKAGE_DATA if n not in names], sorted(names)
    assert not [n for n in names if n.startswith(("tests/", "bench/", "protos/", "data/", "deploy/"))]


def test_installed_package_finds_its_files_outside_the_checkout(venv: Venv, tmp_path: Path):
    res = venv.run(venv.python, "-c", _FOUND, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)
    assert found["tandem"].startswith(str(venv.path)), found  # the wheel's files, not the checkout's
    assert found["models"] == ["reward_service/models/connect4_value.onnx", "reward_service/models/frame_reward.onnx"]
    assert found["positions"] > 100 and found["kernels"] > 10_000, found


def test_installed_tandem_help_and_version(venv: Venv, tmp_path: Path):
    helped = venv.run("tandem", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "demo" in helped.stdout and "convert-fp16" in helped.stdout, helped.stderr
    version = venv.run("tandem", "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == "tandem 0.1.0", version.stdout + version.stderr


def test_installed_tandem_up_and_play_60_frames(venv: Venv, tmp_path: Path):
    data = loopback_data(free_port)  # the bulk server too: tandem up's four processes, as shipped
    data["search"]["backend"] = "cpu"
    config = tmp_path / "tandem.yaml"
    config.write_text(yaml.safe_dump(data))
    up = subprocess.Popen(["tandem", "up", "--config", str(config)], cwd=tmp_path, env=venv.env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = lines_until(up, "tandem is up")
        assert lines[0].startswith("compute: search on the CPU (search.backend: cpu)"), lines[0]
        report = tmp_path / "report.json"
        play = venv.run("tandem", "play", "--config", str(config), "--frames", "60", "--late-answers", "--report", str(report),
                        cwd=tmp_path, timeout_s=300)
        assert play.returncode == 0, play.stdout + play.stderr
        figures = json.loads(report.read_text())
        assert figures["frames"] == figures["frames_answered"] == 60, figures
        assert figures["proven"]["solver_agrees"] == figures["proven"]["frames"]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
