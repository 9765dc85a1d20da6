"""The receipts flow, bound to the handler's own transaction, and the plain function API.

One request with a key goes through three steps:

1. **claim** (a short transaction of its own, committed: the one extra round trip): the
   key is inserted under its :class:`Scope` as ``in_progress`` with a lease and the
   request's fingerprint. An existing row answers instead: its stored response
   (replayed, ``Idempotent-Replayed: true``), ``422`` for another fingerprint, ``409`` +
   ``Retry-After`` while its holder's lease runs. A holder whose lease ran out (a crashed
   receiver) is taken over;
2. **the handler** runs in a second transaction (``BEGIN IMMEDIATE`` on SQLite), on the
   connection the kit gives it;
3. **complete**: in that same transaction the response is stored on the claim (fenced by
   the claim's token: a handler that outlived its lease and was taken over stores
   nothing), then one COMMIT makes effect and receipt durable together. A handler
   exception rolls the transaction back and deletes the claim: the key is free.

A 5xx the handler returns is, by default, not stored: its transaction is rolled back and
the key released, so the client's retry (the outbox reads 500/502/503/504 as "retry")
runs the handler again. ``store_5xx=True`` keeps and replays it instead.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import OperationalError

import outbox.receiver.answers as answers  # noqa: PLR0402 (no package-import cycle)
import outbox.receiver.store as store  # noqa: PLR0402
from outbox.receiver.answers import Reply
from outbox.receiver.store import Scope


@dataclass(frozen=True, slots=True)
class Request:
    """The validated request the fingerprint covers."""

    method: str
    route: str
    body: bytes = b""
    content_type: str | None = None
    query: str = ""


@dataclass(frozen=True, slots=True)
class Identity:
    """Who asks, as the application's own authentication established it."""

    tenant: str
    principal: str


@dataclass(frozen=True, slots=True)
class Claim:
    """A key this request holds until it completes, fails or its lease ends."""

    scope: Scope
    key: str
    token: str


Handler = Callable[[Connection], Reply]


