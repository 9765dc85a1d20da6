"""Imported at start-up by the dispatcher subprocesses of tests/integration/test_clock_step.py
(this directory is first on their PYTHONPATH), and by nothing else.

libfaketime (0.9.10, Debian's) with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` fails
``clock_nanosleep`` on the monotonic clock with EINVAL, and Python's ``time.sleep`` uses
exactly that. Only ``time.sleep`` is replaced, by a wait in ``select`` (which libfaketime
leaves alone); every clock the code reads is the one libfaketime fakes, or the real
monotonic clock.
"""

from __future__ import annotations

import os
import select
import time

if "faketime" in os.environ.get("LD_PRELOAD", "") and os.environ.get(
    "FAKETIME_DONT_FAKE_MONOTONIC"
):

    def _sleep(seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            select.select([], [], [], left)

    time.sleep = _sleep
