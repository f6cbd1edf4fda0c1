"""pytest plugin (``-p emu_plugin``, this folder on PYTHONPATH): CuPy is the
CPU emulation of fakecupy.py and the host is said to have one GPU, so the
GPU tests of the game folders' kernels run without one (README.md here)."""
import fakecupy

fakecupy.install()

import search_service.backends as _backends  # noqa: E402
import tandem.gpu as _gpu  # noqa: E402

_backends.cuda_available = lambda: None  # the CUDA backend "can run here"
_gpu.cuda_device_count = lambda: 1  # tests/conftest.py then keeps the gpu marker's tests
