"""Named fault-injection points for tests: off unless explicitly armed.

``OUTBOX_FAILPOINTS="after_attempt_commit=kill:0.01,after_response=pause:3@0.2"`` arms
them only together with ``OUTBOX_FAILPOINTS_ENABLE=i-understand``: a stray
``OUTBOX_FAILPOINTS`` in a production environment must not be able to SIGKILL a
dispatcher. Without the opt-in the spec is ignored (and a dispatcher says so in its
log); with it, a dispatcher logs ``failpoints_armed`` at warning level when it starts.

* ``kill[:P]``: SIGKILL this process, with probability P (default 1).
* ``raise[:P]``: raise :class:`FailpointError`, with probability P.
* ``pause:SECONDS[@P]``: sleep that long (longer than the lease, to test fencing).

Points: ``after_claim`` (the claim and its attempt rows committed, in one transaction;
nothing of the batch sent yet), ``after_attempt_commit`` (per attempt, before its lease
check and send), ``after_response`` (before the outcome commit), ``after_outcome``.
With the variable unset and no callback registered, ``hit`` is one truth test of an
empty dict.

Two more variables, for soaks that must account for what fired in processes they kill:

* ``OUTBOX_FAILPOINTS_SEED``: seeds the draws (a process-private generator), so a run
  can be replayed.
* ``OUTBOX_FAILPOINTS_LOG``: a file to which one line ``pid point action`` is appended
  (a single ``write`` on an ``O_APPEND`` descriptor) *before* the action runs, so a
  SIGKILL is accounted for too.

In-process tests can register a callback instead (``register``): an async callable run
at the point, e.g. one that waits for an event to hold a dispatcher exactly there.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

POINTS = ("after_claim", "after_attempt_commit", "after_response", "after_outcome")
ENV = "OUTBOX_FAILPOINTS"
#: Must be set to :data:`ENABLE_VALUE` as well, or ``OUTBOX_FAILPOINTS`` is ignored.
ENABLE_ENV = "OUTBOX_FAILPOINTS_ENABLE"
ENABLE_VALUE = "i-understand"
SEED_ENV = "OUTBOX_FAILPOINTS_SEED"
LOG_ENV = "OUTBOX_FAILPOINTS_LOG"

Callback = Callable[[str], Awaitable[None]]


class FailpointError(RuntimeError):
    """Raised by a failpoint whose action is ``raise``."""


@dataclass(frozen=True, slots=True)
class Failpoint:
    action: str
    probability: float = 1.0
    seconds: float = 0.0
    callback: Callback | None = None


def _probability(text: str, item: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"failpoint {item!r}: probability must be within [0, 1]")
    return value


def parse(spec: str) -> dict[str, Failpoint]:
    points: dict[str, Failpoint] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rule = item.partition("=")
        if name not in POINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")
        rule, _, prob = rule.partition("@")
        action, _, arg = rule.partition(":")
        if action in ("kill", "raise"):
            points[name] = Failpoint(action, _probability(arg or prob or "1", item))
        elif action == "pause":
            seconds = float(arg or 1.0)
            if seconds < 0:
                raise ValueError(f"failpoint {item!r}: pause seconds must be >= 0")
            points[name] = Failpoint(action, _probability(prob or "1", item), seconds)
        else:
            raise ValueError(f"unknown failpoint action {action!r} (kill, raise, pause)")
    return points


def _rng() -> random.Random:
    seed = os.environ.get(SEED_ENV)
    return random.Random(int(seed)) if seed else random.Random()


def _from_environment() -> dict[str, Failpoint]:
    if os.environ.get(ENABLE_ENV) != ENABLE_VALUE:
        return {}
    return parse(os.environ.get(ENV, ""))


_ACTIVE: dict[str, Failpoint] = _from_environment()
_RNG = _rng()
_COUNTS: dict[str, int] = {}


def reload() -> None:
    """Re-read the environment (tests set it after import). Drops registered callbacks."""
    global _ACTIVE, _RNG  # noqa: PLW0603
    _ACTIVE = _from_environment()
    _RNG = _rng()


def armed() -> dict[str, str]:
    """The armed points and their actions (empty in production)."""
    return {name: point.action for name, point in _ACTIVE.items()}


def warn_if_set(log: Any) -> None:
    """Log (on ``log``, a structlog logger) that failpoints are armed, or set but ignored."""
    if armed():
        detail = "fault injection is on: this process may kill itself"
        log.warning("failpoints_armed", points=armed(), detail=detail)
    elif ignored_spec():
        detail = f"{ENV} is set but {ENABLE_ENV} is not; no failpoint is armed"
        log.warning("failpoints_ignored", detail=detail)


def ignored_spec() -> str | None:
    """``OUTBOX_FAILPOINTS`` when it is set but not enabled (and so ignored)."""
    spec = os.environ.get(ENV, "").strip()
    if spec and os.environ.get(ENABLE_ENV) != ENABLE_VALUE:
        return spec
    return None


def register(name: str, callback: Callback, probability: float = 1.0) -> None:
    """Run ``await callback(name)`` at the point (in-process tests)."""
    if name not in POINTS:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")
    _ACTIVE[name] = Failpoint("callback", probability, callback=callback)


def clear(name: str | None = None) -> None:
    """Remove one point (or all of them)."""
    if name is None:
        _ACTIVE.clear()
    else:
        _ACTIVE.pop(name, None)


def counts() -> dict[str, int]:
    """How many times each point fired in this process."""
    return dict(_COUNTS)


def _record(name: str, action: str) -> None:
    _COUNTS[name] = _COUNTS.get(name, 0) + 1
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{os.getpid()} {name} {action}\n".encode())
    finally:
        os.close(fd)


def _fire(name: str) -> Failpoint | None:
    point = _ACTIVE.get(name)
    if point is None or _RNG.random() >= point.probability:
        return None
    _record(name, point.action)
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
    if point is None:
        return
    if point.action == "pause":
        await asyncio.sleep(point.seconds)
    elif point.callback is not None:
        await point.callback(name)
