"""Clocks. Leases and windows use one clock; tests inject a fake one."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Wall time in epoch milliseconds, plus a monotonic clock for local deadlines."""

    def now_ms(self) -> int: ...

    def monotonic(self) -> float: ...


#: A change of the wall clock against the monotonic clock larger than this (plus
#: 0.1 % of the time between two readings, far more than NTP's slew) is a step.
STEP_TOLERANCE_MS = 1000


class SystemClock:
    """The local wall clock, guarded so that it never runs backwards in this process,
    and watched for steps.

    Leases and windows on SQLite use it. If the system clock steps back, time stands
    still until it catches up, so nothing is resent early.

    Every reading compares the wall clock's progress with the monotonic clock's: a
    difference beyond :data:`STEP_TOLERANCE_MS` is a step (an NTP step, ``date -s``, a
    VM resumed with its wall clock set). :meth:`steady_ms` says for how long the
    readings have followed the wall clock without a step (a standstill after a step
    back counts as unsteady, and so does the time before the first reading): the
    claim takes over an expired lease only if it is no longer than that (see
    ``outbox.store.fairness`` and DESIGN-NOTES "Leases that survive a clock step").
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        wall, mono = time.time_ns(), time.monotonic_ns()
        self._last = wall // 1_000_000
        self._offset = wall - mono  # the wall clock minus the monotonic one, last read
        self._mono = mono
        self._steady_since = mono
        self._standing = False
        #: Steps seen so far, and the last one's size in milliseconds (+ forward).
        self.steps = 0
        self.last_step_ms = 0

    def _read(self) -> tuple[int, int]:
        """One reading (wall ns, monotonic ns), checked for a step; under the lock."""
        # The wall clock read between two monotonic readings: a thread preempted in
        # between widens the bound instead of looking like a step.
        before, wall, mono = time.monotonic_ns(), time.time_ns(), time.monotonic_ns()
        offset = wall - mono
        allowed = (
            STEP_TOLERANCE_MS * 1_000_000 + (mono - before) + max(0, mono - self._mono) // 1000
        )
        if abs(offset - self._offset) > allowed:
            self.steps += 1
            self.last_step_ms = (offset - self._offset) // 1_000_000
            self._steady_since = max(self._steady_since, mono)
        self._offset, self._mono = offset, max(self._mono, mono)
        return wall, mono

    def now_ms(self) -> int:
        with self._lock:
            return self._now()

    def _now(self) -> int:
        wall, mono = self._read()
        now = wall // 1_000_000
        if now < self._last:
            # Standing still: this process's time is not the wall clock others read,
            # so no expired lease is judged by it.
            self._standing = True
            self._steady_since = max(self._steady_since, mono)
            return self._last
        if self._standing:
            # The wall clock passed where this one stood (now - last) ms ago.
            self._standing = False
            resumed = mono - (now - self._last) * 1_000_000
            self._steady_since = max(self._steady_since, resumed)
        self._last = now
        return now

    def monotonic(self) -> float:
        return time.monotonic()

    def steady_ms(self) -> int:
        """Milliseconds for which this clock has followed the wall clock without a step."""
        with self._lock:
            self._now()
            return max(0, self._mono - self._steady_since) // 1_000_000


def steady_ms(clock: Clock) -> int | None:
    """How long ``clock`` has run without a step (:meth:`SystemClock.steady_ms`), or
    None for a clock that is not watched (a server's clock, a test's FakeClock)."""
    steady = getattr(clock, "steady_ms", None)
    return None if steady is None else int(steady())


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
