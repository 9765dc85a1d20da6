"""The soak's checker: reads the outbox database and the receiver's file after a drain.

Each of RELIABILITY.md's sixteen checks is a count that must be zero. Nothing here
trusts a response or a dispatcher's summary: effects and arrivals come from the
receiver's own tables, states and attempts from the outbox's, and "terminal stays
terminal" from a trigger the soak installs on the outbox table (it records every write
to a settled row; the soak runs no operator, so any such write is a violation).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select, text

from outbox.store.tables import attempts as attempts_table
from outbox.store.tables import operations as operations_table
from tests.soak.app import SPECS, retention_seconds, window_seconds

CHECKS = (
    "O1_lost_intent",
    "O2_not_quiescent",
    "O3_duplicate_effects",
    "O4_false_success",
    "O5_false_failure",
    "O6_disagreement_outside_reconciliation",
    "O7_unresolved_without_evidence",
    "O8_sent_without_attempt",
    "O9_key_not_operation_id",
    "O10_request_id_reused",
    "O11_sent_after_window",
    "O12_sent_after_lease",
    "O13_settled_row_rewritten",
    "O14_attempt_bound_exceeded",
    "O15_payload_mismatch",
    "O16_secret_leaked",
)
SETTLED = ("succeeded", "failed", "unresolved", "cancelled")
SETTLED_WRITES = "soak_settled_writes"
APP_TABLE = "soak_orders"


# --------------------------------------------------------------------------- set-up SQL


def install_instruments(engine: Engine) -> None:
    """The trigger behind O13 and the application table the producer writes to."""
    states = ", ".join(f"'{s}'" for s in SETTLED)
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql(
                f"CREATE TABLE IF NOT EXISTS {SETTLED_WRITES} (id INTEGER PRIMARY KEY,"
                " op_pk INTEGER NOT NULL, old_state TEXT, new_state TEXT, old_reason TEXT,"
                " new_reason TEXT, at_ms INTEGER)"
            )
            conn.exec_driver_sql(
                f"CREATE TRIGGER IF NOT EXISTS soak_settled_write AFTER UPDATE ON"
                f" outbox_operations WHEN OLD.state IN ({states}) BEGIN"
                f" INSERT INTO {SETTLED_WRITES} (op_pk, old_state, new_state, old_reason,"
                " new_reason, at_ms) VALUES (OLD.id, OLD.state, NEW.state, OLD.reason,"
                " NEW.reason, NEW.updated_at); END"
            )
            conn.exec_driver_sql(
                f"CREATE TABLE IF NOT EXISTS {APP_TABLE} (id INTEGER PRIMARY KEY,"
                " tenant TEXT NOT NULL, operation_id TEXT NOT NULL)"
            )
        else:
            conn.exec_driver_sql(
                f"CREATE TABLE IF NOT EXISTS {SETTLED_WRITES} (id BIGSERIAL PRIMARY KEY,"
                " op_pk BIGINT NOT NULL, old_state TEXT, new_state TEXT, old_reason TEXT,"
                " new_reason TEXT, at_ms BIGINT)"
            )
            conn.exec_driver_sql(
                "CREATE OR REPLACE FUNCTION soak_settled_write() RETURNS trigger"
                f" LANGUAGE plpgsql AS $$ BEGIN INSERT INTO {SETTLED_WRITES} (op_pk,"
                " old_state, new_state, old_reason, new_reason, at_ms) VALUES (OLD.id,"
                " OLD.state, NEW.state, OLD.reason, NEW.reason, NEW.updated_at);"
                " RETURN NEW; END $$"
            )
            conn.exec_driver_sql(
                "CREATE TRIGGER soak_settled_write AFTER UPDATE ON outbox_operations"
                f" FOR EACH ROW WHEN (OLD.state IN ({states}))"
                " EXECUTE FUNCTION soak_settled_write()"
            )
            conn.exec_driver_sql(
                f"CREATE TABLE IF NOT EXISTS {APP_TABLE} (id BIGSERIAL PRIMARY KEY,"
                " tenant TEXT NOT NULL, operation_id TEXT NOT NULL)"
            )


# --------------------------------------------------------------------------- inputs


@dataclass
class Evidence:
    """What the checker is given besides the two databases."""

    acknowledged: Sequence[tuple[str, str]]
    rolled_back: Sequence[tuple[str, str]]
    via_caller: Sequence[tuple[str, str]]
    config: dict[str, Any]
    secret: str
    #: Files that must not contain the secret (SQLite files, dispatcher logs).
    scan_files: Sequence[Path] = ()
    log_files: Sequence[Path] = ()
    epsilon_ms: int = 1000


@dataclass
class Verdict:
    checks: dict[str, int]
    figures: dict[str, Any]
    #: A few examples per failed check, for the reader of a red run.
    examples: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(self.checks.values())


def _receiver_rows(path: Path, sql: str) -> list[sqlite3.Row]:
    uri = path.resolve().as_uri() + "?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=30)) as conn:
        conn.row_factory = sqlite3.Row
        return conn.execute(sql).fetchall()


def _json_equal(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a == b
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return a == b


def _scan_database_text(engine: Engine, secret: str) -> int:
    """PostgreSQL: the server's files are not ours to read; scan every row as text."""
    found = 0
    with engine.connect() as conn:
        for table in ("outbox_operations", "outbox_attempts", "outbox_audit", SETTLED_WRITES):
            found += int(
                conn.execute(
                    text(f"SELECT count(*) FROM {table} t WHERE strpos(t::text, :s) > 0"),
                    {"s": secret},
                ).scalar_one()
            )
    return found


