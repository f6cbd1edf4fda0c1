"""NVTX ranges, so that one Nsight Systems timeline shows the work of both
services: search steps (select / expand / evaluate / backup) and every model
call. Where CuPy is present the ranges go to ``cupy.cuda.nvtx``
(``RangePush``/``RangePop``); elsewhere they cost one Python call and are
not recorded anywhere except the per-thread depth below.

NVTX ranges nest per thread and must be popped on the thread that pushed
them, in reverse order: :func:`span` is the only way in, a context manager,
so every push has its pop even when the body raises. :func:`depth` (the
calling thread's open ranges) lets tests check that they balance.

    with nvtx.span("search.select"):
        ...
"""
from __future__ import annotations

import threading

_local = threading.local()  # .depth: open ranges of this thread; .opened: ranges ever opened on it


def _backend():
    """(push, pop) of ``cupy.cuda.nvtx`` where it imports, else None."""
    try:
        from cupy.cuda import nvtx

        nvtx.RangePush("tandem.nvtx.probe")  # a CuPy built without NVTX raises here, not later
        nvtx.RangePop()
    except Exception:  # no CuPy, or CuPy without a CUDA runtime or NVTX
        return None
    return nvtx.RangePush, nvtx.RangePop


_NVTX = _backend()


def enabled() -> bool:
    """Whether ranges reach NVTX (CuPy is present)."""
    return _NVTX is not None


def depth() -> int:
    """Ranges open on the calling thread."""
    return getattr(_local, "depth", 0)


def opened() -> int:
    """Ranges ever opened on the calling thread (tests count them)."""
    return getattr(_local, "opened", 0)


class _Span:
    """The context manager :func:`span` returns: a class, not a generator
    (``contextlib.contextmanager``), since it wraps every model run and a
    generator's enter and exit cost a few µs more."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        if _NVTX is not None:
            _NVTX[0](self.name)
        _local.depth = depth() + 1
        _local.opened = opened() + 1

    def __exit__(self, *exc) -> None:
        _local.depth -= 1
        if _NVTX is not None:
            _NVTX[1]()


def span(name: str) -> _Span:
    """An NVTX range named ``name`` around the ``with`` block (thread-local
    nesting); popped on the same thread however the block ends."""
    return _Span(name)
