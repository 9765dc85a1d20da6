"""The dispatcher's database thread, and giving up on a database that stopped answering.

All store calls of a dispatcher run on one thread, so no transaction is ever open while
the event loop waits on HTTP. A database that stops answering (frozen server, a network
path that drops packets silently) leaves that thread blocked inside the driver, and no
driver call can be interrupted from outside. So the thread is a daemon (it cannot hold
the process open), and once a stop was requested a call that does not return within
the stop timeout is abandoned: every pending and later call raises
:class:`DatabaseUnresponsive`, the dispatcher logs it and exits non-zero, and the leases
it held expire on their own (safe: nothing it held is resent before that).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from outbox.errors import StoreError
from outbox.store.evidence import outcomes_applied

if TYPE_CHECKING:
    from outbox.store.base import Store
    from outbox.store.records import AttemptOutcome

T = TypeVar("T")

_Job = tuple[Callable[[], Any], "concurrent.futures.Future[Any]"]


class DatabaseUnresponsive(StoreError):
    """The database did not answer within the stop timeout; the dispatcher gave up."""


class DbThread:
    """One daemon thread running store calls in order, abandonable after a stop."""

    def __init__(self, name: str = "outbox-db") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._busy_since: float | None = None
        self._gave_up = asyncio.Event()
        self.stuck_seconds: float | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def gave_up(self) -> bool:
        return self._gave_up.is_set()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            self._busy_since = time.monotonic()
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                self._busy_since = None

    async def run(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        if self.gave_up:
            raise DatabaseUnresponsive("gave up on the database earlier in this stop")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((functools.partial(fn, **kwargs), future))
        result = asyncio.wrap_future(future)
        give_up: asyncio.Future[Any] = asyncio.ensure_future(self._gave_up.wait())
        try:
            waiters: set[asyncio.Future[Any]] = {result, give_up}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            give_up.cancel()
        if result.done():
            return result.result()
        result.cancel()
        raise DatabaseUnresponsive(
            f"the database did not answer for {self.stuck_seconds or 0:.1f}s after the stop"
        )

    async def watch(self, stop: asyncio.Event, timeout: float) -> None:
        """After ``stop``, give up once one call has been running ``timeout`` seconds
        past the later of its start and the stop."""
        await stop.wait()
        stopped = time.monotonic()
        while True:
            busy = self._busy_since
            if busy is not None:
                waited = time.monotonic() - max(busy, stopped)
                if waited >= timeout:
                    self.stuck_seconds = time.monotonic() - busy
                    self._gave_up.set()
                    return
                await asyncio.sleep(min(0.2, timeout - waited))
            else:
                await asyncio.sleep(0.2)

    def shutdown(self) -> None:
        """Let the thread end after its queued calls; never wait for a stuck one."""
        self._jobs.put(None)
        if not self.gave_up:
            self._thread.join()


def is_transient(exc: BaseException) -> bool:
    """A database failure worth retrying: the connection, a lock, a restart."""
    if isinstance(exc, DatabaseUnresponsive):
        return False
    if isinstance(exc, StoreError):
        exc = exc.__cause__ or exc
    if isinstance(exc, DBAPIError):
        return exc.connection_invalidated or isinstance(exc, OperationalError | InterfaceError)
    return isinstance(exc, StoreError)


def error_detail(exc: BaseException) -> str:
    """An error's first line for the log, never with statement parameters."""
    orig = getattr(exc, "orig", None) or getattr(exc.__cause__, "orig", None) or exc
    lines = str(orig).strip().splitlines()
    return lines[0][:300] if lines else type(orig).__name__


#: Outcome writes that fail on a transient database error are retried, with backoff
#: from the first to the max delay, at most this many times and only while the lease
#: of one of the batch's operations still holds.
_OUTCOME_TRIES = 30
_OUTCOME_RETRY_FIRST_SECONDS = 0.1
_OUTCOME_RETRY_MAX_SECONDS = 2.0


async def write_while_leased(
    write: Callable[[], Awaitable[set[int]]], *, lease_left: Callable[[], float], log: Any
) -> set[int]:
    """Run a fenced write (``write``: the pks it wrote); retry a transient database
    failure while ``lease_left()`` seconds of a lease still cover the next try (each
    write is fenced, so a late retry changes nothing).

    Given up, the leases expire and the next claim closes these attempts as unknown;
    nothing is resent before that, but the outcome is lost, so it tries hard first.
    """
    delay = _OUTCOME_RETRY_FIRST_SECONDS
    tries = 0
    while True:
        tries += 1
        try:
            return await write()
        except Exception as exc:
            left = lease_left()
            transient = is_transient(exc)
            if not transient or left < delay + 1.0 or tries >= _OUTCOME_TRIES:
                log.error("outcome_write_failed", tries=tries, error=type(exc).__name__,
                          detail=error_detail(exc), transient=transient,
                          exc_info=exc)  # fmt: skip
                return set()
            log.warning("outcome_write_retry", tries=tries, error=type(exc).__name__,
                        detail=error_detail(exc), retry_in_seconds=delay,
                        lease_left_seconds=round(left, 3))  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(delay * 2, _OUTCOME_RETRY_MAX_SECONDS)


async def applied_after_all(
    missing: list[AttemptOutcome], *, run_db: Any, store: Store, log: Any
) -> set[int]:
    """Of outcomes a lone write found fenced after their outcome+claim transaction
    failed, those the failed COMMIT had written after all: the attempt rows say
    (``outbox.store.evidence``), so the log and the summary match the database."""
    if not missing:
        return set()
    try:
        applied: set[int] = await run_db(outcomes_applied, store=store, outcomes=missing)
    except Exception as exc:
        log.warning("outcome_evidence_unreadable", error=type(exc).__name__,
                    detail=error_detail(exc), count=len(missing))  # fmt: skip
        return set()
    if applied:
        log.info("outcome_commit_applied", count=len(applied),
                 detail="the failed COMMIT had written these outcomes")  # fmt: skip
    return applied
