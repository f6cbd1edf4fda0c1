"""Where tandem's own files are.

Run time: the bundled files (models, CUDA kernels, the default config, the labelled
position sets, the generated contract) are package data, found with
:mod:`importlib.resources`, so a checkout, an editable install and a wheel find
them alike. In the checkout, ``tandem/v1`` and ``tandem/bundled/*`` are symbolic
links to where the files are kept (``protos/tandem/v1``, ``deploy/config``,
``data/connect4/pons``); a wheel holds copies (pyproject.toml, package data).

:data:`REPO_ROOT` and :data:`DATA_DIR` are the source checkout, for the offline
tools and the tests only (training data, docs, bench results): nothing that the
servers or the ``tandem`` command run reads them (tests/packaging/test_wheel.py).
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# The top-level packages of the tandem distribution (pyproject.toml).
PACKAGES = ("tandem", "scheduler", "reward_service", "search_service", "training", "stack", "loadtest")

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"


def package_path(package: str, *parts: str) -> Path:
    """The file system path of ``parts`` inside the installed ``package``
    (e.g. ``package_path("reward_service", "models", "frame_reward.onnx")``).

    Raises:
        ModuleNotFoundError: no such package.
        RuntimeError: the package is not on the file system (a zip import).
    """
    found = files(package).joinpath(*parts)
    if not isinstance(found, Path):
        raise RuntimeError(f"{package} is not installed as files ({found!r}): tandem reads its package data as files")
    return found


def bundled(*parts: str) -> Path:
    """A file under ``tandem/bundled`` (``tandem.yaml``, ``positions/<set>.jsonl``)."""
    return package_path("tandem", "bundled", *parts)


def import_root() -> Path:
    """The directory the running ``tandem`` package was imported from (a checkout or
    site-packages), for child processes that must import the same code."""
    return package_path("tandem").parent
