"""pytest plugin (``-p emu_plugin``, this folder on PYTHONPATH): CuPy is the
CPU emulation of fakecupy.py and the host is said to have one GPU, so the
GPU tests of Connect Four's CUDA module run without one (README.md here).

Only the GPU tests of EMULATED run: every other ``gpu`` test (the reward
service's CUDA provider, the leaf channel, the in-process hand-off, ...)
is skipped with the reason, as are the tests of SKIPPED."""
import os

import pytest

import fakecupy

fakecupy.install()

import search_service.backends as _backends  # noqa: E402
import tandem.gpu as _gpu  # noqa: E402

_backends.cuda_available = lambda: None  # the CUDA backend "can run here"
_gpu.cuda_device_count = lambda: 1  # tests/conftest.py then keeps the gpu marker's tests

# The GPU test files whose tests run under the emulation.
EMULATED = ("tests/search/test_cuda_batch_gpu.py", "tests/search/test_cuda_mcts.py",
            "tests/search/test_cuda_games_gpu.py", "tests/games/test_gpu_rules_gpu.py")
# Tests of those files that cannot: test name (without parameters) -> why. A
# test that needs the device-side leaf channel (cuStreamWriteValue64,
# host-mapped memory a kernel polls, ONNX Runtime's CUDA provider) or a
# kernel that spin-waits on memory the host writes later belongs here: the
# emulation runs each launch to its end before the host goes on.
SKIPPED: dict[str, str] = {}


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath)
    for item in items:
        if "gpu" not in item.keywords:
            continue
        path = os.path.relpath(str(item.path), root)
        name = item.name.split("[", 1)[0]
        if path not in EMULATED:
            item.add_marker(pytest.mark.skip(reason="a GPU test the CUDA emulation does not run "
                                              "(tests/cuda_emulation/README.md)"))
        elif name in SKIPPED:
            item.add_marker(pytest.mark.skip(reason=f"CUDA emulation: {SKIPPED[name]}"))
