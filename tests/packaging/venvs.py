"""Wheels built from a copy of the checkout, and fresh virtual environments that
install them without the package index: their dependencies are the running
environment's own installed files, made visible through a ``.pth`` file."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from importlib.metadata import distribution
from pathlib import Path

from pip_env import REPO, checked, pip

# Left out of the copy the wheels are built from (in-tree builds write build/ and
# *.egg-info into the source folder: never into the checkout the tests run from).
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "runs", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache", ".hypothesis", ".whl", ".ortgpu", "shared")


def build_wheel(project: str, out: Path) -> Path:
    """The wheel of ``project`` ("." or "clients/python"), built from a copy of the
    checkout under ``out`` (symbolic links kept, so the in-tree links resolve)."""
    src = out / "src"
    if not src.exists():
        shutil.copytree(REPO, src, symlinks=True, ignore=_NOT_SOURCE)
    dist = out / "dist"
    checked(pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src / project)))
    name = "tandem_client" if project != "." else "tandem"
    (wheel,) = dist.glob(f"{name}-*.whl")
    return wheel


def requirements_closure(names: list[str]) -> set[str]:
    """``names`` and everything they require (extras left out), as installed here."""
    from packaging.requirements import Requirement  # pytest's own dependency

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        for line in distribution(name).requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def wheel_requirements(wheel: Path) -> list[str]:
    """The names in a wheel's Requires-Dist, without extras' requirements."""
    from email.parser import Parser
    from zipfile import ZipFile

    from packaging.requirements import Requirement

    with ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        fields = Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in fields.get_all("Requires-Dist") or ()]
    return [r.name for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _top_level(dist_name: str) -> set[Path]:
    """The installed top-level files and folders of a distribution (package, .libs, dist-info)."""
    dist = distribution(dist_name)
    return {Path(dist.locate_file(f.parts[0])) for f in dist.files or () if f.parts and f.parts[0] != ".."}


class Venv:
    """A new virtual environment at ``path`` (no pip of its own: the running pip
    installs into it with ``--python``)."""

    def __init__(self, path: Path, dependencies: tuple[str, ...] | None = None):
        """``dependencies``: distributions of the running environment to expose
        (with their files only); None exposes its whole site-packages."""
        self.path = path
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
        self.python = str(path / "bin" / "python")
        site = Path(subprocess.run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        if dependencies is None:
            shown = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
        else:
            deps = path / "deps"
            deps.mkdir()
            for name in dependencies:
                for top in _top_level(name):
                    (deps / top.name).symlink_to(top)
            shown = [str(deps)]
        (site / "zz_running_environment.pth").write_text("\n".join(shown) + "\n")

    def install(self, wheel: Path) -> None:
        checked(pip("--python", self.python, "install", "--quiet", "--no-deps", "--no-index", str(wheel)))

    def run(self, *args: str, cwd: Path, timeout_s: float = 120, **kw) -> subprocess.CompletedProcess:
        """``args`` with the venv's bin first on PATH, outside the checkout, without PYTHONPATH."""
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
                              env=self.env(), **kw)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PATH"] = f"{self.path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.path)
        return env
