"""Bulk output at scale (issue 29): a 500-operation dry run of ``reconcile requeue --all``
prints its refusals grouped by reason, with counts and the first few IDs, in fewer than
20 lines; ``--verbose`` and ``--json`` list every operation. The real CLI in a
subprocess, on a SQLite database whose rows are written here as SQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import func, insert, select

from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from outbox.store.tables import audit, operations

REPO = Path(__file__).resolve().parents[2]
HOUR = 3_600_000


def _build(url: str) -> None:
    engine = create_engine(url)
    upgrade(engine)
    now = int(time.time() * 1000)
    rows = []
    for i in range(500):
        # The first 300 were first attempted two days ago: the receiver (24 h retention)
        # has forgotten their key. The other 200 an hour ago: a requeue is safe.
        first = now - (48 if i < 300 else 1) * HOUR
        rows.append({
            "tenant": "", "operation_id": f"pay-{i:04d}", "endpoint": "payments",
            "method": "POST", "path": "/pay", "headers": "{}", "args_sha256": "x",
            "state": "unresolved", "reason": "retries_exhausted", "attempts_counted": 1,
            "attempts_total": 1, "first_attempt_at": first, "window_started_at": first,
            "created_at": first, "updated_at": now - HOUR + i,
            "policy_window_ms": HOUR, "policy_key_retention_ms": 24 * HOUR,
            "policy_margin_ms": 5 * 60_000, "policy_max_attempts": 5,
            "policy_in_progress_budget": 10,
        })  # fmt: skip
    with engine.begin() as conn:
        conn.execute(insert(operations), rows)
    engine.dispose()


def _run(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", "reconcile", "requeue", "--all", "--dry-run",
         "--note", "after the incident", *args],
        env={**os.environ, "OUTBOX_DB": url}, cwd=REPO, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def test_a_500_operation_dry_run_is_grouped_and_short(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'o.sqlite3'}"
    _build(url)
    done = _run(url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) < 20, done.stdout
    assert lines == [
        "dry run: requeue: 500 matched, would change 200, refused 300, changed by someone else 0",
        "  would change 200 -> pending (pay-0300, pay-0301, pay-0302, and 197 more)",
        "  refused 300: key retention passed: needs --accept-duplicate-risk (pay-0000, "
        "pay-0001, pay-0002, and 297 more)",
        "  (--verbose or --json lists every operation)",
    ]
    engine = create_engine(url)
    with engine.connect() as conn:  # a dry run writes nothing
        assert conn.execute(select(func.count()).select_from(audit)).scalar_one() == 0
        states = conn.execute(select(operations.c.state).distinct()).scalars().all()
    engine.dispose()
    assert states == ["unresolved"]


def test_verbose_and_json_list_every_operation(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'o.sqlite3'}"
    _build(url)
    verbose = _run(url, "--verbose").stdout.splitlines()
    listed = [line for line in verbose if line.startswith("  pay-")]
    assert len(listed) == 500
    assert listed[0].startswith("  pay-0000: refused: refusing to requeue 'pay-0000'")
    assert listed[300] == "  pay-0300: would change -> pending"
    data = json.loads(_run(url, "--json").stdout)
    assert len(data["operations"]) == 500
    assert data["groups"][1] == {
        "outcome": "refused",
        "why": "key retention passed: needs --accept-duplicate-risk",
        "count": 300,
        "first_ids": ["pay-0000", "pay-0001", "pay-0002"],
    }
