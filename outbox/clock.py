"""Clocks. Leases and windows use one clock; tests inject a fake one."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Wall time in epoch milliseconds, plus a monotonic clock for local deadlines."""

    def now_ms(self) -> int: ...

    def monotonic(self) -> float: ...


class SystemClock:
    """The local wall clock, guarded so that it never runs backwards in this process.

    Leases and windows on SQLite use it. If the system clock steps back, time stands
    still until it catches up, so nothing is resent early.
    """

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        now = time.time_ns() // 1_000_000
        with self._lock:
            if now < self._last:
                return self._last
            self._last = now
            return now

    def monotonic(self) -> float:
        return time.monotonic()


class OffsetClock:
    """Another clock's wall time (the database server's), advanced locally.

    ``sync`` reads the reference clock; between syncs the time advances on the local
    monotonic clock, so a local wall-clock jump changes nothing.
    """

    def __init__(self, reference_ms: int) -> None:
        self._base_ms = reference_ms
        self._base_mono = time.monotonic()
        self._last = reference_ms
        self._lock = threading.Lock()

    def sync(self, reference_ms: int) -> None:
        with self._lock:
            self._base_ms = reference_ms
            self._base_mono = time.monotonic()

    def now_ms(self) -> int:
        with self._lock:
            now = self._base_ms + int((time.monotonic() - self._base_mono) * 1000)
            self._last = max(self._last, now)
            return self._last

    def monotonic(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told to. For tests of windows and backoff."""

    def __init__(self, start_ms: int = 1_800_000_000_000) -> None:
        self._now_ms = start_ms
        self._mono = 1000.0
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        with self._lock:
            return self._now_ms

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def advance(self, seconds: float) -> None:
        """Move both wall and monotonic time forward."""
        with self._lock:
            self._now_ms += int(seconds * 1000)
            self._mono += seconds

    def jump_wall(self, seconds: float) -> None:
        """Move the wall clock only (forwards or backwards), as a clock step would."""
        with self._lock:
            self._now_ms += int(seconds * 1000)
