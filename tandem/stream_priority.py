"""CUDA stream priorities: a device's range, and the one rule that maps an
assigned stream priority onto one a service holds a stream for.

CUDA's convention: lower numbers are more urgent; ``least`` is 0 on every
NVIDIA GPU and ``greatest`` is -5 on the H200. Both services and the
scheduler use :func:`nearest_allowed`, so an assignment means the same
stream priority in every process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PriorityRange:
    """A device's CUDA stream priority range: ``greatest <= p <= least`` are valid.

    Lower numbers are more urgent (CUDA's convention). ``least == greatest``
    describes a device (or a stand-in) with a single level.
    """

    least: int
    greatest: int

    def __post_init__(self) -> None:
        if self.greatest > self.least:
            raise ValueError(f"PriorityRange: greatest ({self.greatest}) must be <= least ({self.least})")

    def contains(self, priority: int) -> bool:
        return self.greatest <= priority <= self.least

    def step_below_greatest(self) -> int:
        """One level less urgent than ``greatest`` (``least`` on a single-level range)."""
        return min(self.greatest + 1, self.least)


def nearest_allowed(target: int, allowed: Sequence[int]) -> int:
    """The CUDA stream priority a service uses when assigned ``target``.

    The most urgent of ``allowed`` (the stream priorities it holds streams
    for) that is no more urgent than ``target`` (a policy's choice is never
    exceeded): with ``allowed`` (0, -5), -3 maps to 0. If every allowed stream
    priority is more urgent than ``target``, the least urgent of them. Empty
    ``allowed`` (any stream priority in the device's range): ``target`` itself.
    """
    if not allowed:
        return target
    at_most = [p for p in allowed if p >= target]
    return min(at_most) if at_most else max(allowed)


def stream_priority_range(runtime) -> tuple[int, int]:
    """(least, greatest) of the current device.

    ``cudaDeviceGetStreamPriorityRange`` where CuPy exposes it; CuPy 14 does
    not, so otherwise a stream is created at an absurdly low and one at an
    absurdly high priority and read back: CUDA clamps out-of-range priorities
    to the device's range.
    """
    direct = getattr(runtime, "deviceGetStreamPriorityRange", None)
    if direct is not None:
        least, greatest = direct()
        return int(least), int(greatest)
    ends = []
    for asked in (1 << 20, -(1 << 20)):
        stream = runtime.streamCreateWithPriority(getattr(runtime, "streamNonBlocking", 1), asked)
        try:
            ends.append(int(runtime.streamGetPriority(stream)))
        finally:
            runtime.streamDestroy(stream)
    return ends[0], ends[1]
