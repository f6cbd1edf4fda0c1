"""The command line explains itself: a version, help on every option, and
convert-fp16 without its extra names the extra instead of a traceback."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from stack.cli import main, parser
from tandem.paths import package_path

MODEL = str(package_path("reward_service", "models", "connect4_value.onnx"))


def _subcommands(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_option_and_argument_has_help():
    ap = parser()
    missing = [f"tandem {' '.join(a.option_strings) or a.dest}" for a in ap._actions if not a.help]
    for name, sub in _subcommands(ap).items():
        missing += [f"tandem {name} {' '.join(a.option_strings) or a.dest}" for a in sub._actions if not a.help]
    assert not missing, f"options without help: {missing}"


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("tandem ") and len(out.split()) >= 2, out


@pytest.mark.parametrize("missing", [("onnxconverter_common",), ("onnxconverter_common", "onnx")],
                         ids=["converter", "converter-and-onnx"])
def test_convert_fp16_without_the_extra_names_it(tmp_path, missing):
    # A module set to None in sys.modules cannot be imported: as if not installed.
    out = str(tmp_path / "x.onnx")
    code = (f"import sys\nfor m in {missing!r}: sys.modules[m] = None\n"
            f"from stack.cli import main\nsys.exit(main(['convert-fp16', {MODEL!r}, '--out', {out!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "pip install 'tandem[fp16]'" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "x.onnx").exists()
