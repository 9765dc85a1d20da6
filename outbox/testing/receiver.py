"""A real local HTTP receiver with idempotency receipts and fault injection.

The :class:`Receiver` is what a correct receiving API looks like from the outside: it
deduplicates operations on ``(tenant, Idempotency-Key)`` in the same SQLite transaction
as the effect, binds each key to its canonical payload, replays the stored response with
the *current* request's ``X-Request-ID``, and injects faults on demand. Its SQLite file
is the oracle: tests count effects by reading the file, never by trusting responses.

Tables in the SQLite file (stable; the soak's checker reads them with plain SQL):

``requests``
    One row per non-admin request, written at arrival and updated with its outcome:
    ``seq, arrived_at_ms, method, path, tenant, idempotency_key, request_id,
    body_sha256, outcome, status, traceparent`` (``status`` is NULL when no response was
    sent; ``traceparent`` is the W3C trace context header, if the request had one).
``receipts``
    ``tenant, idempotency_key, payload_hash, state ('processing'|'complete'),
    response_status, response_body, created_at_ms, stuck``.
``effects``
    One row per applied operation: ``id, tenant, idempotency_key, method, path, body,
    body_sha256, client_operation_id, request_id, created_at_ms``.

Request outcomes: ``applied``, ``replayed``, ``conflict`` (422, key reused with another
payload), ``in_progress`` (409), ``missing_key`` (400), ``refused`` (handler refused),
``handler_error``, ``lookup``, ``not_found``, ``method_not_allowed``, ``bad_request``,
``fault:<kind>`` for injected faults, ``received`` while a new key is being processed and
``interrupted`` for such rows found when the receiver starts again.

Admin routes (never logged, never create effects), all JSON:

``GET /__receiver/health``
    ``{"ok": true, "pid": N}``
``GET /__receiver/faults``
    ``{"faults": [spec, ...]}`` with the remaining ``times`` of each rule.
``POST /__receiver/faults``
    One spec or ``{"faults": [spec, ...]}``. A spec is ``{"kind": K, ...}`` where ``K``
    is a :class:`Faults` method name and the other fields are its keyword arguments
    (``times, probability, seed, key, path, status, retry_after, stored, seconds,
    tenant``). Answers 400 ``{"error": "invalid_fault", "detail": ...}`` when invalid.
``POST /__receiver/faults/clear``
    Same as :meth:`Faults.clear`.

Run it in its own process with ``python -m outbox.testing.receiver --db PATH --port N``
(see ``--help``); it prints ``listening http://HOST:PORT`` and serves until SIGTERM or
SIGINT. :meth:`Receiver.spawn` does that and returns a :class:`RemoteReceiver`.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import hashlib
import http.client
import json
import os
import random
import select
import shutil
import signal
import socket
import socketserver
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, Literal, Self, TypeVar

from outbox.testing.dialects import DIALECTS, Dialect, dialect_named

__all__ = [
    "Effect",
    "EffectHandler",
    "Faults",
    "RandomFaults",
    "Receipt",
    "Receiver",
    "Refuse",
    "RemoteReceiver",
    "RequestRecord",
    "main",
]

Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]
#: Deliberate defects, for testing conformance checkers (see :class:`Receiver`).
Flaw = Literal["ignores_key", "caches_request_id", "accepts_changed_payload", "forgets_keys_after"]
_FLAWS = ("ignores_key", "caches_request_id", "accepts_changed_payload", "forgets_keys_after")
_T = TypeVar("_T")

#: A pluggable effect: ``handler(conn, tenant, method, path, json_body) -> (status, body)``.
#: It runs inside the transaction that records the effect row and completes the receipt;
#: it must not commit or roll back itself. Raise :class:`Refuse` to roll that back.
EffectHandler = Callable[[sqlite3.Connection, str, str, str, Any], tuple[int, Any]]

ADMIN_PREFIX = "/__receiver/"
LOOKUP_PREFIX = "/operations/"
OPERATION_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_MAX_BODY_BYTES = 16 * 1024 * 1024
# Another process (a checker, a RemoteReceiver reading effects) may hold the file briefly;
# wait for it instead of failing a request with "database is locked".
_BUSY_TIMEOUT_SECONDS = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    seq INTEGER PRIMARY KEY,
    arrived_at_ms INTEGER NOT NULL,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    tenant TEXT NOT NULL,
    idempotency_key TEXT,
    request_id TEXT,
    body_sha256 TEXT NOT NULL,
    outcome TEXT NOT NULL,
    status INTEGER,
    traceparent TEXT
);
CREATE INDEX IF NOT EXISTS requests_by_key ON requests (idempotency_key);
CREATE TABLE IF NOT EXISTS receipts (
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    payload_hash TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('processing', 'complete')),
    response_status INTEGER,
    response_body TEXT,
    created_at_ms INTEGER NOT NULL,
    stuck INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, idempotency_key)
);
CREATE TABLE IF NOT EXISTS effects (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    body TEXT NOT NULL,
    body_sha256 TEXT NOT NULL,
    client_operation_id TEXT,
    request_id TEXT,
    created_at_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS effects_by_key ON effects (tenant, idempotency_key);
"""


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class Effect:
    """One applied operation, as recorded by the receiver (the oracle)."""

    id: int
    tenant: str
    key: str
    method: str
    path: str
    #: The request body as text (UTF-8, undecodable bytes replaced).
    body: str
    body_sha256: str
    #: The JSON body's top-level ``operation_id`` (as text), if present.
    client_operation_id: str | None
    #: ``X-Request-ID`` of the request that applied it.
    request_id: str | None
    created_at_ms: int


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One row of the receiver's request log (admin routes excluded)."""

    seq: int
    arrived_at_ms: int
    method: str
    path: str
    tenant: str
    key: str | None
    request_id: str | None
    body_sha256: str
    #: ``applied``, ``replayed``, ``conflict``, ``in_progress``, ``fault:<kind>``, ...
    outcome: str
    #: The response status; None when the connection was dropped or held open.
    status: int | None
    #: The request's W3C ``traceparent`` header, if any.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class Receipt:
    """An idempotency receipt for ``(tenant, key)``."""

    tenant: str
    key: str
    payload_hash: str
    #: ``processing`` or ``complete``.
    state: str
    response_status: int | None
    response_body: str | None
    created_at_ms: int
    #: Left "processing" on purpose by :meth:`Faults.stuck_in_progress`.
    stuck: bool


