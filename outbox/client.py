"""The Outbox facade: register endpoints, enqueue intents, read them back, dispatch."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from outbox.aio import AsyncMethods, EnqueueHost
from outbox.base.keys import KeyRing
from outbox.canonical import (
    DEFAULT_MAX_BODY_BYTES,
    Checked,
    Intent,
    canonical_args,
    check_operation_id,
    check_ordering_key,
    check_tenant,
    scheduled,
)
from outbox.clock import Clock, OffsetClock, SystemClock
from outbox.config import DispatcherSettings, Endpoint
from outbox.errors import (
    ConfigurationError,
    OperationConflict,
    OperationNotFound,
    StoreError,
    ValidationError,
    WaitTimeout,
)
from outbox.model import Operation, State
from outbox.observe.wiring import ObservabilityMethods
from outbox.store import Store, store_for
from outbox.store.commit import Key, OwnWrites, insert_and_commit
from outbox.store.engine import outbox_engine
from outbox.store.migrate import ensure_schema
from outbox.store.rows import operation_row
from outbox.store.sealing import Sealer, looks_sealed
from outbox.transaction import INSIDE_A_TRANSACTION, TransactionMethods, connection_of

T = TypeVar("T")

if TYPE_CHECKING:
    # The dispatcher pulls in httpx and aiohttp: imported when dispatching, so that
    # reading an outbox (the operator's commands) starts fast.
    from outbox.dispatch.dispatcher import Dispatcher, DispatchSummary, TransportFactory
    from outbox.observe.metrics import OutboxMetrics
    from outbox.reconcile import Reconciler


class Outbox(AsyncMethods, TransactionMethods, ObservabilityMethods):
    """A durable outbox over a SQLite file or a PostgreSQL database.

    ``Outbox()`` uses ``./outbox.sqlite3``. On SQLite the schema is created or upgraded
    on open, through the bundled migrations; on PostgreSQL run ``outbox migrate`` first
    (several processes share that database, so schema changes are a deliberate step).
    With ``auto_migrate=False`` nothing is ever created: a missing SQLite file or a
    missing schema raises :class:`~outbox.errors.SchemaError`.

    ``schema`` (PostgreSQL only) keeps the outbox tables in that schema instead of the
    connection's default ``search_path`` (``outbox migrate --schema NAME`` creates it).
    """

    def __init__(
        self,
        db: str | URL | Engine | None = None,
        *,
        endpoints: Iterable[Endpoint] = (),
        clock: Clock | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        secret_headers: Iterable[str] = (),
        auto_migrate: bool | None = None,
        dispatcher: DispatcherSettings | None = None,
        transport_factory: TransportFactory | None = None,
        tracer_provider: Any = None,
        schema: str | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        self.engine, self._owns_engine = outbox_engine(
            db, schema=schema, create_file=auto_migrate is not False
        )
        try:
            is_sqlite = self.engine.dialect.name == "sqlite"
            ensure_schema(self.engine, create=is_sqlite if auto_migrate is None else auto_migrate)
            self.store: Store = store_for(self.engine)
            if clock is None:
                server_ms = self.store.server_time_ms()
                clock = SystemClock() if server_ms is None else OffsetClock(server_ms)
        except DBAPIError as exc:
            if self._owns_engine:
                self.engine.dispose()
            where = self.engine.url.render_as_string(hide_password=True)
            detail = str(exc.orig or exc).strip().splitlines() or [type(exc).__name__]
            raise StoreError(f"cannot open the outbox database {where}: {detail[0]}") from exc
        except BaseException:
            if self._owns_engine:
                self.engine.dispose()
            raise
        self.clock: Clock = clock
        self.keys = keys  # encryption at rest: docs/guide/encryption.md
        self.store.sealer = Sealer(keys)
        self.max_body_bytes = max_body_bytes
        self.secret_headers = tuple(secret_headers)
        self.dispatcher_settings = dispatcher or DispatcherSettings()
        self.transport_factory = transport_factory
        #: Where an enqueue without ``connection=`` writes (a subclass may lend its own).
        self.own_writes = OwnWrites()
        self._endpoints: dict[str, Endpoint] = {}
        self._metrics: OutboxMetrics | None = None
        # OpenTelemetry (outbox.observe.tracing): this provider, else the global one when an SDK
        # configured it. The API's no-op provider switches tracing off.
        self._tracer_provider = tracer_provider
        self._tracing_off = type(tracer_provider).__name__ == "NoOpTracerProvider"
        for endpoint in endpoints:
            self.register(endpoint)

    # -- configuration ------------------------------------------------------------

    def register(self, endpoint: Endpoint) -> Endpoint:
        """Make an endpoint known; operations name it, the URL and credentials stay here."""
        if not isinstance(endpoint, Endpoint):
            raise ConfigurationError("register() takes an Endpoint")
        existing = self._endpoints.get(endpoint.name)
        if existing is not None and existing != endpoint:
            raise ConfigurationError(f"endpoint {endpoint.name!r} is already registered")
        self._endpoints[endpoint.name] = endpoint
        if endpoint.tenant_max_in_flight:  # kept by the claim (store.fairness)
            self.store.tenant_caps[endpoint.name] = endpoint.tenant_max_in_flight
        return endpoint

    @property
    def endpoints(self) -> Mapping[str, Endpoint]:
        return dict(self._endpoints)

    def close(self) -> None:
        """Release the database connections this outbox opened."""
        if self._owns_engine:
            self.engine.dispose()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- enqueue ------------------------------------------------------------------

    def enqueue(
        self,
        *,
        endpoint: str,
        method: str,
        path: str,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        operation_id: str | None = None,
        tenant: str = "",
        ordering_key: str | None = None,
        connection: Any = None,
        priority: int = 0,
        not_before: datetime | None = None,
        data: Any = None,
        content: bytes | None = None,
        content_type: str | None = None,
        params: Any = None,
        form_style: str = "flat",
        files: Any = None,
        deliver_within: timedelta | None = None,
    ) -> Operation:
        """Record the intent to call ``endpoint``; it is sent later by a dispatcher.
        ``priority`` (higher first, within the tenant), ``not_before`` (an aware
        datetime: a scheduled send) and ``deliver_within`` (a positive timedelta: this
        operation's business deadline, in place of the endpoint policy's
        ``RetryPolicy.deliver_within``) are scheduling, not compared arguments.

        The body is one of ``json=``, ``data=`` (form fields, see :mod:`outbox.forms`
        and ``form_style``) or ``content=`` bytes with ``content_type=``; ``params=`` is
        the query. What is stored is what is sent. ``files=`` (multipart) is refused.

        With ``connection`` (a SQLAlchemy Connection or ORM Session) the operation is
        written in the caller's transaction and commits or rolls back with it; enqueue
        never commits it. Without, it commits in a transaction of its own.

        The same (tenant, operation ID) with the same arguments returns the stored
        operation and writes nothing; with other arguments it raises
        :class:`OperationConflict` and writes nothing. Bad input raises
        :class:`ValidationError` before anything is written.

        In its own transaction: returned means committed; :class:`NotStoredError` means
        provably not stored (enqueue again, with a new ID if you like);
        :class:`StoreOutcomeUnknown` means the COMMIT failed and its fate could not be
        established: enqueue again with the *same* operation ID. In the caller's
        transaction, a failed COMMIT is the caller's own ambiguity: re-running the whole
        transaction with the same operation ID is the safe recovery.
        """
        intent = Intent(
            endpoint, method, path, json, headers, operation_id, tenant, ordering_key,
            priority, not_before, data, content, content_type, params, form_style, files,
            deliver_within,
        )  # fmt: skip
        if connection is not None:
            return self._enqueue_on(connection_of(connection), intent)
        checked = self._validate(intent)
        if self.own_writes.direct and not self.store.statements_observed:
            op = self._enqueue_own(checked)
            if op is not None:
                return op

        def work(conn: Connection) -> tuple[Operation, list[Key]]:
            op, created = self._insert_checked_created(self._joined(conn), checked)
            return op, [_key(checked)] if created else []

        return self._write_own(work)

    def enqueue_many(self, intents: Sequence[Intent], *, connection: Any = None) -> list[Operation]:
        """Enqueue several operations in one transaction: all are stored, or none.

        Without ``connection`` the same guarantees as :meth:`enqueue` hold for the
        batch as a whole: ``NotStoredError`` means none was stored;
        ``StoreOutcomeUnknown`` means the COMMIT's fate could not be established, and
        the whole batch should be enqueued again with the same operation IDs.
        """
        # Validate everything first: a bad item must not leave the others half-done.
        checked = [self._validate(intent) for intent in intents]
        if connection is not None:
            return self._enqueue_many_on(connection_of(connection, "enqueue_many"), checked)

        def work(conn: Connection) -> tuple[list[Operation], list[Key]]:
            return self._enqueue_many_created(conn, checked)

        return self._write_own(work)

    def _write_own(self, work: Callable[[Connection], tuple[T, Sequence[Key]]]) -> T:
        """Run ``work`` in enqueue's own transaction, as :attr:`own_writes` commits it
        (a failed COMMIT resolved, never reported as "not stored" unproven)."""
        self._refuse_if_caller_holds_the_lock()
        return self.own_writes.run(self.store, work)

    def _enqueue_own(self, checked: Checked) -> Operation | None:
        """A new operation in a transaction of its own, sent on the driver's connection
        (``outbox.store.direct``: same row, same failure semantics, a fraction of the
        Python). None when the key is already stored: the general path then returns the
        stored operation or raises ``OperationConflict``."""
        self._refuse_if_caller_holds_the_lock()
        now = self.clock.now_ms()
        row = self._row(checked, now=now, traceparent=self._traceparent())
        pk = insert_and_commit(self.store, row, _key(checked))
        if pk is None:
            return None
        self.store.announce()  # committed: wake this process's dispatchers (SQLite)
        return self._new_operation(pk, checked, now=now)

    def _refuse_if_caller_holds_the_lock(self) -> None:
        if self.store.caller_holds_write_lock():
            raise ValidationError(INSIDE_A_TRANSACTION.format(path=self.engine.url.database))

    def _joined(self, conn: Connection) -> Connection:
        """The caller's connection, if it is on the kind of database this outbox uses."""
        if conn.dialect.name != self.engine.dialect.name:
            raise ValidationError(
                f"connection is to a {conn.dialect.name} database but this outbox stores "
                f"in {self.engine.dialect.name}: enqueue on a connection to the outbox's "
                "database"
            )
        return conn

    def _enqueue_many_on(self, conn: Connection, checked: list[Checked]) -> list[Operation]:
        """One multi-row INSERT for the new keys; keys already stored (or repeated within
        the batch) take enqueue's one-by-one path: the same result or OperationConflict."""
        return self._enqueue_many_created(conn, checked)[0]

    def _enqueue_many_created(
        self, conn: Connection, checked: list[Checked]
    ) -> tuple[list[Operation], list[Key]]:
        """:meth:`_enqueue_many_on`, and the keys this call created."""
        conn = self._joined(conn)
        now = self.clock.now_ms()
        traceparent = self._traceparent()
        inserted = self.store.insert_operations(
            conn, [self._row(c, now=now, traceparent=traceparent) for c in checked]
        )
        ops: list[Operation] = []
        created: list[Key] = []
        for c in checked:
            pk = inserted.pop((c.tenant, c.operation_id), None)
            if pk is not None:
                created.append(_key(c))
                ops.append(self._new_operation(pk, c, now=now))
            else:
                ops.append(self._insert_checked_created(conn, c)[0])
        return ops, created

    def _validate(self, intent: Intent) -> Checked:
        op_id = intent.operation_id if intent.operation_id is not None else str(uuid.uuid4())
        check_operation_id(op_id)
        tenant = check_tenant(intent.tenant)
        ordering_key = check_ordering_key(intent.ordering_key)
        if intent.endpoint not in self._endpoints:
            raise ValidationError(
                f"unknown endpoint {intent.endpoint!r}; registered: {sorted(self._endpoints)}"
            )
        problem = self._endpoints[intent.endpoint].tenant_problem(tenant, op_id)
        if problem is not None:
            raise ValidationError(problem)
        args = canonical_args(
            intent, max_body_bytes=self.max_body_bytes, secret_headers=self.secret_headers
        )
        if args.body_raw is not None and looks_sealed(args.body_raw):
            raise ValidationError(
                "content= has the exact shape of an outbox-encrypted value "
                "('sealed:1:<key>:<base64>:<base64>'); it would be read back as one"
            )
        if self.keys is not None:  # an HMAC fingerprint: compared without decryption
            args = dataclasses.replace(args, args_sha256=self.keys.fingerprint(args.args_sha256))
        return Checked(op_id, tenant, ordering_key, scheduled(args, intent))

    def _enqueue_on(self, conn: Connection, intent: Intent) -> Operation:
        return self._enqueue_checked(conn, self._validate(intent))

    def _enqueue_checked(self, conn: Connection, checked: Checked) -> Operation:
        """Store an intent :meth:`_validate` accepted, on the caller's connection (the
        async methods run this through ``AsyncConnection.run_sync``)."""
        return self._insert_checked_created(self._joined(conn), checked)[0]

    def _new_operation(self, pk: int, checked: Checked, *, now: int) -> Operation:
        """The operation a new pending row is (see :meth:`_row`)."""
        args = checked.args
        return Operation(
            pk=pk,
            tenant=checked.tenant,
            operation_id=checked.operation_id,
            endpoint=args.endpoint,
            method=args.method,
            path=args.path,
            headers=dict(args.headers),
            body=json.loads(args.body_json) if args.body_json is not None else None,
            body_raw=args.body_raw,
            state=State.PENDING,
            reason=None,
            ordering_key=checked.ordering_key,
            attempts_counted=0,
            attempts_total=0,
            created_at_ms=now,
            updated_at_ms=now,
            next_attempt_at_ms=max(now, args.not_before_ms or now),
            first_attempt_at_ms=None,
            window_started_at_ms=None,
            version=0,
            policy=self._endpoints[args.endpoint].policy_snapshot(),
            priority=args.priority,
            not_before_ms=args.not_before_ms,
            deliver_within_ms=args.deliver_within_ms,
        )

    def _row(self, checked: Checked, *, now: int, traceparent: str | None) -> dict[str, Any]:
        """The row of a new pending operation, with the endpoint's policy snapshot."""
        args = checked.args
        row = operation_row(
            tenant=checked.tenant,
            operation_id=checked.operation_id,
            args=args,
            ordering_key=checked.ordering_key,
            now_ms=now,
            traceparent=traceparent,
            policy=self._endpoints[args.endpoint].policy_snapshot(),
        )
        return self.store.sealer.seal_request(row)

    def _insert_checked_created(self, conn: Connection, checked: Checked) -> tuple[Operation, bool]:
        """The operation, and whether this call created it (False: it was stored before)."""
        now = self.clock.now_ms()
        row = self._row(checked, now=now, traceparent=self._traceparent())
        inserted = self.store.insert_operation(conn, row)
        if inserted.created:
            return self._new_operation(inserted.pk, checked, now=now), True
        op_id, tenant = checked.operation_id, checked.tenant
        if inserted.args_sha256 != checked.args.args_sha256:
            raise OperationConflict(
                f"operation {op_id!r} (tenant {tenant!r}) is already stored with different "
                "arguments; an operation ID names one intent. Use a new operation ID for a "
                "new intent.",
                tenant=tenant,
                operation_id=op_id,
            )
        # Read on the same connection: the row may be the caller's own, uncommitted.
        return self.store.operation_on(conn, tenant, op_id), False

    # -- reads --------------------------------------------------------------------

    def get(self, operation_id: str, *, tenant: str = "") -> Operation:
        """The operation with its attempt history; raises OperationNotFound
        (:meth:`find` returns None instead)."""
        op = self.find(operation_id, tenant=tenant)
        if op is None:
            raise OperationNotFound(f"no operation {operation_id!r} in tenant {tenant!r}")
        return op

    def find(self, operation_id: str, *, tenant: str = "") -> Operation | None:
        """The operation with its attempt history, or None if there is none."""
        return self.store.get_operation(check_tenant(tenant), check_operation_id(operation_id))

    def wait(
        self, operation_id: str, *, tenant: str = "", timeout: float = 30.0, poll: float = 0.05
    ) -> Operation:
        """Block until the operation is terminal or unresolved; raises WaitTimeout."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.store.get_state(check_tenant(tenant), check_operation_id(operation_id))
            if state is None:
                raise OperationNotFound(f"no operation {operation_id!r} in tenant {tenant!r}")
            if state.is_settled:
                return self.get(operation_id, tenant=tenant)
            if time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"operation {operation_id!r} is still {state.value} after {timeout}s"
                )
            time.sleep(poll)

    @property
    def reconcile(self) -> Reconciler:
        """Operator actions: list, show, resolve, requeue, cancel, purge, status."""
        from outbox.reconcile import Reconciler

        return Reconciler(self)

    # -- dispatch -----------------------------------------------------------------

    def dispatcher(self, settings: DispatcherSettings | None = None) -> Dispatcher:
        from outbox.dispatch.dispatcher import Dispatcher
        from outbox.reconcile.probe import settle_after_dispatch

        return Dispatcher(
            store=self.store,
            endpoints=self._endpoints,
            clock=self.clock,
            settings=settings or self.dispatcher_settings,
            transport_factory=self.transport_factory,
            on_unresolved=functools.partial(settle_after_dispatch, self),
            secret_headers=self.secret_headers,
            instrumentation=self._instrumentation(),
        )

    async def dispatch_once_async(self) -> DispatchSummary:
        return await self.dispatcher().run(once=True)

    def dispatch_once(self) -> DispatchSummary:
        """Claim one batch of due operations, send them and record the outcomes."""
        return asyncio.run(self.dispatch_once_async())

    async def run_dispatcher_async(
        self,
        *,
        concurrency: int | None = None,
        stop: asyncio.Event | None = None,
        until_empty: bool = False,
        on_progress: Callable[[DispatchSummary], None] | None = None,
    ) -> DispatchSummary:
        """Dispatch until ``stop`` is set (or, with ``until_empty``, until nothing is due
        and nothing is in flight). Requests in flight finish before it returns."""
        settings = self.dispatcher_settings
        if concurrency is not None:
            settings = dataclasses.replace(settings, concurrency=concurrency)
        return await self.dispatcher(settings).run(
            stop, until_empty=until_empty, on_progress=on_progress
        )

    def run_dispatcher(
        self,
        *,
        concurrency: int | None = None,
        stop: threading.Event | None = None,
        until_empty: bool = False,
        on_progress: Callable[[DispatchSummary], None] | None = None,
    ) -> DispatchSummary:
        """Dispatch until SIGTERM or SIGINT (or ``stop`` is set), then drain and return.

        ``until_empty``: return once nothing is due and nothing is in flight (for cron
        and batch jobs); retries scheduled for later stay pending for the next run.
        """

        async def main() -> DispatchSummary:
            loop = asyncio.get_running_loop()
            stopping = asyncio.Event()
            installed: list[signal.Signals] = []
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, stopping.set)
                    installed.append(sig)
            watcher = None
            if stop is not None:
                watcher = asyncio.create_task(_watch(stop, stopping))
            try:
                return await self.run_dispatcher_async(
                    concurrency=concurrency,
                    stop=stopping,
                    until_empty=until_empty,
                    on_progress=on_progress,
                )
            finally:
                for sig in installed:
                    loop.remove_signal_handler(sig)
                if watcher is not None:
                    watcher.cancel()

        return asyncio.run(main())


async def _watch(flag: threading.Event, stopping: asyncio.Event) -> None:
    while not flag.is_set():
        await asyncio.sleep(0.05)
    stopping.set()


if TYPE_CHECKING:
    # The mixins' view of the Outbox (outbox.aio.EnqueueHost) is one it satisfies.
    _host: type[EnqueueHost] = Outbox


def _key(checked: Checked) -> Key:
    """What to look for after a failed COMMIT of ``checked``."""
    return Key(checked.tenant, checked.operation_id, checked.args.args_sha256)
