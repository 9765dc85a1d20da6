"""When an idle dispatcher claims again: on a signal, at a known due time, or on a poll.

The dispatcher claims; when the claim finds nothing it waits here for the first of:

* a change signal from the store (``outbox.store.changes``): a PostgreSQL NOTIFY sent
  at an enqueue's commit, a same-process SQLite enqueue, a SQLite ``data_version``
  change, or a (re)connected listener;
* the earliest ``next_attempt_at`` it knows of: the store's answer after the empty
  claim (any dispatcher's scheduled retry, an expiring lease) and the retries this
  dispatcher scheduled itself since;
* the safety-net poll (``DispatcherSettings.idle_poll_seconds``), which bounds the wait
  whatever signals were lost.

The signal flag is cleared *before* each claim, so a signal that arrives while a claim
runs makes the next wait return at once: no enqueue committed after a claim's snapshot
waits for the poll.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from outbox.base.logs import get_logger
from outbox.clock import Clock
from outbox.store.changes import ChangeSource

logger = get_logger("outbox.wakeup")

#: Observes every wake-up event by name (see :class:`WakeStats`); runs on the loop.
Hook = Callable[[str], None]


@dataclass
class WakeStats:
    """Counts of what ended each idle wait, and of the signal source's events."""

    #: PostgreSQL notifications received.
    notified: int = 0
    #: Same-process SQLite enqueues.
    local: int = 0
    #: SQLite ``data_version`` changes seen.
    changed: int = 0
    #: Listener connections established (the first one included).
    listening: int = 0
    #: Listener connections lost.
    listener_lost: int = 0
    #: The start-up check found that LISTEN cannot work here (the dispatcher polls).
    listen_unavailable: int = 0
    #: Idle waits ended by a known due time.
    due: int = 0
    #: Idle waits ended by the safety-net poll.
    polled: int = 0
    #: Claim transactions run, and how many of them found nothing.
    claims: int = 0
    empty_claims: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def count(self, event: str) -> None:
        if hasattr(self, event) and event != "extra":
            setattr(self, event, getattr(self, event) + 1)
        else:
            self.extra[event] = self.extra.get(event, 0) + 1


@dataclass(eq=False, slots=True)
class Wakeup:
    """One dispatcher's idle waiting. Start it on the dispatcher's loop; close it after."""

    source: ChangeSource | None
    _: KW_ONLY
    clock: Clock
    poll_seconds: float
    stats: WakeStats = field(init=False, default_factory=WakeStats)
    #: Called with each event's name: a :class:`WakeStats` field ("notified",
    #: "listening", "listener_lost", "due", "polled", "claims", ...).
    hooks: list[Hook] = field(init=False, default_factory=list)
    _signal: asyncio.Event | None = field(init=False, default=None)
    _task: asyncio.Task[None] | None = field(init=False, default=None)
    _due_ms: int | None = field(init=False, default=None)
    # Due times this dispatcher learned since the last claim began; the store's
    # answer after that claim may predate them.
    _due_since_claim: int | None = field(init=False, default=None)
    _rescheduled: asyncio.Event | None = field(init=False, default=None)

    @property
    def active(self) -> bool:
        """Whether a signal source runs (False: the poll and due times alone)."""
        return self._task is not None

    @property
    def mode(self) -> str:
        """How this dispatcher wakes: "listen" (signals arrive), "starting" (the source
        has not confirmed yet), "poll" (the safety-net poll and due times only)."""
        if self.source is None or self.stats.listen_unavailable:
            return "poll"
        if self._task is not None and self._task.done():
            return "poll"
        return "listen" if self.stats.listening else "starting"

    def _event(self, name: str) -> None:
        self.stats.count(name)
        for hook in list(self.hooks):
            try:
                hook(name)
            except Exception:
                logger.exception("wakeup_hook_failed", wake_event=name)

    def _wake(self, reason: str) -> None:
        if self._signal is not None:
            self._signal.set()
        self._event(reason)

    async def start(self) -> None:
        self._signal = asyncio.Event()
        self._rescheduled = asyncio.Event()
        if self.source is not None:
            self._task = asyncio.create_task(self.source.run(self._wake, self._event))

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- around a claim ------------------------------------------------------------

    def before_claim(self) -> None:
        """Forget signals so far: the claim about to run sees everything they announced."""
        if self._signal is not None:
            self._signal.clear()
        self._due_since_claim = None

    def after_claim(self, claimed: int) -> None:
        self._event("claims")
        if claimed == 0:
            self._event("empty_claims")

    def next_due(self, at_ms: int | None) -> None:
        """The store's earliest due time after an empty claim: the whole truth as of
        that claim, so it replaces what this dispatcher knew before the claim."""
        self._due_ms = _earliest(at_ms, self._due_since_claim)

    def due_at(self, at_ms: int | None) -> None:
        """This dispatcher scheduled work for ``at_ms`` (a retry): wake by then."""
        if at_ms is None:
            return
        self._due_since_claim = _earliest(at_ms, self._due_since_claim)
        if self._due_ms is None or at_ms < self._due_ms:
            self._due_ms = at_ms
            if self._rescheduled is not None:
                self._rescheduled.set()  # a wait in progress recomputes its deadline

    # -- the wait ------------------------------------------------------------------

    def _timeout(self) -> tuple[float, str]:
        timeout, why = self.poll_seconds, "polled"
        if self._due_ms is not None:
            # +1 ms: the claim compares next_attempt_at <= now on the same clock.
            until_due = max(0.0, (self._due_ms - self.clock.now_ms() + 1) / 1000)
            if until_due < timeout:
                timeout, why = until_due, "due"
        return timeout, why

    async def wait(self, stop: asyncio.Event) -> str:
        """Wait for a signal, the next known due time, the poll, or ``stop``."""
        started = asyncio.get_running_loop().time()
        while True:
            if stop.is_set():
                return "stop"
            if self._signal is not None and self._signal.is_set():
                return "signal"
            timeout, why = self._timeout()
            if why == "polled":
                timeout -= asyncio.get_running_loop().time() - started
            if timeout <= 0:
                break
            events = [e for e in (stop, self._signal, self._rescheduled) if e is not None]
            if self._rescheduled is not None:
                self._rescheduled.clear()
            waiters = [asyncio.ensure_future(e.wait()) for e in events]
            try:
                done, _ = await asyncio.wait(
                    waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for w in waiters:
                    w.cancel()
            if not done:
                break
            # A signal or stop returns above; a new due time goes round again.
        if why == "due":
            self._due_ms = None
        self._event(why)
        return why


def _earliest(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


async def wait_any(*events: asyncio.Event, timeout: float) -> None:
    """Wait until one of ``events`` is set, or ``timeout`` seconds."""
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
