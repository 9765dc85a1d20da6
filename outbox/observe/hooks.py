"""The dispatcher's instrumentation hooks: one small interface, a no-op by default.

The dispatcher calls these at fixed points (a claim, an attempt, an outcome). Metrics
(``outbox.observe.metrics``, prometheus_client) and traces (``outbox.observe.tracing``,
OpenTelemetry)
implement them in their own modules, imported only when they are switched on; with
neither, every hook is an empty method call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from outbox.clock import Clock
    from outbox.config import DispatcherSettings, Endpoint
    from outbox.model import Reason, State
    from outbox.store.base import Store
    from outbox.store.records import AttemptOutcome, Claimed, Recovered, StartedAttempt
    from outbox.wire.transport import AttemptResult

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Sending:
    """One request about to leave, as the hooks see it."""

    claimed: Claimed
    endpoint: Endpoint
    started: StartedAttempt
    #: The request's headers: a hook may add some (``traceparent``).
    headers: dict[str, str]


class RunningDispatcher(Protocol):
    """What instrumentation and heartbeats read of a running dispatcher
    (:class:`outbox.dispatch.dispatcher.Dispatcher`), so they need not import it."""

    @property
    def dispatcher_id(self) -> str: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def store(self) -> Store: ...

    @property
    def settings(self) -> DispatcherSettings: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def db_answered_at(self) -> float | None: ...

    @property
    def wake_mode(self) -> str: ...

    async def run_db(self, fn: Callable[..., _T], /, **kwargs: Any) -> _T: ...


class Instrumentation(Protocol):
    """What the dispatcher reports. Hooks must be cheap and must never raise.

    Every hook does nothing here: an instrumentation that subclasses this one
    implements only the hooks it needs."""

    def dispatcher_started(self, dispatcher: RunningDispatcher) -> None:
        """The dispatcher's loop runs (called inside it)."""
        return None

    def dispatcher_stopped(self, dispatcher: RunningDispatcher) -> None:
        """The dispatcher drained and stopped (called inside its loop)."""
        return None

    def claimed(
        self, claimed: Sequence[Claimed], recovered: Sequence[Recovered], started_ns: int
    ) -> Any:
        """A claim took operations (``recovered``: attempts closed by lease expiry).
        ``started_ns`` is when the claim began (``time.time_ns()``). Returns a batch
        handle passed back to :meth:`attempts_begun` and :meth:`attempt_started`."""
        return None

    def settled(
        self, pk: int, state: State, reason: Reason | None, now_ms: int, *, not_sent: bool
    ) -> None:
        """A claimed operation was settled without sending (window closed); ``not_sent``:
        a not-sent attempt was recorded with it as evidence (an unsendable operation)."""
        return None

    def attempts_begun(self, batch: Any, started: Sequence[StartedAttempt], now_ms: int) -> None:
        """The batch's attempt rows committed; the batch's own work is done."""
        return None

    def attempt_started(self, batch: Any, sending: Sending) -> Any:
        """A request is about to be sent; may add headers (``traceparent``)."""
        return None

    def attempt_sent(self, attempt: Any, result: AttemptResult) -> None:
        """The request came back (or failed): ``attempt`` is what attempt_started gave."""
        return None

    def outcome(self, out: AttemptOutcome, *, applied: bool, now_ms: int) -> None:
        """An attempt's outcome was written (``applied``) or fenced off (not)."""
        return None

    def status_lookup(self, endpoint: str, answer: str) -> None:
        """The receiver answered a status lookup for an unresolved operation."""
        return None


class NoInstrumentation(Instrumentation):
    """Every hook does nothing."""


NOTHING: Instrumentation = NoInstrumentation()


class Combined:
    """Several instrumentations (metrics and traces), called in order."""

    def __init__(self, parts: Sequence[Instrumentation]) -> None:
        self.parts = tuple(parts)

    def dispatcher_started(self, dispatcher: RunningDispatcher) -> None:
        for p in self.parts:
            p.dispatcher_started(dispatcher)

    def dispatcher_stopped(self, dispatcher: RunningDispatcher) -> None:
        for p in self.parts:
            p.dispatcher_stopped(dispatcher)

    def claimed(
        self, claimed: Sequence[Claimed], recovered: Sequence[Recovered], started_ns: int
    ) -> Any:
        return [p.claimed(claimed, recovered, started_ns) for p in self.parts]

    def settled(
        self, pk: int, state: State, reason: Reason | None, now_ms: int, *, not_sent: bool
    ) -> None:
        for p in self.parts:
            p.settled(pk, state, reason, now_ms, not_sent=not_sent)

    def _each(self, handles: Any) -> Sequence[Any]:
        return handles if handles is not None else [None] * len(self.parts)

    def attempts_begun(self, batch: Any, started: Sequence[StartedAttempt], now_ms: int) -> None:
        for p, b in zip(self.parts, self._each(batch), strict=True):
            p.attempts_begun(b, started, now_ms)

    def attempt_started(self, batch: Any, sending: Sending) -> Any:
        return [
            p.attempt_started(b, sending)
            for p, b in zip(self.parts, self._each(batch), strict=True)
        ]

    def attempt_sent(self, attempt: Any, result: AttemptResult) -> None:
        for p, a in zip(self.parts, self._each(attempt), strict=True):
            p.attempt_sent(a, result)

    def outcome(self, out: AttemptOutcome, *, applied: bool, now_ms: int) -> None:
        for p in self.parts:
            p.outcome(out, applied=applied, now_ms=now_ms)

    def status_lookup(self, endpoint: str, answer: str) -> None:
        for p in self.parts:
            p.status_lookup(endpoint, answer)


def combine(parts: Sequence[Instrumentation]) -> Instrumentation:
    """One instrumentation for the dispatcher: nothing, the only one, or all in order."""
    if not parts:
        return NOTHING
    if len(parts) == 1:
        return parts[0]
    return Combined(parts)
