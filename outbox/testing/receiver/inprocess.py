"""The receiver served on a background thread of this process."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Self

from outbox.testing.receiver.dialects import dialect_named
from outbox.testing.receiver.faults import FaultPlan, Faults, RandomFaults, apply_fault_spec
from outbox.testing.receiver.handle import ReceiverHandle
from outbox.testing.receiver.records import connect, init_db, mark_stuck
from outbox.testing.receiver.remote import RemoteReceiver
from outbox.testing.receiver.server import Server
from outbox.testing.receiver.service import (
    EffectHandler,
    Flaw,
    Service,
    Synchronous,
    check_options,
)


class Receiver(ReceiverHandle):
    """A local HTTP/1.1 receiver with idempotency receipts, run on a background thread.

    ``db_path=None`` uses a temporary file deleted by :meth:`close`. Use it as a context
    manager, or call :meth:`start` and :meth:`close`. :meth:`stop` then :meth:`start`
    restarts on the same file and, if it can be bound again, the same port.

    Every effect-applying request gets one effect row, written in the transaction that
    completes the receipt; ``handler`` (see :data:`EffectHandler`) then chooses the stored
    response and may add its own writes. Without one the response is 201
    ``{"effect_id", "tenant", "key", "received"}``.

    ``flaw`` makes it deliberately wrong, to test conformance checkers:
    ``"ignores_key"`` (no receipts: every request applies a new effect),
    ``"caches_request_id"`` (replays carry the first request's ``X-Request-ID``),
    ``"accepts_changed_payload"`` (a reused key with other arguments replays the first
    result with its 2xx instead of answering 422) and ``"forgets_keys_after"`` (an alias
    making ``key_ttl_seconds``, which it requires, explicit).

    ``dialect`` words the idempotency answers like a family of real receivers (see
    :mod:`outbox.testing.dialects`): ``"ietf"`` (the default), ``"article"``,
    ``"stripe-like"``, ``"detail"`` or ``"replay-409"``.
    """

    def __init__(
        self,
        db_path: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        key_ttl_seconds: float | None = None,
        tenant_header: str = "X-Tenant",
        synchronous: Synchronous = "FULL",
        handler: EffectHandler | None = None,
        random_faults: RandomFaults | None = None,
        flaw: Flaw | None = None,
        dialect: str = "ietf",
    ) -> None:
        self._dialect = dialect_named(dialect)
        check_options(synchronous=synchronous, flaw=flaw, key_ttl_seconds=key_ttl_seconds)
        self._flaw: Flaw | None = flaw
        self._tmpdir: str | None = None
        if db_path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="outbox-receiver-")
            db_path = Path(self._tmpdir) / "receiver.db"
        self._db_path = Path(db_path)
        self._host = host
        self._port = port
        self._key_ttl_seconds = key_ttl_seconds
        self._tenant_header = tenant_header
        self._synchronous: Synchronous = synchronous
        self._handler = handler
        self._random_faults = random_faults
        self._plan = FaultPlan(random_faults)
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.faults = Faults(self._submit_fault, self._clear_faults)
        """Fault injection controls (work whether or not the receiver is running)."""
        with contextlib.closing(connect(self._db_path)) as conn:
            init_db(conn)

    # ------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` (the port is known once started)."""
        if self._server is None and self._port == 0:
            raise RuntimeError("the receiver has not been started")
        return f"http://{self._host}:{self._port}"

    @property
    def port(self) -> int:
        """The bound port (0 before the first start when an ephemeral port was asked)."""
        return self._port

    @property
    def running(self) -> bool:
        """Whether the server is accepting connections."""
        return self._server is not None

    def start(self) -> Self:
        """Open the database and serve on a background thread. Idempotent."""
        if self._closed:
            raise RuntimeError("the receiver is closed")
        if self._server is not None:
            return self
        service = Service(
            self._db_path,
            key_ttl_seconds=self._key_ttl_seconds,
            tenant_header=self._tenant_header,
            synchronous=self._synchronous,
            handler=self._handler,
            plan=self._plan,
            on_clear=self._clear_faults,
            flaw=self._flaw,
            dialect=self._dialect,
        )
        try:
            server = self._bind(service)
        except BaseException:
            service.close()
            raise
        self._port = server.server_port
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"outbox-receiver:{self._port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def _bind(self, service: Service) -> Server:
        if self._port == 0:
            return Server((self._host, 0), service)
        deadline = time.monotonic() + 2.0
        while True:
            try:
                return Server((self._host, self._port), service)
            except OSError:
                if time.monotonic() >= deadline:
                    return Server((self._host, 0), service)  # the old port is taken
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop serving: release hung requests, close every connection and the database."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        server.shutdown()
        server.stopping.set()
        server.close_connections()
        server.server_close()  # joins the connection threads
        if thread is not None:
            thread.join()
        server.service.close()

    def close(self) -> None:
        """Stop, and delete the temporary database if this receiver made one."""
        self.stop()
        self._closed = True
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> Self:
        return self.start()

    # ------------------------------------------------------------- faults

    def _mark_stuck(self, tenant: str, key: str) -> None:
        server = self._server
        if server is not None:
            server.service.mark_stuck(tenant, key)
            return
        with contextlib.closing(connect(self._db_path)) as conn:
            mark_stuck(conn, tenant, key)

    def _submit_fault(self, spec: dict[str, Any]) -> None:
        apply_fault_spec(spec, self._plan, self._mark_stuck)

    def _clear_faults(self) -> None:
        self._plan.clear()
        with contextlib.closing(connect(self._db_path)) as conn:
            conn.execute("DELETE FROM receipts WHERE stuck = 1")

    # ------------------------------------------------------------- subprocess

    #: Run ``python -m outbox.testing.receiver`` in its own process: the same as
    #: :meth:`RemoteReceiver.spawn`, which returns a receiver owning that process.
    spawn = RemoteReceiver.spawn