def _log_lines(files: Iterable[Path]) -> tuple[Counter[str], int]:
    events: Counter[str] = Counter()
    bad = 0
    for path in files:
        if not path.exists():
            continue
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                # A SIGKILL can cut the very last line of a log short.
                if i != len(lines) - 1:
                    bad += 1
                continue
            if not isinstance(record, dict):
                bad += 1
                continue
            events[str(record.get("event"))] += 1
    return events, bad


#: Answers that throttle (``outbox.config.Throttle``): no attempt spent, no window begun.
THROTTLE_STATUSES = (429, 503)


def _may_start_window(attempt: Any) -> bool:
    if attempt.delivery == "not_sent":
        return False
    return not (attempt.delivery == "sent" and attempt.status_code in THROTTLE_STATUSES)


def check(engine: Engine, receiver_db: Path, ev: Evidence) -> Verdict:
    checks = dict.fromkeys(CHECKS, 0)
    examples: dict[str, list[Any]] = defaultdict(list)

    def bad(name: str, example: Any, n: int = 1) -> None:
        checks[name] += n
        if len(examples[name]) < 5:
            examples[name].append(example)

    o, a = operations_table, attempts_table
    with engine.connect() as conn:
        op_rows = conn.execute(select(o)).all()
        att_rows = conn.execute(select(a)).all()
        settled_writes = conn.execute(
            text(f"SELECT op_pk, old_state, new_state FROM {SETTLED_WRITES}")
        ).all()
        app_rows = conn.execute(text(f"SELECT tenant, operation_id FROM {APP_TABLE}")).all()

    ops = {(r.tenant, r.operation_id): r for r in op_rows}
    by_pk = {r.id: r for r in op_rows}
    attempts_of: dict[int, list[Any]] = defaultdict(list)
    by_request: dict[str, Any] = {}
    for r in att_rows:
        attempts_of[r.operation_pk].append(r)
        by_request[r.request_id] = r

    requests = _receiver_rows(receiver_db, "SELECT * FROM requests ORDER BY seq")
    effects = _receiver_rows(receiver_db, "SELECT * FROM effects ORDER BY id")
    receipts = {
        (r["tenant"], r["idempotency_key"]): r
        for r in _receiver_rows(receiver_db, "SELECT * FROM receipts")
    }

    # E(op): effects by the operation ID the client put in the body (so a client that
    # changes the key for one intent shows up), else by the key.
    effects_of: dict[tuple[str, str], list[sqlite3.Row]] = defaultdict(list)
    for e in effects:
        effects_of[(e["tenant"], e["client_operation_id"] or e["idempotency_key"])].append(e)

    cfg = ev.config

    def deadline(op: Any, first: int) -> int:
        spec = SPECS[op.endpoint]
        retention_ms = retention_seconds(cfg) * 1000
        margin_ms = min(300_000.0, retention_ms / 10)
        return int(first + min(window_seconds(cfg, spec) * 1000, retention_ms - margin_ms))

    # O1 no lost intent
    for key in ev.acknowledged:
        if key not in ops:
            bad("O1_lost_intent", key)
    # O2 quiescence
    for r in op_rows:
        if r.state in ("pending", "in_flight"):
            bad("O2_not_quiescent", (r.tenant, r.operation_id, r.state))
    # O3 no duplicate effect
    for key, rows in effects_of.items():
        if len(rows) > 1:
            bad("O3_duplicate_effects", (key, len(rows)), len(rows) - 1)
    # O4-O7, per operation
    for key, r in ops.items():
        n = len(effects_of.get(key, []))
        if r.state == "succeeded":
            receipt = receipts.get(key)
            if n != 1:
                bad("O4_false_success", (key, "effects", n))
            elif receipt is None or receipt["response_status"] != r.result_status:
                bad("O4_false_success", (key, "status", r.result_status))
            elif not _json_equal(r.result_body, receipt["response_body"]):
                bad("O4_false_success", (key, "body"))
        if r.state == "failed" and n != 0:
            bad("O5_false_failure", (key, n))
        if n == 1 and r.state not in ("succeeded", "unresolved"):
            bad("O6_disagreement_outside_reconciliation", (key, r.state))
        if r.state == "unresolved" and (not attempts_of.get(r.id) or not r.reason):
            bad("O7_unresolved_without_evidence", key)

    # Per request of the receiver's log.
    seen_ids: Counter[str] = Counter()
    sent_counted: Counter[int] = Counter()
    for q in requests:
        rid = q["request_id"]
        if rid is not None:
            seen_ids[rid] += 1
        att = by_request.get(rid) if rid is not None else None
        if att is None:
            bad("O8_sent_without_attempt", (q["seq"], rid, q["idempotency_key"]))
            if (q["tenant"], q["idempotency_key"]) not in ops:
                bad("O9_key_not_operation_id", (q["seq"], q["idempotency_key"]))
            continue
        op = by_pk[att.operation_pk]
        if q["idempotency_key"] != op.operation_id or q["tenant"] != op.tenant:
            bad("O9_key_not_operation_id", (op.operation_id, q["idempotency_key"]))
        # The window starts at the first attempt that may have reached the receiver:
        # not one proven not sent, nor one refused before work under the fleet's
        # throttle (429/503). Nothing of those was applied; each restarts the window.
        starts = [x.started_at for x in attempts_of[op.id] if _may_start_window(x)]
        late = q["arrived_at_ms"] - deadline(op, min(starts)) if starts else 0
        if late > ev.epsilon_ms:
            bad("O11_sent_after_window", (op.operation_id, late))
        after_lease = q["arrived_at_ms"] - att.lease_until
        if after_lease > ev.epsilon_ms:
            bad("O12_sent_after_lease", (op.operation_id, rid, after_lease))
        if q["status"] not in (409, *THROTTLE_STATUSES):  # refusals under throttle: free
            sent_counted[op.id] += 1
    for e in effects:
        if (
            e["client_operation_id"] is not None
            and e["client_operation_id"] != e["idempotency_key"]
        ):
            bad("O9_key_not_operation_id", (e["client_operation_id"], e["idempotency_key"]))
    # O10 fresh request ID per attempt
    for rid, n in seen_ids.items():
        if n > 1:
            bad("O10_request_id_reused", (rid, n), n - 1)
    # O13 terminal states stay terminal
    for op_pk in sorted({w.op_pk for w in settled_writes}):
        changes = [(w.old_state, w.new_state) for w in settled_writes if w.op_pk == op_pk]
        bad("O13_settled_row_rewritten", (by_pk[op_pk].operation_id, changes[:3]))
    # O14 attempt bound
    for r in op_rows:
        limit = SPECS[r.endpoint].max_attempts
        counted = sum(1 for x in attempts_of.get(r.id, []) if x.counted)
        if counted > limit or sent_counted[r.id] > limit:
            bad("O14_attempt_bound_exceeded", (r.operation_id, counted, sent_counted[r.id]))
    # O15 payload integrity
    for e in effects:
        key = (e["tenant"], e["client_operation_id"] or e["idempotency_key"])
        op = ops.get(key)
        if op is None:
            bad("O15_payload_mismatch", (key, "no such operation"))
            continue
        expected_path = SPECS[op.endpoint].prefix + op.path
        if (e["body"], e["method"], e["path"]) != (op.body or "", op.method, expected_path):
            bad("O15_payload_mismatch", (key, e["method"], e["path"]))
    # O16 secrets
    needle = ev.secret.encode()
    for path in list(ev.scan_files) + list(ev.log_files):
        if path.exists() and needle in path.read_bytes():
            bad("O16_secret_leaked", str(path))
    if engine.dialect.name == "postgresql":
        leaked_rows = _scan_database_text(engine, ev.secret)
        if leaked_rows:
            bad("O16_secret_leaked", f"{leaked_rows} rows", leaked_rows)

    # Extras: the caller's transaction is atomic with the intent.
    app = {(r.tenant, r.operation_id) for r in app_rows}
    requested = {(q["tenant"], q["idempotency_key"]) for q in requests}
    extras = {
        "rolled_back_but_stored_or_sent": sum(
            1 for k in ev.rolled_back if k in ops or k in app or k in requested
        ),
        "caller_row_without_intent": sum(1 for k in app if k not in ops),
        "intent_without_caller_row": sum(1 for k in ev.via_caller if k not in app),
    }
    events, unparseable = _log_lines(ev.log_files)
    extras["unparseable_log_lines"] = unparseable

    states = Counter(r.state for r in op_rows)
    reasons = Counter(r.reason for r in op_rows if r.state == "unresolved")
    figures = {
        "operations_stored": len(op_rows),
        "requests": len(requests),
        "attempts": len(att_rows),
        "effects": len(effects),
        "states": dict(sorted(states.items())),
        "reconciliation": dict(sorted(reasons.items())),
        "attempt_delivery": dict(sorted(Counter(str(r.delivery) for r in att_rows).items())),
        "receiver_outcomes": dict(sorted(Counter(q["outcome"] for q in requests).items())),
        "log_events": {
            k: events[k]
            for k in (
                "lease_expired",
                "lease_check_failed",
                "write_fenced",
                "attempt_crashed",
                "outcome_write_failed",
            )
        },
        "settled_transitions": len({w.op_pk for w in settled_writes if w.old_state != w.new_state}),
        "extras": extras,
    }
    return Verdict(checks=checks, figures=figures, examples=dict(examples))
