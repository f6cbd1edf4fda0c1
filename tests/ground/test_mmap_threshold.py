"""glibc's mmap threshold, fixed by every server at start (tandem.server.fix_mmap_threshold)."""
from __future__ import annotations

import logging
import platform

import pytest

from tandem import server


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_the_threshold_is_set_where_glibc_is_present():
    assert server.fix_mmap_threshold() is True  # mallopt answered 1


def test_a_c_library_without_mallopt_is_left_as_it_is(monkeypatch, caplog):
    """musl, macOS: nothing set, nothing raised, a line at debug."""
    monkeypatch.setattr(server.ctypes, "CDLL", lambda name: object())
    with caplog.at_level(logging.DEBUG, logger="tandem.server"):
        assert server.fix_mmap_threshold() is False
    assert "no mallopt" in caplog.text