class Refuse(Exception):
    """Raised by an effect handler: roll the effect back and answer ``status``/``body``.

    The receipt is removed too, so the same key can be retried.
    """

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body


@dataclass(frozen=True, kw_only=True)
class RandomFaults:
    """Independent per-new-key fault probabilities, drawn from one seeded generator.

    ``stuck`` and ``fail_before_work`` are drawn when an unseen key arrives; the
    after-commit faults when its effect commits (precedence when several hit: drop,
    stored 500, 500, delay).
    """

    seed: int = 0
    p_drop_after_commit: float = 0.0
    p_fail_before_work: float = 0.0
    p_fail_after_commit: float = 0.0
    p_stored_500: float = 0.0
    p_delay_after_commit: float = 0.0
    delay_seconds: float = 2.0
    p_stuck: float = 0.0
    #: ``Retry-After`` sent with random 503s; None sends none.
    retry_after: str | None = "1"

    def to_argv(self) -> list[str]:
        """The command-line flags that reproduce these settings."""
        argv = ["--seed", str(self.seed), "--delay-seconds", repr(self.delay_seconds)]
        for f in fields(self):
            if f.name.startswith("p_"):
                argv += ["--" + f.name.replace("_", "-"), repr(getattr(self, f.name))]
        argv += ["--retry-after", self.retry_after if self.retry_after is not None else ""]
        return argv


# --------------------------------------------------------------------------- faults


class _Default(enum.Enum):
    TOKEN = 0


_DEFAULT = _Default.TOKEN
_FAULT_KINDS = frozenset(
    {
        "drop_after_commit",
        "fail_before_work",
        "fail_after_commit",
        "delay_after_commit",
        "hang_after_commit",
        "stuck_in_progress",
    }
)
_HANG = frozenset({"hang_after_commit"})
_AFTER_COMMIT = frozenset(
    {"drop_after_commit", "fail_after_commit", "delay_after_commit", "hang_after_commit"}
)


class Faults:
    """Fault injection controls; the same API drives in-process and subprocess receivers.

    Rules are tried in the order they were added; at each stage the first matching rule
    that has ``times`` left (and wins its ``probability`` draw, if any) applies. ``key``
    and ``path`` narrow a rule to one Idempotency-Key or one path. After-commit faults
    apply only to requests that committed a new effect, never to replays.
    """

    def __init__(self, submit: Callable[[dict[str, Any]], None], clear: Callable[[], None]) -> None:
        self._submit = submit
        self._clear = clear

    @staticmethod
    def _times(times: int | _Default | None, probability: float | None) -> int | None:
        if times is _DEFAULT:
            return None if probability is not None else 1
        return times

    def drop_after_commit(
        self,
        times: int | _Default | None = _DEFAULT,
        *,
        probability: float | None = None,
        seed: int | None = None,
        path: str | None = None,
        key: str | None = None,
    ) -> None:
        """Commit the effect and receipt, then close the socket without a byte.

        ``times`` defaults to 1, or to unlimited when ``probability`` is given.
        """
        self._submit(
            {
                "kind": "drop_after_commit",
                "times": self._times(times, probability),
                "probability": probability,
                "seed": seed,
                "path": path,
                "key": key,
            }
        )

    def fail_before_work(
        self,
        status: int = 503,
        *,
        retry_after: str | None = "2",
        times: int | None = None,
        probability: float | None = None,
        seed: int | None = None,
        key: str | None = None,
        path: str | None = None,
    ) -> None:
        """Answer ``status`` (5xx or 429) before any work; ``times=None`` means always."""
        self._submit(
            {
                "kind": "fail_before_work",
                "status": status,
                "retry_after": retry_after,
                "times": times,
                "probability": probability,
                "seed": seed,
                "key": key,
                "path": path,
            }
        )

    def fail_after_commit(
        self,
        status: int = 500,
        *,
        times: int | _Default | None = _DEFAULT,
        stored: bool = False,
        probability: float | None = None,
        seed: int | None = None,
        key: str | None = None,
        path: str | None = None,
    ) -> None:
        """Commit the effect, then answer ``status``.

        With ``stored=True`` that error becomes the receipt's response, so every replay
        answers it too.
        """
        self._submit(
            {
                "kind": "fail_after_commit",
                "status": status,
                "times": self._times(times, probability),
                "stored": stored,
                "probability": probability,
                "seed": seed,
                "key": key,
                "path": path,
            }
        )

    def delay_after_commit(
        self,
        seconds: float,
        *,
        times: int | _Default | None = _DEFAULT,
        probability: float | None = None,
        seed: int | None = None,
        key: str | None = None,
        path: str | None = None,
    ) -> None:
        """Commit, sleep ``seconds``, then answer normally."""
        self._submit(
            {
                "kind": "delay_after_commit",
                "seconds": seconds,
                "times": self._times(times, probability),
                "probability": probability,
                "seed": seed,
                "key": key,
                "path": path,
            }
        )

    def hang_after_commit(
        self,
        *,
        times: int | None = None,
        probability: float | None = None,
        seed: int | None = None,
        key: str | None = None,
        path: str | None = None,
        replays: bool = False,
    ) -> None:
        """Commit, then never answer: the socket stays open until the receiver stops.

        With ``replays=True`` later requests for an already applied key hang as well.
        """
        self._submit(
            {
                "kind": "hang_after_commit",
                "replays": replays,
                "times": times,
                "probability": probability,
                "seed": seed,
                "key": key,
                "path": path,
            }
        )

    def stuck_in_progress(self, key: str, tenant: str = "") -> None:
        """Leave ``(tenant, key)``'s receipt "processing": every request with it gets 409.

        It is stored in the database, so it survives restarts; :meth:`clear` removes it.
        """
        self._submit({"kind": "stuck_in_progress", "key": key, "tenant": tenant})

    def clear(self) -> None:
        """Remove every fault: rules, random start-up faults, and stuck receipts."""
        self._clear()


