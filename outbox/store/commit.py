"""enqueue's own transaction: tell "not stored" from "the COMMIT's fate is unknown".

A failure *before* COMMIT is sent leaves nothing behind: the transaction rolls back.
A failure *of* COMMIT is different: the connection can drop after PostgreSQL applied the
COMMIT but before its answer arrived, and a caller told "not stored" would enqueue again
(a second operation, a second effect) or compensate for an effect that happened.

So when COMMIT itself fails, reconnect and establish the outcome:

* PostgreSQL: the transaction's ID, read before COMMIT, is looked up with
  ``pg_xact_status``: ``committed`` or ``aborted`` is the database's own word. While it
  is ``in progress`` (the server has not yet noticed the lost client), ask again.
* SQLite: a local file and a closed connection, but absent is not yet proof. A COMMIT
  whose write-ahead-log fsync failed has written its frames; SQLite does not count them,
  yet a recovery of the log (the next open after every process crashed) accepts them,
  and the operation is pending. So a write transaction of our own is committed first
  (``Store.seal_failed_commit``): once it has, no recovery can accept those frames, and
  what is there is final. While it cannot commit (the disk still fails), the outcome is
  unknown.
* In both, the rows are then looked up by (tenant, operation ID) and arguments hash.

Found: the operations are returned as stored. Provably absent: ``NotStoredError``. Not
established within :data:`COMMIT_CHECK_SECONDS` (the database stays unreachable, the
transaction stays in progress): ``StoreOutcomeUnknown``, whose message tells the caller to
enqueue again with the *same* operation ID, which is safe because enqueue is idempotent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, select
from sqlalchemy.exc import DBAPIError

from outbox.errors import NotStoredError, StoreError, StoreOutcomeUnknown
from outbox.store.direct import CommitFailed, LostBeforeCommit
from outbox.store.marker import close_slot, open_slot
from outbox.store.records import TxStatus
from outbox.store.tables import operations

if TYPE_CHECKING:
    from outbox.store.base import Store


def _logger() -> Any:
    # Imported on use: enqueue's happy path and read commands never load the logging.
    from outbox.base.logs import get_logger

    return get_logger("outbox.store")


T = TypeVar("T")

#: How long enqueue keeps trying to establish the outcome of a failed COMMIT before it
#: raises StoreOutcomeUnknown (reconnecting with backoff meanwhile).
COMMIT_CHECK_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class Key:
    """One operation the transaction created: what to look for after a failed COMMIT."""

    tenant: str
    operation_id: str
    args_sha256: str


def _not_stored(exc: BaseException) -> NotStoredError:
    return NotStoredError.because(getattr(exc, "orig", None) or exc)


def _once_more_if_lost(write: Callable[[], T]) -> T:
    """``write``; again on a fresh connection if the pooled one was found dead before
    COMMIT was sent (``LostBeforeCommit``: without a COMMIT nothing can be stored)."""
    try:
        return write()
    except LostBeforeCommit as lost:
        log_connection_replaced(getattr(lost.error, "orig", None) or lost.error)
    try:
        return write()
    except LostBeforeCommit as lost:
        raise _not_stored(lost.error) from lost.error


def write_and_commit(store: Store, work: Callable[[Connection], tuple[T, Sequence[Key]]]) -> T:
    """Run ``work`` in a write transaction of its own and commit it.

    ``work`` returns its result and the keys of the operations it *created* (not those
    it found already stored). Failures before COMMIT raise ``NotStoredError``; a failed
    COMMIT is resolved as described in the module docstring.

    A pooled connection found dead before COMMIT was sent (the server restarted or the
    network cut it since it was last used; see ``outbox.store.liveness``) is retried
    once on a fresh connection: without a COMMIT nothing can have been stored.
    """
    return _once_more_if_lost(lambda: _write_once(store, work))


def insert_and_commit(store: Store, row: dict[str, Any], key: Key) -> int | None:
    """One new operation in a transaction of its own, on the driver's connection
    (``Store.insert_own``): its primary key, or None when ``key`` is already stored
    (nothing written). Failures are told apart as :func:`write_and_commit` does: a dead
    pooled connection before COMMIT is replaced once; a failed COMMIT is resolved."""
    try:
        return _once_more_if_lost(lambda: store.insert_own(row))
    except CommitFailed as failed:
        log_commit_failed(failed.error, [key])
        if resolve_commit(store, failed.marker, [key], failed.error):
            return failed.pk
        raise _confirmed_not_committed(failed.error) from failed.error


def _write_once(store: Store, work: Callable[[Connection], tuple[T, Sequence[Key]]]) -> T:
    try:
        conn = store.engine.connect()
    except DBAPIError as exc:
        raise _not_stored(exc) from exc
    marker: str | None = None
    slot: dict[Any, Any] = {}
    try:
        try:
            conn.begin()
            slot = open_slot(conn)
            result, created = work(conn)
            marker = close_slot(slot)
        except (DBAPIError, StoreError) as exc:
            # The store names its own failures NotStoredError, the driver's error as cause.
            cause = exc if isinstance(exc, DBAPIError) else exc.__cause__
            if isinstance(cause, DBAPIError) and cause.connection_invalidated:
                raise LostBeforeCommit(cause) from cause
            if isinstance(exc, NotStoredError):
                raise
            raise _not_stored(exc) from exc
        try:
            conn.commit()
        except DBAPIError as exc:
            commit_error: DBAPIError = exc
        else:
            return result
    finally:
        close_slot(slot)
        # Closing rolls back whatever is still open; on a dead connection it discards it.
        # After this, the failed transaction can no longer commit from this side.
        try:
            conn.close()
        except DBAPIError:  # pragma: no cover - close of a broken connection
            conn.invalidate()
    if not created:
        # Nothing new was written: the operations were already stored before.
        return result
    log_commit_failed(commit_error.orig or commit_error, created)
    if resolve_commit(store, marker, created, commit_error):
        return result
    raise _confirmed_not_committed(commit_error.orig or commit_error) from commit_error


def _confirmed_not_committed(error: BaseException) -> NotStoredError:
    return NotStoredError.because(
        f"COMMIT failed ({error}) and the database confirms the transaction did not commit"
    )


def log_connection_replaced(error: BaseException) -> None:
    _logger().info(
        "enqueue_connection_replaced",
        error=type(error).__name__,
        detail="the pooled connection was dead before COMMIT; nothing was stored; "
        "writing again on a fresh connection",
    )


def log_commit_failed(error: BaseException, created: Sequence[Key]) -> None:
    _logger().warning(
        "enqueue_commit_failed",
        error=type(error).__name__,
        operation_id=created[0].operation_id,
        tenant=created[0].tenant,
        operations=len(created),
        detail="establishing whether the COMMIT took effect",
    )


def resolve_commit(
    store: Store, marker: str | None, created: Sequence[Key], error: BaseException
) -> bool:
    """True: committed (every created key is stored with its arguments); False: provably
    not committed. Raises StoreOutcomeUnknown when neither can be established."""
    deadline = time.monotonic() + COMMIT_CHECK_SECONDS
    delay = 0.05
    last: str = "no answer yet"
    sealed = False
    while True:
        try:
            status = store.commit_status(marker) if marker is not None else TxStatus.UNKNOWN
            # SQLite: the failed connection is closed; once a later write transaction
            # has committed, what is there is final (see the module docstring).
            sealed = sealed or (marker is None and store.seal_failed_commit())
            found = _find(store, created)
        except (DBAPIError, StoreError) as exc:
            cause = getattr(exc, "orig", None) or exc
            last = f"{type(cause).__name__}: {str(cause).strip()[:200]}"
            if marker is None and not sealed:
                last = f"no later write transaction could commit over its log frames ({last})"
        else:
            everything = found == len(created)
            if status is TxStatus.COMMITTED and everything:
                return True
            if status is TxStatus.ABORTED and found == 0:
                return False
            if marker is None and everything:
                return True
            if sealed and found == 0:
                return False
            last = f"transaction {status.value}, {found} of {len(created)} operation(s) found"
            if status is TxStatus.COMMITTED and not everything:
                break  # committed yet rows missing or different: do not guess
        if time.monotonic() + delay > deadline:
            break
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
    keys = tuple((k.tenant, k.operation_id) for k in created)
    named = ", ".join(repr(op_id) for _, op_id in keys[:5]) + (" ..." if len(keys) > 5 else "")
    _logger().error("enqueue_outcome_unknown", operations=len(created), detail=last)
    raise StoreOutcomeUnknown(
        f"COMMIT failed ({str(getattr(error, 'orig', None) or error).strip()[:200]}) and "
        f"whether operation(s) {named} were stored could not be established ({last}). They "
        "may be stored and sent. Enqueue again with the SAME operation ID(s): that returns "
        "them if stored and stores them if not. Do not use a new operation ID.",
        keys=keys,
    ) from error


def _find(store: Store, created: Sequence[Key]) -> int:
    """How many of ``created`` are stored with the same arguments hash."""
    found = 0
    with store.read() as conn:
        for key in created:
            sha = conn.execute(
                select(operations.c.args_sha256).where(
                    operations.c.tenant == key.tenant, operations.c.operation_id == key.operation_id
                )
            ).scalar()
            if sha == key.args_sha256:
                found += 1
    return found


class OwnWrites:
    """How an enqueue without ``connection=`` writes: in a short transaction of the
    outbox's own engine, committed here, a failed COMMIT resolved
    (:func:`write_and_commit`); a single new row may take the driver's direct path
    (:func:`insert_and_commit`, ``outbox.store.direct``)."""

    #: Whether one new row may take the direct path.
    direct = True

    def run(self, store: Store, work: Callable[[Connection], tuple[T, Sequence[Key]]]) -> T:
        result = write_and_commit(store, work)
        store.announce()  # committed: wake this process's dispatchers (SQLite)
        return result


class BorrowedWrites(OwnWrites):
    """Writes on a connection a host framework lends (``outbox.contrib.django``: Django's
    own), which commits them itself: any failure is "not stored"."""

    direct = False

    def __init__(self, connect: Callable[[], AbstractContextManager[Connection]]) -> None:
        self._connect = connect

    def run(self, store: Store, work: Callable[[Connection], tuple[T, Sequence[Key]]]) -> T:
        try:
            with self._connect() as conn:
                return work(conn)[0]
        except NotStoredError:
            raise
        except StoreError as exc:
            raise NotStoredError.because(exc) from exc
