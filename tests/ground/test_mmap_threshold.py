"""glibc's allocator in the servers (tandem/heap.py): the mmap threshold
fixed at start and the heaps trimmed after a large refusal."""
from __future__ import annotations

import logging
import platform

import pytest
from conftest import wait_for

from tandem import heap

GLIBC = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and malloc_trim only")


@GLIBC
def test_the_threshold_is_set_where_glibc_is_present():
    assert heap.fix_mmap_threshold() is True  # mallopt answered 1


def test_a_c_library_without_mallopt_is_left_as_it_is(monkeypatch, caplog):
    """musl, macOS: nothing set, nothing raised, a line at debug."""
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: object())
    with caplog.at_level(logging.DEBUG, logger="tandem.heap"):
        assert heap.fix_mmap_threshold() is False
    assert "no mallopt" in caplog.text


@GLIBC
def test_the_heap_trimmer_trims_on_its_own_thread():
    trimmer = heap.HeapTrimmer()
    assert trimmer.request() is True
    assert wait_for(lambda: trimmer.trims >= 1)


def test_a_c_library_without_malloc_trim_is_not_trimmed(monkeypatch):
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: object())
    trimmer = heap.HeapTrimmer()
    assert trimmer.request() is False and trimmer._thread is None