@dataclass(slots=True)
class _Rule:
    kind: str
    times: int | None
    probability: float | None
    seed: int | None
    key: str | None
    path: str | None
    status: int
    retry_after: str | None
    stored: bool
    seconds: float
    rng: random.Random
    #: hang_after_commit only: also hang replays of a key already applied, so the
    #: receiver never answers that key again (a permanently hanging endpoint).
    replays: bool = False

    def matches(self, path: str, key: str | None) -> bool:
        if self.key is not None and self.key != key:
            return False
        return self.path is None or self.path in (path, path.split("?", 1)[0])

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "times": self.times,
            "probability": self.probability,
            "seed": self.seed,
            "key": self.key,
            "path": self.path,
            "status": self.status,
            "retry_after": self.retry_after,
            "stored": self.stored,
            "seconds": self.seconds,
            "replays": self.replays,
        }


def _opt(spec: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``spec[name]`` if present and of ``kind`` (bools are not numbers here), else None."""
    value = spec.get(name)
    if value is None:
        return None
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise ValueError(f"{name}: unexpected value {value!r}")
    return value


def _parse_rule(spec: Mapping[str, Any]) -> _Rule:
    """Validate one fault spec (see the module docstring) into a rule."""
    kind = spec.get("kind")
    if kind not in _FAULT_KINDS or kind == "stuck_in_progress":
        raise ValueError(f"unknown fault kind {kind!r}")
    known = {f.name for f in fields(_Rule)} - {"rng"} | {"kind"}
    unknown = set(spec) - known
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} for {kind}")
    times = _opt(spec, "times", int)
    if times is not None and times < 0:
        raise ValueError("times must be >= 0")
    probability = _opt(spec, "probability", (int, float))
    if probability is not None and not 0.0 <= probability <= 1.0:
        raise ValueError("probability must be within [0, 1]")
    seed = _opt(spec, "seed", int)
    default_status = 503 if kind == "fail_before_work" else 500
    status = _opt(spec, "status", int) or default_status
    if not 100 <= status <= 599:
        raise ValueError("status must be an HTTP status code")
    retry_after = _opt(spec, "retry_after", (str, int))
    stored = _opt(spec, "stored", bool) or False
    replays = _opt(spec, "replays", bool) or False
    if replays and kind != "hang_after_commit":
        raise ValueError("replays applies to hang_after_commit only")
    seconds = _opt(spec, "seconds", (int, float))
    if kind == "delay_after_commit" and (seconds is None or seconds < 0):
        raise ValueError("delay_after_commit needs seconds >= 0")
    return _Rule(
        kind=kind,
        times=times,
        probability=None if probability is None else float(probability),
        seed=seed,
        key=_opt(spec, "key", str),
        path=_opt(spec, "path", str),
        status=status,
        retry_after=None if retry_after is None else str(retry_after),
        stored=bool(stored),
        seconds=float(seconds or 0.0),
        rng=random.Random(seed),
        replays=bool(replays),
    )


class _FaultPlan:
    """The receiver-side fault state, shared by every request thread."""

    def __init__(self, random_faults: RandomFaults | None) -> None:
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._random = random_faults
        self._rng = random.Random(random_faults.seed if random_faults else 0)

    def add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self._random = None

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            return [rule.describe() for rule in self._rules]

    def take(
        self, kinds: frozenset[str], path: str, key: str | None, *, replay: bool = False
    ) -> _Rule | None:
        """The first matching rule of ``kinds`` that fires now, with one use consumed.

        For a replay only rules marked ``replays`` apply.
        """
        with self._lock:
            for rule in self._rules:
                if rule.kind not in kinds or rule.times == 0 or not rule.matches(path, key):
                    continue
                if replay and not rule.replays:
                    continue
                if rule.probability is not None and rule.rng.random() >= rule.probability:
                    continue
                if rule.times is not None:
                    rule.times -= 1
                return rule
            return None

    def draw_new_key(self) -> tuple[bool, _Rule | None]:
        """Random start-up faults for an unseen key: (stuck, fail-before-work rule)."""
        with self._lock:
            rf = self._random
            if rf is None:
                return False, None
            stuck = self._rng.random() < rf.p_stuck
            fail = self._rng.random() < rf.p_fail_before_work
        if stuck:
            return True, None
        if fail:
            return False, _parse_rule(
                {"kind": "fail_before_work", "status": 503, "retry_after": rf.retry_after}
            )
        return False, None

    def draw_after_commit(self) -> _Rule | None:
        """Random start-up after-commit fault for a key whose effect just committed."""
        with self._lock:
            rf = self._random
            if rf is None:
                return None
            drop = self._rng.random() < rf.p_drop_after_commit
            stored = self._rng.random() < rf.p_stored_500
            fail = self._rng.random() < rf.p_fail_after_commit
            delay = self._rng.random() < rf.p_delay_after_commit
        if drop:
            return _parse_rule({"kind": "drop_after_commit"})
        if stored:
            return _parse_rule({"kind": "fail_after_commit", "stored": True})
        if fail:
            return _parse_rule({"kind": "fail_after_commit"})
        if delay:
            return _parse_rule({"kind": "delay_after_commit", "seconds": rf.delay_seconds})
        return None


# --------------------------------------------------------------------------- the engine


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _connect(db_path: Path, *, writer: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(
        db_path,
        timeout=_BUSY_TIMEOUT_SECONDS,
        isolation_level=None,
        check_same_thread=not writer,
    )
    conn.row_factory = sqlite3.Row
    return conn


def _init_db(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(_SCHEMA)


def _mark_stuck(conn: sqlite3.Connection, tenant: str, key: str) -> None:
    conn.execute(
        "INSERT INTO receipts (tenant, idempotency_key, payload_hash, state, created_at_ms,"
        " stuck) VALUES (?, ?, '', 'processing', ?, 1) ON CONFLICT (tenant, idempotency_key)"
        " DO UPDATE SET state = 'processing', stuck = 1",
        (tenant, key, _now_ms()),
    )


@dataclass(slots=True)
class _Reply:
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    #: respond | drop | hang | delay (then respond)
    action: str = "respond"
    delay_seconds: float = 0.0


@dataclass(slots=True)
class _Incoming:
    method: str
    target: str
    path: str
    tenant: str
    key: str | None
    request_id: str | None
    body: bytes
    body_sha256: str
    arrived_at_ms: int
    traceparent: str | None = None


class _Stopped(Exception):
    """The writer is closed: the receiver is stopping."""


class _Job:
    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[sqlite3.Connection], Any]) -> None:
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Lock()
        self.done.acquire()


class _Writer:
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
                raise _Stopped
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


_Headers = tuple[tuple[str, str], ...]


class _Service:
    """Receipts, effects, the request log and faults over one SQLite writer."""

    def __init__(
        self,
        db_path: Path,
        *,
        key_ttl_seconds: float | None,
        tenant_header: str,
        synchronous: Synchronous,
        handler: EffectHandler | None,
        plan: _FaultPlan,
        on_clear: Callable[[], None],
        flaw: Flaw | None = None,
        dialect: Dialect = DIALECTS["ietf"],
    ) -> None:
        self._ttl_ms = None if key_ttl_seconds is None else int(key_ttl_seconds * 1000)
        self._flaw = flaw
        self._dialect = dialect
        self._tenant_header = tenant_header
        self._handler = handler
        self.plan = plan
        self._on_clear = on_clear
        conn = _connect(db_path, writer=True)
        try:
            _init_db(conn)
            conn.execute(f"PRAGMA synchronous={synchronous}")
            # A receipt left "processing" by a previous run never committed its effect.
            conn.execute("DELETE FROM receipts WHERE state = 'processing' AND stuck = 0")
            conn.execute("UPDATE requests SET outcome = 'interrupted' WHERE outcome = 'received'")
        except BaseException:
            conn.close()
            raise
        self._writer = _Writer(conn)

    def close(self) -> None:
        self._writer.close()

    # ---------------------------------------------------------------- public entry

    def handle(self, method: str, target: str, headers: Message, body: bytes) -> _Reply:
        request_id = headers.get("X-Request-ID")
        base: _Headers = (("X-Request-ID", request_id),) if request_id is not None else ()
        path = target.split("?", 1)[0]
        if path.startswith(ADMIN_PREFIX):
            return self._admin(method, path, body, base)
        req = self._incoming(method, target, headers, request_id, body)
        if method == "GET" and path.startswith(LOOKUP_PREFIX):
            return self._lookup(req, base)
        if method not in OPERATION_METHODS:
            status, outcome = (404, "not_found") if method == "GET" else (405, "method_not_allowed")
            self._log_only(req, outcome, status)
            return _Reply(status, _json_bytes({"error": outcome}), base)
        if req.key is None:
            self._log_only(req, "missing_key", 400)
            return _Reply(400, _json_bytes({"error": "missing_idempotency_key"}), base)
        return self._operation(req, base)

    def bad_request(self, method: str, target: str, headers: Message, detail: str) -> _Reply:
        """Log and answer a request whose body could not be read."""
        request_id = headers.get("X-Request-ID")
        base: _Headers = (("X-Request-ID", request_id),) if request_id is not None else ()
        if not target.startswith(ADMIN_PREFIX):
            self._log_only(
                self._incoming(method, target, headers, request_id, b""), "bad_request", 400
            )
        return _Reply(400, _json_bytes({"error": "bad_request", "detail": detail}), base)

    def _incoming(
        self, method: str, target: str, headers: Message, request_id: str | None, body: bytes
    ) -> _Incoming:
        return _Incoming(
            method=method,
            target=target,
            path=target.split("?", 1)[0],
            tenant=headers.get(self._tenant_header) or "",
            key=headers.get("Idempotency-Key") or None,
            request_id=request_id,
            body=body,
            body_sha256=hashlib.sha256(body).hexdigest(),
            arrived_at_ms=_now_ms(),
            traceparent=headers.get("traceparent"),
        )

    # ---------------------------------------------------------------- request log

    @staticmethod
    def _insert_log(
        conn: sqlite3.Connection, req: _Incoming, outcome: str, status: int | None
    ) -> int:
        cur = conn.execute(
            "INSERT INTO requests (arrived_at_ms, method, path, tenant, idempotency_key,"
            " request_id, body_sha256, outcome, status, traceparent)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                req.arrived_at_ms,
                req.method,
                req.target,
                req.tenant,
                req.key,
                req.request_id,
                req.body_sha256,
                outcome,
                status,
                req.traceparent,
            ),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def _log_only(self, req: _Incoming, outcome: str, status: int | None) -> None:
        self._writer.run(lambda conn: self._insert_log(conn, req, outcome, status))

    @staticmethod
    def _set_outcome(conn: sqlite3.Connection, seq: int, outcome: str, status: int | None) -> None:
        conn.execute(
            "UPDATE requests SET outcome = ?, status = ? WHERE seq = ?", (outcome, status, seq)
        )

    def _expired(self, row: sqlite3.Row, now_ms: int) -> bool:
        return (
            self._ttl_ms is not None
            and row["state"] == "complete"
            and now_ms - int(row["created_at_ms"]) >= self._ttl_ms
        )

    # ---------------------------------------------------------------- operations

    def _operation(self, req: _Incoming, base: _Headers) -> _Reply:
        early = self.plan.take(frozenset({"fail_before_work"}), req.target, req.key)
        if early is not None:
            self._log_only(req, "fault:fail_before_work", early.status)
            return self._fail_reply(early, base)
        payload_hash, parsed, is_json = _canonical(req.method, req.target, req.body)
        if self._flaw == "ignores_key":  # flaw: no receipt at all, every request applies
            seq = self._writer.run(lambda conn: self._insert_log(conn, req, "received", None))
            return self._writer.run(
                lambda conn: self._apply(
                    conn, req, seq=seq, parsed=parsed, is_json=is_json, base=base
                )
            )
        # Transaction 1: log the arrival; find the receipt or claim the key ("processing").
        claim = self._writer.run(lambda conn: self._claim(conn, req, payload_hash, base))
        if isinstance(claim, _Reply):
            return claim
        # Committed: until transaction 2 commits, a request with this key gets 409.
        # Transaction 2: one effect row and the completed receipt, atomically.
        seq = claim
        try:
            return self._writer.run(
                lambda conn: self._apply(
                    conn, req, seq=seq, parsed=parsed, is_json=is_json, base=base
                )
            )
        except _Stopped:
            raise
        except Exception as exc:
            # Transaction 2 rolled back whole: nothing applied; release the key.
            def release(conn: sqlite3.Connection) -> None:
                conn.execute(
                    "DELETE FROM receipts WHERE tenant = ? AND idempotency_key = ?"
                    " AND state = 'processing' AND stuck = 0",
                    (req.tenant, req.key),
                )
                self._set_outcome(conn, seq, "handler_error", 500)

            self._writer.run(release)
            detail = {"error": "internal_error", "detail": repr(exc)}
            return _Reply(500, _json_bytes(detail), base)

    def _claim(
        self, conn: sqlite3.Connection, req: _Incoming, payload_hash: str, base: _Headers
    ) -> _Reply | int:
        assert req.key is not None
        seq = self._insert_log(conn, req, "received", None)
        row = conn.execute(
            "SELECT * FROM receipts WHERE tenant = ? AND idempotency_key = ?",
            (req.tenant, req.key),
        ).fetchone()
        if row is not None and self._expired(row, req.arrived_at_ms):
            conn.execute(
                "DELETE FROM receipts WHERE tenant = ? AND idempotency_key = ?",
                (req.tenant, req.key),
            )
            row = None
        if row is not None:
            reply = self._existing(conn, seq, row, payload_hash, base)
            if row["state"] == "complete" and row["payload_hash"] == payload_hash:
                hang = self.plan.take(_HANG, req.target, req.key, replay=True)
                if hang is not None:
                    self._set_outcome(conn, seq, "fault:hang_after_commit", None)
                    return _Reply(0, action="hang")
            return reply
        stuck, random_fail = self.plan.draw_new_key()
        if random_fail is not None:
            self._set_outcome(conn, seq, "fault:fail_before_work", random_fail.status)
            return self._fail_reply(random_fail, base)
        if stuck:
            _mark_stuck(conn, req.tenant, req.key)
            return self._in_progress(conn, seq, base)
        conn.execute(
            "INSERT INTO receipts (tenant, idempotency_key, payload_hash, state,"
            " created_at_ms) VALUES (?, ?, ?, 'processing', ?)",
            (req.tenant, req.key, payload_hash, req.arrived_at_ms),
        )
        return seq

    def _in_progress(self, conn: sqlite3.Connection, seq: int, base: _Headers) -> _Reply:
        status = self._dialect.in_progress_status
        self._set_outcome(conn, seq, "in_progress", status)
        return _Reply(status, _json_bytes(self._dialect.in_progress_body), base)

    @staticmethod
    def _fail_reply(rule: _Rule, base: _Headers) -> _Reply:
        headers = base
        if rule.retry_after:
            headers = (*base, ("Retry-After", rule.retry_after))
        body = {"error": "injected_fault", "fault": "fail_before_work"}
        return _Reply(rule.status, _json_bytes(body), headers)

    def _existing(
        self,
        conn: sqlite3.Connection,
        seq: int,
        row: sqlite3.Row,
        payload_hash: str,
        base: _Headers,
    ) -> _Reply:
        if row["state"] == "processing":
            return self._in_progress(conn, seq, base)
        dialect = self._dialect
        if row["payload_hash"] != payload_hash and self._flaw != "accepts_changed_payload":
            self._set_outcome(conn, seq, "conflict", dialect.conflict_status)
            return _Reply(dialect.conflict_status, _json_bytes(dialect.conflict_body), base)
        status = dialect.replay_status or int(row["response_status"])
        self._set_outcome(conn, seq, "replayed", status)
        headers = (*base, ("Idempotent-Replayed", "true"))
        if self._flaw == "caches_request_id":  # flaw: the first request's X-Request-ID
            first = conn.execute(
                "SELECT request_id FROM effects WHERE tenant = ? AND idempotency_key = ?"
                " ORDER BY id LIMIT 1",
                (row["tenant"], row["idempotency_key"]),
            ).fetchone()
            cached = first["request_id"] if first is not None else None
            headers = (("X-Request-ID", cached or ""), ("Idempotent-Replayed", "true"))
        return _Reply(status, str(row["response_body"]).encode(), headers)

    def _apply(
        self,
        conn: sqlite3.Connection,
        req: _Incoming,
        *,
        seq: int,
        parsed: Any,
        is_json: bool,
        base: _Headers,
    ) -> _Reply:
        key = req.key
        assert key is not None
        conn.execute("SAVEPOINT work")
        try:
            effect_id = self._insert_effect(conn, req, parsed, is_json)
            if self._handler is None:
                status = 201
                body_value: Any = {
                    "effect_id": effect_id,
                    "tenant": req.tenant,
                    "key": key,
                    "received": parsed,
                }
            else:
                status, body_value = self._handler(conn, req.tenant, req.method, req.target, parsed)
            stored_body = _json_bytes(body_value)
        except Exception as exc:  # any handler failure rolls the effect back
            conn.execute("ROLLBACK TO work")
            conn.execute("RELEASE work")
            conn.execute(
                "DELETE FROM receipts WHERE tenant = ? AND idempotency_key = ?",
                (req.tenant, key),
            )
            if isinstance(exc, Refuse):
                status, outcome, reply_body = exc.status, "refused", _json_bytes(exc.body)
            else:
                status, outcome = 500, "handler_error"
                reply_body = _json_bytes({"error": "handler_error", "detail": repr(exc)})
            self._set_outcome(conn, seq, outcome, status)
            return _Reply(status, reply_body, base)
        conn.execute("RELEASE work")

        fault = self.plan.take(_AFTER_COMMIT, req.target, key) or self.plan.draw_after_commit()
        reply = _Reply(status, stored_body, base)
        outcome = "applied"
        if fault is not None:
            outcome = "fault:" + fault.kind
            if fault.kind == "drop_after_commit":
                reply = _Reply(0, action="drop")
            elif fault.kind == "hang_after_commit":
                reply = _Reply(0, action="hang")
            elif fault.kind == "delay_after_commit":
                reply.action, reply.delay_seconds = "delay", fault.seconds
            else:  # fail_after_commit
                body = {"error": "injected_fault", "fault": "fail_after_commit"}
                reply = _Reply(fault.status, _json_bytes(body), base)
                if fault.stored:
                    outcome = "fault:fail_after_commit_stored"
                    status, stored_body = fault.status, reply.body
        conn.execute(
            "UPDATE receipts SET state = 'complete', response_status = ?, response_body = ?"
            " WHERE tenant = ? AND idempotency_key = ?",
            (status, stored_body.decode(), req.tenant, key),
        )
        self._set_outcome(conn, seq, outcome, reply.status or None)
        return reply

    @staticmethod
    def _insert_effect(conn: sqlite3.Connection, req: _Incoming, parsed: Any, is_json: bool) -> int:
        operation_id: str | None = None
        if is_json and isinstance(parsed, dict) and parsed.get("operation_id") is not None:
            value = parsed["operation_id"]
            operation_id = value if isinstance(value, str) else json.dumps(value)
        cur = conn.execute(
            "INSERT INTO effects (tenant, idempotency_key, method, path, body, body_sha256,"
            " client_operation_id, request_id, created_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                req.tenant,
                req.key,
                req.method,
                req.target,
                req.body.decode("utf-8", errors="replace"),
                req.body_sha256,
                operation_id,
                req.request_id,
                _now_ms(),
            ),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    # ---------------------------------------------------------------- lookup + admin

    def _lookup(self, req: _Incoming, base: _Headers) -> _Reply:
        key = urllib.parse.unquote(req.path[len(LOOKUP_PREFIX) :])

        def job(conn: sqlite3.Connection) -> _Reply:
            row = conn.execute(
                "SELECT * FROM receipts WHERE tenant = ? AND idempotency_key = ?",
                (req.tenant, key),
            ).fetchone()
            body: dict[str, Any]
            if row is None or self._expired(row, req.arrived_at_ms):
                status, body = 404, {"state": "unknown_key"}
            elif row["state"] == "processing":
                status, body = 409, {"state": "processing"}
            else:
                status = 200
                response = {
                    "status": row["response_status"],
                    "body": json.loads(row["response_body"]),
                }
                body = {"state": "applied", "response": response}
            self._insert_log(conn, req, "lookup", status)
            return _Reply(status, _json_bytes(body), base)

        return self._writer.run(job)

    def mark_stuck(self, tenant: str, key: str) -> None:
        self._writer.run(lambda conn: _mark_stuck(conn, tenant, key))

    def _admin(self, method: str, path: str, body: bytes, base: _Headers) -> _Reply:
        route = path[len(ADMIN_PREFIX) :].rstrip("/")
        if method == "GET" and route == "health":
            return _Reply(200, _json_bytes({"ok": True, "pid": os.getpid()}), base)
        if method == "GET" and route == "faults":
            return _Reply(200, _json_bytes({"faults": self.plan.describe()}), base)
        if method == "POST" and route == "faults/clear":
            self._on_clear()
            return _Reply(200, _json_bytes({"ok": True}), base)
        if method == "POST" and route == "faults":
            try:
                payload = json.loads(body or b"null")
                specs = (
                    payload["faults"]
                    if isinstance(payload, dict) and "faults" in payload
                    else [payload]
                )
                if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
                    raise ValueError("expected a fault spec object or {'faults': [...]}")
                for spec in specs:
                    _apply_fault_spec(spec, self.plan, self.mark_stuck)
            except (ValueError, KeyError, TypeError) as exc:
                detail = {"error": "invalid_fault", "detail": str(exc)}
                return _Reply(400, _json_bytes(detail), base)
            return _Reply(200, _json_bytes({"ok": True}), base)
        return _Reply(404, _json_bytes({"error": "unknown_admin_route"}), base)


def _apply_fault_spec(
    spec: Mapping[str, Any], plan: _FaultPlan, mark_stuck: Callable[[str, str], None]
) -> None:
    """Apply one JSON fault spec to ``plan`` (stuck keys go through ``mark_stuck``)."""
    if spec.get("kind") == "stuck_in_progress":
        key, tenant = spec.get("key"), spec.get("tenant") or ""
        if not isinstance(key, str) or not key or not isinstance(tenant, str):
            raise ValueError("stuck_in_progress needs a key (and an optional tenant)")
        mark_stuck(tenant, key)
        return
    plan.add(_parse_rule(spec))


def _canonical(method: str, target: str, body: bytes) -> tuple[str, Any, bool]:
    """(payload hash, parsed JSON or None, whether the body was JSON)."""
    parsed: Any = None
    is_json = False
    canonical = body
    if body:
        try:
            parsed = json.loads(body)
        except ValueError:
            pass
        else:
            is_json = True
            canonical = json.dumps(
                parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False
            ).encode()
    digest = hashlib.sha256(f"{method.upper()} {target}\n".encode())
    digest.update(canonical)
    return digest.hexdigest(), parsed, is_json


# --------------------------------------------------------------------------- HTTP layer


class _BadBody(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "outbox-receiver/1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.untrack(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the request log lives in SQLite."""

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks: list[bytes] = []
            total = 0
            while True:
                line = self.rfile.readline(65537)
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError as exc:
                    raise _BadBody("bad chunk size") from exc
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                total += size
                if total > _MAX_BODY_BYTES:
                    raise _BadBody("body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline(3)
        length = self.headers.get("Content-Length")
        if not length:
            return b""
        try:
            n = int(length)
        except ValueError as exc:
            raise _BadBody("bad Content-Length") from exc
        if n < 0 or n > _MAX_BODY_BYTES:
            raise _BadBody("bad Content-Length")
        data = self.rfile.read(n)
        if len(data) != n:
            raise ConnectionResetError("client closed mid-body")
        return data

    def _dispatch(self) -> None:
        service = self.server.service
        try:
            try:
                body = self._read_body()
            except _BadBody as exc:
                self.close_connection = True
                reply = service.bad_request(self.command, self.path, self.headers, str(exc))
            else:
                reply = service.handle(self.command, self.path, self.headers, body)
        except _Stopped:
            self._abort()
            return
        except Exception as exc:  # answer rather than drop the socket
            detail = {"error": "internal_error", "detail": repr(exc)}
            reply = _Reply(500, _json_bytes(detail))
        if reply.action == "drop":
            self._abort()
        elif reply.action == "hang":
            self.server.stopping.wait()
            self._abort()
        elif reply.action == "delay" and self.server.stopping.wait(reply.delay_seconds):
            self._abort()
        else:
            self._send(reply)

    def _abort(self) -> None:
        """Close without sending a byte, with a reset rather than a graceful FIN."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def _send(self, reply: _Reply) -> None:
        reason = http.client.responses.get(reply.status, "")
        lines = [
            f"HTTP/1.1 {reply.status} {reason}",
            "Content-Type: application/json",
            f"Content-Length: {len(reply.body)}",
        ]
        # Echoed values (X-Request-ID) must not smuggle in header lines.
        lines += [f"{name}: {' '.join(value.splitlines())}" for name, value in reply.headers]
        if self.close_connection:
            lines.append("Connection: close")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", errors="replace")
        self.wfile.write(head if self.command == "HEAD" else head + reply.body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _dispatch


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # 64+ clients connect at once; a backlog of 5 drops SYNs

    def __init__(self, address: tuple[str, int], service: _Service) -> None:
        self.service = service
        self.stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the FQDN, which can stall on a slow resolver.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def track(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.add(sock)
            if self.stopping.is_set():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def untrack(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.discard(sock)

    def close_connections(self) -> None:
        with self._conns_lock:
            for sock in self._conns:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client went away or the receiver is stopping
        super().handle_error(request, client_address)


# --------------------------------------------------------------------------- public API


class _Oracle:
    """Reads a receiver's SQLite file directly: effects, receipts and the request log."""

    _db_path: Path

    @property
    def db_path(self) -> Path:
        """The receiver's SQLite file."""
        return self._db_path

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        # mode=rw: a missing file is an error, not a new empty database.
        uri = self._db_path.resolve().as_uri() + "?mode=rw"
        with contextlib.closing(
            sqlite3.connect(uri, uri=True, timeout=_BUSY_TIMEOUT_SECONDS)
        ) as conn:
            conn.row_factory = sqlite3.Row
            return conn.execute(sql, params).fetchall()

    @staticmethod
    def _where(filters: Mapping[str, Any]) -> tuple[str, list[Any]]:
        used = {column: value for column, value in filters.items() if value is not None}
        if not used:
            return "", []
        return " WHERE " + " AND ".join(f"{c} = ?" for c in used), list(used.values())

    def effects(self, tenant: str | None = None, key: str | None = None) -> list[Effect]:
        """Effect rows in id order, optionally narrowed to a tenant and/or a key."""
        where, params = self._where({"tenant": tenant, "idempotency_key": key})
        rows = self._query(f"SELECT * FROM effects{where} ORDER BY id", params)
        return [
            Effect(
                id=r["id"],
                tenant=r["tenant"],
                key=r["idempotency_key"],
                method=r["method"],
                path=r["path"],
                body=r["body"],
                body_sha256=r["body_sha256"],
                client_operation_id=r["client_operation_id"],
                request_id=r["request_id"],
                created_at_ms=r["created_at_ms"],
            )
            for r in rows
        ]

    def effect_count(self, key: str | None = None, tenant: str | None = None) -> int:
        """How many effects exist, optionally for one key and/or tenant."""
        where, params = self._where({"tenant": tenant, "idempotency_key": key})
        return int(self._query(f"SELECT count(*) FROM effects{where}", params)[0][0])

    def requests(self, key: str | None = None, tenant: str | None = None) -> list[RequestRecord]:
        """The request log in arrival order (admin routes are never logged)."""
        where, params = self._where({"tenant": tenant, "idempotency_key": key})
        rows = self._query(f"SELECT * FROM requests{where} ORDER BY seq", params)
        return [
            RequestRecord(
                seq=r["seq"],
                arrived_at_ms=r["arrived_at_ms"],
                method=r["method"],
                path=r["path"],
                tenant=r["tenant"],
                key=r["idempotency_key"],
                request_id=r["request_id"],
                body_sha256=r["body_sha256"],
                outcome=r["outcome"],
                status=r["status"],
                traceparent=r["traceparent"],
            )
            for r in rows
        ]

    def receipts(self, key: str | None = None, tenant: str | None = None) -> list[Receipt]:
        """Current receipts (expired ones may still be listed until touched)."""
        where, params = self._where({"tenant": tenant, "idempotency_key": key})
        rows = self._query(f"SELECT * FROM receipts{where} ORDER BY created_at_ms", params)
        return [
            Receipt(
                tenant=r["tenant"],
                key=r["idempotency_key"],
                payload_hash=r["payload_hash"],
                state=r["state"],
                response_status=r["response_status"],
                response_body=r["response_body"],
                created_at_ms=r["created_at_ms"],
                stuck=bool(r["stuck"]),
            )
            for r in rows
        ]


_SYNC_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")


class Receiver(_Oracle):
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
        if synchronous not in _SYNC_LEVELS:
            raise ValueError(f"synchronous must be one of {_SYNC_LEVELS}")
        if flaw is not None and flaw not in _FLAWS:
            raise ValueError(f"flaw must be one of {_FLAWS}")
        if flaw == "forgets_keys_after" and key_ttl_seconds is None:
            raise ValueError("flaw='forgets_keys_after' needs key_ttl_seconds")
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
        self._plan = _FaultPlan(random_faults)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.faults = Faults(self._submit_fault, self._clear_faults)
        """Fault injection controls (work whether or not the receiver is running)."""
        with contextlib.closing(_connect(self._db_path)) as conn:
            _init_db(conn)

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
        service = _Service(
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

    def _bind(self, service: _Service) -> _Server:
        if self._port == 0:
            return _Server((self._host, 0), service)
        deadline = time.monotonic() + 2.0
        while True:
            try:
                return _Server((self._host, self._port), service)
            except OSError:
                if time.monotonic() >= deadline:
                    return _Server((self._host, 0), service)  # the old port is taken
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------- faults

    def _mark_stuck(self, tenant: str, key: str) -> None:
        server = self._server
        if server is not None:
            server.service.mark_stuck(tenant, key)
            return
        with contextlib.closing(_connect(self._db_path)) as conn:
            _mark_stuck(conn, tenant, key)

    def _submit_fault(self, spec: dict[str, Any]) -> None:
        _apply_fault_spec(spec, self._plan, self._mark_stuck)

    def _clear_faults(self) -> None:
        self._plan.clear()
        with contextlib.closing(_connect(self._db_path)) as conn:
            conn.execute("DELETE FROM receipts WHERE stuck = 1")

    # ------------------------------------------------------------- subprocess

    @staticmethod
    def spawn(
        db_path: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        key_ttl_seconds: float | None = None,
        tenant_header: str = "X-Tenant",
        synchronous: Synchronous = "FULL",
        random_faults: RandomFaults | None = None,
        startup_timeout_seconds: float = 15.0,
        dialect: str = "ietf",
    ) -> RemoteReceiver:
        """Run ``python -m outbox.testing.receiver`` in its own process.

        The returned :class:`RemoteReceiver` owns the process (and the temporary database
        when ``db_path`` is None): :meth:`RemoteReceiver.close` ends both.
        """
        tmpdir = None
        if db_path is None:
            tmpdir = tempfile.mkdtemp(prefix="outbox-receiver-")
            db_path = Path(tmpdir) / "receiver.db"
        argv = [
            "--db",
            os.fspath(db_path),
            "--host",
            host,
            "--tenant-header",
            tenant_header,
            "--synchronous",
            synchronous,
            "--dialect",
            dialect_named(dialect).name,
        ]
        if key_ttl_seconds is not None:
            argv += ["--key-ttl", repr(key_ttl_seconds)]
        if random_faults is not None:
            argv += random_faults.to_argv()
        remote = RemoteReceiver.__new__(RemoteReceiver)
        remote._init(
            None, Path(db_path), argv=argv, port=port, tmpdir=tmpdir,
            startup_timeout_seconds=startup_timeout_seconds,
        )  # fmt: skip
        return remote


class RemoteReceiver(_Oracle):
    """A receiver in another process: faults go through its admin routes, while effects,
    receipts and the request log are read from its SQLite file directly.

    ``RemoteReceiver(url, db_path)`` attaches to a running receiver;
    :meth:`Receiver.spawn` starts one and returns a RemoteReceiver that owns it.
    """

    def __init__(self, url: str, db_path: str | os.PathLike[str]) -> None:
        self._init(url.rstrip("/"), Path(db_path))

    def _init(
        self,
        url: str | None,
        db_path: Path,
        *,
        argv: list[str] | None = None,
        port: int = 0,
        tmpdir: str | None = None,
        startup_timeout_seconds: float = 15.0,
    ) -> None:
        self._url = url
        self._db_path = db_path
        self._argv = argv
        self._port = port
        self._tmpdir = tmpdir
        self._startup_timeout = startup_timeout_seconds
        self._process: subprocess.Popen[bytes] | None = None
        self.faults = Faults(self._submit_fault, self._clear_faults)
        """Fault injection controls, sent to the receiver's admin routes."""
        if argv is not None:
            try:
                self.start()
            except BaseException:
                self.close()
                raise

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` of the receiver."""
        if self._url is None:
            raise RuntimeError("the receiver process is not running")
        return self._url

    @property
    def pid(self) -> int | None:
        """The process id when this object spawned the receiver and it is running."""
        return self._process.pid if self._process is not None else None

    def start(self) -> Self:
        """(Re)start the spawned process on the same database and, if possible, port."""
        if self._argv is None:
            raise RuntimeError("only a receiver made by Receiver.spawn can be started")
        if self._process is not None:
            return self
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "outbox.testing.receiver", *self._argv]
        process = subprocess.Popen(
            [*cmd, "--port", str(self._port)], stdout=subprocess.PIPE, env=env
        )
        self._process = process
        line = _read_line(process, self._startup_timeout)
        if not line.startswith("listening "):
            self.stop()
            raise RuntimeError(f"the receiver did not start (said {line!r})")
        self._url = line.split(" ", 1)[1].strip()
        self._port = urllib.parse.urlsplit(self._url).port or 0
        return self

    def stop(self) -> None:
        """SIGTERM the spawned process and wait for it (SIGKILL after 10 s)."""
        process = self._process
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def kill(self) -> None:
        """SIGKILL the spawned process (a crash, not a shutdown)."""
        process = self._process
        if process is not None:
            process.kill()
        self.stop()

    def close(self) -> None:
        """Stop a spawned process and delete its temporary database, if any."""
        self.stop()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _admin(self, method: str, route: str, payload: Any = None) -> Any:
        parts = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
        try:
            body = None if payload is None else _json_bytes(payload)
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, ADMIN_PREFIX + route, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        if response.status >= 400:
            raise ValueError(f"receiver admin {route}: {response.status} {data.decode()}")
        return json.loads(data)

    def health(self) -> bool:
        """Whether the receiver answers its health route."""
        try:
            return bool(self._admin("GET", "health")["ok"])
        except (OSError, ValueError, RuntimeError):
            return False

    def _submit_fault(self, spec: dict[str, Any]) -> None:
        self._admin("POST", "faults", spec)

    def _clear_faults(self) -> None:
        self._admin("POST", "faults/clear", {})


def _read_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    stream: IO[bytes] | None = process.stdout
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        return ""
    return stream.readline().decode(errors="replace")


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m outbox.testing.receiver``: serve until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m outbox.testing.receiver",
        description="A local HTTP receiver with idempotency receipts and fault injection.",
    )
    parser.add_argument("--db", required=True, help="SQLite file (created if missing)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--key-ttl", type=float, default=None, help="forget receipts after S s")
    parser.add_argument("--tenant-header", default="X-Tenant")
    parser.add_argument("--synchronous", default="FULL", choices=_SYNC_LEVELS)
    parser.add_argument("--dialect", default="ietf", choices=sorted(DIALECTS))
    parser.add_argument("--seed", type=int, default=0, help="seed of the random faults")
    for flag in (
        "drop-after-commit",
        "fail-before-work",
        "fail-after-commit",
        "stored-500",
        "delay-after-commit",
        "stuck",
    ):
        parser.add_argument(f"--p-{flag}", type=float, default=0.0, metavar="P")
    parser.add_argument("--delay-seconds", type=float, default=2.0)
    parser.add_argument("--retry-after", default="1", help="Retry-After of random 503s")
    args = parser.parse_args(argv)

    random_faults = RandomFaults(
        seed=args.seed,
        p_drop_after_commit=args.p_drop_after_commit,
        p_fail_before_work=args.p_fail_before_work,
        p_fail_after_commit=args.p_fail_after_commit,
        p_stored_500=args.p_stored_500,
        p_delay_after_commit=args.p_delay_after_commit,
        delay_seconds=args.delay_seconds,
        p_stuck=args.p_stuck,
        retry_after=args.retry_after or None,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with Receiver(
        args.db,
        host=args.host,
        port=args.port,
        key_ttl_seconds=args.key_ttl,
        tenant_header=args.tenant_header,
        synchronous=args.synchronous,
        random_faults=random_faults,
        dialect=args.dialect,
    ) as rx:
        print(f"listening {rx.url}", flush=True)
        while not stop.wait(0.2):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
