"""Named fault-injection points, off unless ``OUTBOX_FAILPOINTS`` is set.

``OUTBOX_FAILPOINTS="after_attempt_commit=kill:0.01,after_response=pause:3@0.2"``

* ``kill[:P]``: SIGKILL this process, with probability P (default 1).
* ``raise[:P]``: raise :class:`FailpointError`, with probability P.
* ``pause:SECONDS[@P]``: sleep that long (longer than the lease, to test fencing).

Points: ``after_claim``, ``after_attempt_commit`` (before the send), ``after_response``
(before the outcome commit), ``after_outcome``. With the variable unset, ``hit`` is one
dictionary lookup on an empty dict.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass

POINTS = ("after_claim", "after_attempt_commit", "after_response", "after_outcome")
ENV = "OUTBOX_FAILPOINTS"


class FailpointError(RuntimeError):
    """Raised by a failpoint whose action is ``raise``."""


@dataclass(frozen=True, slots=True)
class Failpoint:
    action: str
    probability: float = 1.0
    seconds: float = 0.0


def parse(spec: str) -> dict[str, Failpoint]:
    points: dict[str, Failpoint] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rule = item.partition("=")
        if name not in POINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")
        rule, _, prob = rule.partition("@")
        action, _, arg = rule.partition(":")
        if action in ("kill", "raise"):
            points[name] = Failpoint(action, float(arg or prob or 1.0))
        elif action == "pause":
            points[name] = Failpoint(action, float(prob or 1.0), float(arg or 1.0))
        else:
            raise ValueError(f"unknown failpoint action {action!r} (kill, raise, pause)")
    return points


_ACTIVE: dict[str, Failpoint] = parse(os.environ.get(ENV, ""))
_COUNTS: dict[str, int] = {}


def reload() -> None:
    """Re-read the environment (tests set it after import)."""
    global _ACTIVE  # noqa: PLW0603
    _ACTIVE = parse(os.environ.get(ENV, ""))


def _fire(name: str) -> Failpoint | None:
    point = _ACTIVE.get(name)
    if point is None or random.random() >= point.probability:
        return None
    _COUNTS[name] = _COUNTS.get(name, 0) + 1
    if point.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if point.action == "raise":
        raise FailpointError(f"failpoint {name}")
    return point


async def hit(name: str) -> None:
    """Trigger the named point (async contexts: a pause does not block the loop)."""
    if not _ACTIVE:
        return
    point = _fire(name)
    if point is not None and point.action == "pause":
        await asyncio.sleep(point.seconds)


def hit_sync(name: str) -> None:
    if not _ACTIVE:
        return
    point = _fire(name)
    if point is not None and point.action == "pause":
        time.sleep(point.seconds)
