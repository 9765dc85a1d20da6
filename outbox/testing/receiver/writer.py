"""The receiver's one SQLite writer thread, with group commit."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


class Stopped(Exception):
    """The writer is closed: the receiver is stopping."""


class _Job:
    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[sqlite3.Connection], Any]) -> None:
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Lock()
        self.done.acquire()


class Writer:
    """The one writer: runs jobs on its own thread with group commit.

    Each job runs in its own SAVEPOINT (an exception rolls back that job alone); the jobs
    queued while the previous batch was committing share one ``COMMIT``, so one fsync
    serves many requests. A job's caller is released only after its batch committed, so
    nothing is answered before its writes are durable at the configured ``synchronous``.
    """

    _MAX_BATCH = 256

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._queue: list[_Job] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="outbox-receiver-writer")
        self._thread.daemon = True
        self._thread.start()

    def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        job = _Job(fn)
        with self._cv:
            if self._closed:
                raise Stopped
            self._queue.append(job)
            self._cv.notify()
        job.done.acquire()
        if job.error is not None:
            raise job.error
        result: _T = job.result
        return result

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        self._conn.close()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = self._queue[: self._MAX_BATCH]
                del self._queue[: self._MAX_BATCH]
            self._commit(batch)

    def _commit(self, batch: list[_Job]) -> None:
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            for job in batch:
                conn.execute("SAVEPOINT job")
                try:
                    job.result = job.fn(conn)
                except Exception as exc:  # the job's caller gets it; the batch goes on
                    conn.execute("ROLLBACK TO job")
                    job.error = exc
                conn.execute("RELEASE job")
            conn.execute("COMMIT")
        except Exception as exc:  # the commit itself failed: nobody's writes happened
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            for job in batch:
                job.error, job.result = exc, None
        finally:
            for job in batch:
                job.done.release()