class Receipts:
    """Idempotency receipts beside the handler's effect, in one database.

    ``engine`` should come from :func:`outbox.create_engine` on SQLite (WAL,
    ``synchronous=FULL``, ``BEGIN IMMEDIATE``), so concurrent duplicates queue instead
    of failing; any PostgreSQL engine works.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        retention: timedelta = timedelta(hours=24),
        lease: timedelta = timedelta(seconds=30),
        store_5xx: bool = False,
        key_header: str = "Idempotency-Key",
        request_id_header: str = "X-Request-ID",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if retention <= timedelta(0) or lease <= timedelta(0):
            raise ValueError("retention and lease must be positive")
        self.engine = engine
        self.retention = retention
        self.lease = lease
        self.store_5xx = store_5xx
        self.key_header = key_header
        self.request_id_header = request_id_header
        self._clock = clock

    # -- set-up -------------------------------------------------------------------

    def migrate(self) -> None:
        """Create or upgrade the receipts table (its own Alembic version table)."""
        from outbox.receiver.migrate import upgrade

        upgrade(self.engine)

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    @property
    def retention_seconds(self) -> int:
        return int(self.retention.total_seconds())

    def declare(self, reply: Reply, request_id: str | None = None) -> Reply:
        """The headers every answer of a receipted route carries."""
        headers = dict(reply.headers)
        headers[answers.RETENTION_HEADER.lower()] = str(self.retention_seconds)
        if reply.replayed:
            headers[answers.REPLAYED_HEADER.lower()] = "true"
        if request_id:
            headers[self.request_id_header.lower()] = request_id
        return Reply(reply.status, headers, reply.body, reply.replayed)

    # -- the three steps -------------------------------------------------------------

    def check_key(self, key: str | None, *, required: bool = True) -> Reply | None:
        """``400`` for a missing (where required) or malformed key, else None."""
        if key is None or key == "":
            return answers.key_missing(self.key_header) if required else None
        return None if answers.valid_key(key) else answers.key_invalid(self.key_header)

    def claim(self, scope: Scope, key: str, request: Request) -> Claim | Reply:
        """Step 1: hold the key, or the answer that settles this request at once."""
        fp = answers.fingerprint(
            request.method, request.route, request.content_type, request.body, request.query
        )
        token = str(uuid.uuid4())
        lease_ms = int(self.lease.total_seconds() * 1000)
        try:
            for _ in range(3):  # a row released between our insert and read: try again
                with self.engine.begin() as conn:
                    now = self.now_ms()
                    if store.insert_claim(
                        conn, scope, key, fp=fp, token=token, now_ms=now, lease_ms=lease_ms
                    ):
                        return Claim(scope, key, token)
                    row = store.read_locked(conn, scope, key)
                    if row is None:
                        continue
                    answer = self._existing(row, fp, key, now)
                    if answer is not None:
                        return answer
                    if store.take_over(
                        conn,
                        scope,
                        key,
                        old_token=row.token,
                        fp=fp,
                        token=token,
                        now_ms=now,
                        lease_ms=lease_ms,
                    ):
                        return Claim(scope, key, token)
        except OperationalError as exc:
            if is_busy(exc):
                return answers.busy()
            raise
        return answers.busy()

    def _existing(self, row: store.Row, fp: str, key: str, now: int) -> Reply | None:
        """The answer an existing row gives, or None when it may be taken over."""
        if row.state == "done" and row.expired(now):
            return None  # forgotten: a resend after the retention is a new request
        if row.fingerprint != fp:
            return answers.payload_conflict(key)
        if row.state == "done":
            return Reply(row.status or 200, dict(row.headers), row.body, replayed=True)
        if row.lease_until_ms > now:
            return answers.in_progress(max(1, math.ceil((row.lease_until_ms - now) / 1000)))
        return None  # the holder's lease ran out: it crashed, nothing of it committed

    def transaction(self, claim: Claim) -> Connection:
        """Step 2's connection, its transaction begun (on SQLite: ``BEGIN IMMEDIATE``,
        so a lock wait fails here, before the handler, as a busy answer); end it through
        :meth:`finish` or :meth:`abort`, then close it."""
        del claim
        conn = self.engine.connect()
        try:
            conn.begin()
        except BaseException:
            conn.close()
            raise
        return conn

    def finish(self, claim: Claim, conn: Connection, reply: Reply) -> Reply:
        """Step 3: store ``reply`` on the claim and commit it with the effect."""
        if reply.status >= 500 and not self.store_5xx:
            self.abort(claim, conn)
            return reply
        now = self.now_ms()
        kept = store.complete(
            conn,
            claim.scope,
            claim.key,
            claim.token,
            status=reply.status,
            headers=answers.stored_headers(reply.headers),
            body=reply.body,
            now_ms=now,
            expires_ms=now + self.retention_seconds * 1000,
        )
        if not kept:
            # Our lease ran out and another request took the key over: our effect must
            # not commit beside its one.
            conn.rollback()
            return answers.in_progress(1)
        conn.commit()
        return reply

    def abort(self, claim: Claim, conn: Connection | None = None) -> None:
        """Roll the handler's transaction back and free the key."""
        if conn is not None and conn.in_transaction():
            conn.rollback()
        with self.engine.begin() as free:
            store.release(free, claim.scope, claim.key, claim.token)

    # -- the plain function API --------------------------------------------------------

    def handle(
        self,
        scope: Scope,
        key: str | None,
        request: Request,
        handler: Handler,
        *,
        request_id: str | None = None,
        required: bool = True,
    ) -> Reply:
        """Run ``handler(connection)`` at most once per key under ``scope``.

        Call it after the application's access check (the scope comes from it), and let
        the handler do its own version checks on the connection it is given: the receipt
        lookup comes between the two. A handler exception propagates, stores nothing and
        frees the key.
        """
        bad = self.check_key(key, required=required)
        if bad is not None:
            return self.declare(bad, request_id)
        if key is None or key == "":
            with self.engine.begin() as conn:
                return self.declare(handler(conn), request_id)
        got = self.claim(scope, key, request)
        if isinstance(got, Reply):
            return self.declare(got, request_id)
        try:
            conn = self.transaction(got)
        except OperationalError as exc:
            self.abort(got)
            if is_busy(exc):
                return self.declare(answers.busy(), request_id)
            raise
        with contextlib.closing(conn):
            try:
                reply = handler(conn)
            except BaseException:
                self.abort(got, conn)
                raise
            return self.declare(self.finish(got, conn, reply), request_id)

    # -- the status lookup and retention -----------------------------------------------

    def status(self, tenant: str, principal: str, key: str) -> Reply:
        """The answer of ``GET .../operations/{key}``, in the shape
        :func:`outbox.config.default_classify` reads: ``200 {"state": "applied",
        "response": {...}}``, ``409 {"state": "processing"}`` (+ ``Retry-After``),
        ``410 {"state": "expired"}`` (the receiver no longer knows: proves nothing) or
        ``404 {"state": "unknown"}``."""
        with self.engine.connect() as conn:
            row = store.lookup(conn, tenant, principal, key)
        now = self.now_ms()
        return self.declare(status_reply(row, now))

    def purge(
        self,
        *,
        older_than: timedelta | None = None,
        batch: int = 1000,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Delete receipts expired longer than ``older_than`` ago (default: all expired
        ones) and claims abandoned as long; ``progress(total_so_far)`` after each batch."""
        before = self.now_ms() - int((older_than or timedelta(0)).total_seconds() * 1000)
        total = 0
        for n in store.purge_batches(self.engine, before, batch):
            total += n
            if progress is not None:
                progress(total)
        return total


def status_reply(row: store.Row | None, now_ms: int) -> Reply:
    import json

    def doc(status: int, data: dict[str, object]) -> Reply:
        body = json.dumps(data, separators=(",", ":")).encode()
        return Reply(status, {"content-type": "application/json"}, body)

    if row is None:
        return doc(404, {"state": "unknown"})
    if row.state == "done" and row.expired(now_ms):
        return doc(410, {"state": "expired"})
    if row.state == "done":
        try:
            body: object = json.loads(row.body) if row.body else None
        except ValueError:
            body = row.body.decode("utf-8", "replace")
        return doc(200, {"state": "applied", "response": {"status": row.status, "body": body}})
    reply = doc(409, {"state": "processing"})
    reply.headers["retry-after"] = str(max(1, math.ceil((row.lease_until_ms - now_ms) / 1000)))
    return reply


def is_busy(exc: BaseException) -> bool:
    """A SQLite lock wait that ran past the busy timeout (any driver's wrapper)."""
    text = str(getattr(exc, "orig", None) or exc).lower()
    return "database is locked" in text or "database is busy" in text


__all__ = ["Claim", "Handler", "Identity", "Receipts", "Request", "is_busy", "status_reply"]
