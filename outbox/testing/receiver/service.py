"""The receiving service: idempotency receipts, effects, the request log and the admin
routes, over one SQLite writer. It knows nothing of sockets (see :mod:`.server`)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Any, Literal

from outbox.testing.receiver.dialects import DIALECTS, Dialect
from outbox.testing.receiver.faults import (
    AFTER_COMMIT_KINDS,
    HANG_KINDS,
    FaultPlan,
    Rule,
    apply_fault_spec,
)
from outbox.testing.receiver.records import connect, init_db, json_bytes, mark_stuck, now_ms
from outbox.testing.receiver.writer import Stopped, Writer

Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]
#: Deliberate defects, for testing conformance checkers (see :class:`Receiver`).
Flaw = Literal["ignores_key", "caches_request_id", "accepts_changed_payload", "forgets_keys_after"]
FLAWS = ("ignores_key", "caches_request_id", "accepts_changed_payload", "forgets_keys_after")
SYNC_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")


def check_options(*, synchronous: str, flaw: str | None, key_ttl_seconds: float | None) -> None:
    """The options a receiver refuses (ValueError), in this process or before one is
    spawned."""
    if synchronous not in SYNC_LEVELS:
        raise ValueError(f"synchronous must be one of {SYNC_LEVELS}")
    if flaw is not None and flaw not in FLAWS:
        raise ValueError(f"flaw must be one of {FLAWS}")
    if flaw == "forgets_keys_after" and key_ttl_seconds is None:
        raise ValueError("flaw='forgets_keys_after' needs key_ttl_seconds")


#: A pluggable effect: ``handler(conn, tenant, method, path, json_body) -> (status, body)``.
#: It runs inside the transaction that records the effect row and completes the receipt;
#: it must not commit or roll back itself. Raise :class:`Refuse` to roll that back.
EffectHandler = Callable[[sqlite3.Connection, str, str, str, Any], tuple[int, Any]]

ADMIN_PREFIX = "/__receiver/"
LOOKUP_PREFIX = "/operations/"
OPERATION_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class Refuse(Exception):
    """Raised by an effect handler: roll the effect back and answer ``status``/``body``.

    The receipt is removed too, so the same key can be retried.
    """

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body


@dataclass(slots=True)
class Reply:
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
    content_type: str = ""


_Headers = tuple[tuple[str, str], ...]


class Service:
    """Receipts, effects, the request log and faults over one SQLite writer."""

    def __init__(
        self,
        db_path: Path,
        *,
        key_ttl_seconds: float | None,
        tenant_header: str,
        synchronous: Synchronous,
        handler: EffectHandler | None,
        plan: FaultPlan,
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
        conn = connect(db_path, writer=True)
        try:
            init_db(conn)
            conn.execute(f"PRAGMA synchronous={synchronous}")
            # A receipt left "processing" by a previous run never committed its effect.
            conn.execute("DELETE FROM receipts WHERE state = 'processing' AND stuck = 0")
            conn.execute("UPDATE requests SET outcome = 'interrupted' WHERE outcome = 'received'")
        except BaseException:
            conn.close()
            raise
        self._writer = Writer(conn)

    def close(self) -> None:
        self._writer.close()

    # ---------------------------------------------------------------- public entry

    def handle(self, method: str, target: str, headers: Message, body: bytes) -> Reply:
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
            return Reply(status, json_bytes({"error": outcome}), base)
        if req.key is None:
            self._log_only(req, "missing_key", 400)
            return Reply(400, json_bytes({"error": "missing_idempotency_key"}), base)
        return self._operation(req, base)

    def bad_request(self, method: str, target: str, headers: Message, detail: str) -> Reply:
        """Log and answer a request whose body could not be read."""
        request_id = headers.get("X-Request-ID")
        base: _Headers = (("X-Request-ID", request_id),) if request_id is not None else ()
        if not target.startswith(ADMIN_PREFIX):
            self._log_only(
                self._incoming(method, target, headers, request_id, b""), "bad_request", 400
            )
        return Reply(400, json_bytes({"error": "bad_request", "detail": detail}), base)

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
            arrived_at_ms=now_ms(),
            traceparent=headers.get("traceparent"),
            content_type=headers.get("Content-Type") or "",
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

    def _operation(self, req: _Incoming, base: _Headers) -> Reply:
        limited = self.plan.admit()
        if limited is not None:  # the rate limit: refused before any work
            status, headers = limited
            self._log_only(req, "rate_limited", status)
            body = {"error": "rate_limited", "detail": "too many requests"}
            return Reply(status, json_bytes(body), (*base, *headers))
        early = self.plan.take(frozenset({"fail_before_work"}), req.target, req.key)
        if early is not None:
            self._log_only(req, "fault:fail_before_work", early.status)
            return self._fail_reply(early, base)
        payload_hash, parsed, is_json = _canonical(req.method, req.target, req.body)
        if not is_json and _is_form(req.content_type):
            # Read as a form-reading API (Stripe, Twilio) reads it: the fields are what
            # the handler and the stored result see; the binding stays on the bytes.
            parsed, is_json = _form_fields(req.body), True
        if self._flaw == "ignores_key":  # flaw: no receipt at all, every request applies
            seq = self._writer.run(lambda conn: self._insert_log(conn, req, "received", None))
            return self._writer.run(
                lambda conn: self._apply(
                    conn, req, seq=seq, parsed=parsed, is_json=is_json, base=base
                )
            )
        # Transaction 1: log the arrival; find the receipt or claim the key ("processing").
        claim = self._writer.run(lambda conn: self._claim(conn, req, payload_hash, base))
        if isinstance(claim, Reply):
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
        except Stopped:
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
            return Reply(500, json_bytes(detail), base)

    def _claim(
        self, conn: sqlite3.Connection, req: _Incoming, payload_hash: str, base: _Headers
    ) -> Reply | int:
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
                hang = self.plan.take(HANG_KINDS, req.target, req.key, replay=True)
                if hang is not None:
                    self._set_outcome(conn, seq, "fault:hang_after_commit", None)
                    return Reply(0, action="hang")
            return reply
        stuck, random_fail = self.plan.draw_new_key()
        if random_fail is not None:
            self._set_outcome(conn, seq, "fault:fail_before_work", random_fail.status)
            return self._fail_reply(random_fail, base)
        if stuck:
            mark_stuck(conn, req.tenant, req.key)
            return self._in_progress(conn, seq, base)
        conn.execute(
            "INSERT INTO receipts (tenant, idempotency_key, payload_hash, state,"
            " created_at_ms) VALUES (?, ?, ?, 'processing', ?)",
            (req.tenant, req.key, payload_hash, req.arrived_at_ms),
        )
        return seq

    def _in_progress(self, conn: sqlite3.Connection, seq: int, base: _Headers) -> Reply:
        status = self._dialect.in_progress_status
        self._set_outcome(conn, seq, "in_progress", status)
        return Reply(status, json_bytes(self._dialect.in_progress_body), base)

    @staticmethod
    def _fail_reply(rule: Rule, base: _Headers) -> Reply:
        headers = base
        if rule.retry_after:
            headers = (*base, ("Retry-After", rule.retry_after))
        body = {"error": "injected_fault", "fault": "fail_before_work"}
        return Reply(rule.status, json_bytes(body), headers)

    def _existing(
        self,
        conn: sqlite3.Connection,
        seq: int,
        row: sqlite3.Row,
        payload_hash: str,
        base: _Headers,
    ) -> Reply:
        if row["state"] == "processing":
            return self._in_progress(conn, seq, base)
        dialect = self._dialect
        if row["payload_hash"] != payload_hash and self._flaw != "accepts_changed_payload":
            self._set_outcome(conn, seq, "conflict", dialect.conflict_status)
            return Reply(dialect.conflict_status, json_bytes(dialect.conflict_body), base)
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
        return Reply(status, str(row["response_body"]).encode(), headers)

    def _apply(
        self,
        conn: sqlite3.Connection,
        req: _Incoming,
        *,
        seq: int,
        parsed: Any,
        is_json: bool,
        base: _Headers,
    ) -> Reply:
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
            stored_body = json_bytes(body_value)
        except Exception as exc:  # any handler failure rolls the effect back
            conn.execute("ROLLBACK TO work")
            conn.execute("RELEASE work")
            conn.execute(
                "DELETE FROM receipts WHERE tenant = ? AND idempotency_key = ?",
                (req.tenant, key),
            )
            if isinstance(exc, Refuse):
                status, outcome, reply_body = exc.status, "refused", json_bytes(exc.body)
            else:
                status, outcome = 500, "handler_error"
                reply_body = json_bytes({"error": "handler_error", "detail": repr(exc)})
            self._set_outcome(conn, seq, outcome, status)
            return Reply(status, reply_body, base)
        conn.execute("RELEASE work")

        fault = self.plan.take(AFTER_COMMIT_KINDS, req.target, key) or self.plan.draw_after_commit()
        reply = Reply(status, stored_body, base)
        outcome = "applied"
        if fault is not None:
            outcome = "fault:" + fault.kind
            if fault.kind == "drop_after_commit":
                reply = Reply(0, action="drop")
            elif fault.kind == "hang_after_commit":
                reply = Reply(0, action="hang")
            elif fault.kind == "delay_after_commit":
                reply.action, reply.delay_seconds = "delay", fault.seconds
            else:  # fail_after_commit
                body = {"error": "injected_fault", "fault": "fail_after_commit"}
                reply = Reply(fault.status, json_bytes(body), base)
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
                now_ms(),
            ),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    # ---------------------------------------------------------------- lookup + admin

    def _lookup(self, req: _Incoming, base: _Headers) -> Reply:
        key = urllib.parse.unquote(req.path[len(LOOKUP_PREFIX) :])

        def job(conn: sqlite3.Connection) -> Reply:
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
            return Reply(status, json_bytes(body), base)

        return self._writer.run(job)

    def mark_stuck(self, tenant: str, key: str) -> None:
        self._writer.run(lambda conn: mark_stuck(conn, tenant, key))

    def _admin(self, method: str, path: str, body: bytes, base: _Headers) -> Reply:
        route = path[len(ADMIN_PREFIX) :].rstrip("/")
        if method == "GET" and route == "health":
            return Reply(200, json_bytes({"ok": True, "pid": os.getpid()}), base)
        if method == "GET" and route == "faults":
            return Reply(200, json_bytes({"faults": self.plan.describe()}), base)
        if method == "POST" and route == "faults/clear":
            self._on_clear()
            return Reply(200, json_bytes({"ok": True}), base)
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
                    apply_fault_spec(spec, self.plan, self.mark_stuck)
            except (ValueError, KeyError, TypeError) as exc:
                detail = {"error": "invalid_fault", "detail": str(exc)}
                return Reply(400, json_bytes(detail), base)
            return Reply(200, json_bytes({"ok": True}), base)
        return Reply(404, json_bytes({"error": "unknown_admin_route"}), base)


def _is_form(content_type: str) -> bool:
    media = content_type.split(";", maxsplit=1)[0].strip().lower()
    return media == "application/x-www-form-urlencoded"


def _form_fields(body: bytes) -> dict[str, Any]:
    """Form fields by name: a str, or a list of str for a repeated name."""
    fields: dict[str, Any] = {}
    text = body.decode("utf-8", errors="replace")
    for name, value in urllib.parse.parse_qsl(text, keep_blank_values=True):
        if name in fields:
            prior = fields[name]
            fields[name] = [*prior, value] if isinstance(prior, list) else [prior, value]
        else:
            fields[name] = value
    return fields


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
