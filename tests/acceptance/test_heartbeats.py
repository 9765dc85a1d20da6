"""Dispatcher heartbeats, seen through ``outbox status``: a running ``outbox dispatch``
is live, a SIGKILLed one is lost once silent past the timeout, a SIGTERMed one is
stopped at once, and ``status --check`` fails when work is due and no dispatcher was
seen. The reading side runs at chosen times (a FakeClock in the ``--app`` module), so no
assertion depends on how fast the machine is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from outbox import Outbox
from outbox.cli import main
from outbox.store import monitoring
from outbox.store.monitoring import DispatcherRow
from tests.integration._reconcile_states import closed_port_url
from tests.support import observed_app

APP = "tests.support.observed_app:outbox"
REPO = Path(__file__).resolve().parents[2]
OUTBOX = Path(sys.executable).with_name("outbox")


def _env(db_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_TEST_DB=db_url,
        OUTBOX_TEST_OFFLINE_URL=closed_port_url(),
        PYTHONPATH=str(REPO),
        **extra,
    )
    return env


@pytest.fixture
def dispatchers(db_url: str) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)  # reaps it and closes the pipes


def _start(db_url: str, started: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [str(OUTBOX), "--app", APP, "--log-level", "warning", "dispatch"],
        env=_env(db_url),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started.append(proc)
    return proc


def _row(ob: Outbox, pid: int) -> DispatcherRow | None:
    rows = [r for r in monitoring.list_dispatchers(ob.store) if r.pid == pid]
    return rows[0] if rows else None


def _until_row(ob: Outbox, proc: subprocess.Popen[str], beats: int = 2) -> DispatcherRow:
    """Wait (bounded by the test timeout) until the dispatcher has written a few beats."""
    first: DispatcherRow | None = None
    while True:
        assert proc.poll() is None, proc.communicate()
        row = _row(ob, proc.pid)
        if row is not None:
            first = first or row
            if row.last_seen_at_ms > first.last_seen_at_ms or beats <= 1:
                return row
        time.sleep(0.05)


def _status(db_url: str, now_ms: int, *args: str) -> tuple[int, dict[str, object]]:
    result = CliRunner().invoke(
        main,
        ["--app", APP, "status", "--json", *args],
        env={**_env(db_url, OUTBOX_TEST_NOW_MS=str(now_ms))},
        catch_exceptions=False,
    )
    return result.exit_code, json.loads(result.stdout)


def _states(data: dict[str, object], pid: int) -> list[str]:
    rows = data["dispatchers"]
    assert isinstance(rows, list)
    return [d["state"] for d in rows if d["pid"] == pid]


def test_killed_dispatcher_becomes_lost_and_check_fails_with_due_work(
    db_url: str, dispatchers: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ob = Outbox(db_url, auto_migrate=True)
    try:
        proc = _start(db_url, dispatchers)
        row = _until_row(ob, proc)
        assert row.host and row.version and row.concurrency == 8
        assert row.stopped_at_ms is None
        assert row.last_seen_at_ms >= row.started_at_ms

        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        dead = _row(ob, proc.pid)
        assert dead is not None and dead.stopped_at_ms is None  # no chance to say goodbye
        seen = dead.last_seen_at_ms

        # Due work nobody will send now: no dispatcher runs.
        monkeypatch.setenv("OUTBOX_TEST_DB", db_url)
        monkeypatch.setenv("OUTBOX_TEST_NOW_MS", str(seen))
        with observed_app.build() as app:
            app.enqueue(endpoint="offline", method="POST", path="/x", operation_id="due-1")

        # Within the timeout (30 s by default) a silent dispatcher still counts as live:
        # a heartbeat cannot tell a dead process from a slow one sooner than that.
        code, data = _status(db_url, seen + 30_000, "--check", "--max-pending-age", "1h")
        assert _states(data, proc.pid) == ["live"]
        assert data["live_dispatchers"] == 1
        assert (code, data["problems"]) == (0, [])
        assert data["due"] == 1
        assert data["endpoints"]["offline"]["due"] == 1  # type: ignore[index]

        code, data = _status(db_url, seen + 30_001, "--check", "--max-pending-age", "1h")
        assert _states(data, proc.pid) == ["lost"]
        assert data["live_dispatchers"] == 0
        assert code == 1
        assert data["problems"] == [
            "1 operations are due and no dispatcher was seen in the last 30s "
            "(last seen 30s ago)"
        ]
        human = CliRunner().invoke(
            main, ["--app", APP, "status"],
            env=_env(db_url, OUTBOX_TEST_NOW_MS=str(seen + 30_001)), catch_exceptions=False,
        )  # fmt: skip
        rows = [line for line in human.stdout.splitlines() if f"│ {proc.pid} " in line]
        assert len(rows) == 1 and "│ lost " in rows[0] and "30.0s ago" in rows[0], human.stdout
        assert "dispatchers (0 live)" in human.stdout
        # The timeout is the operator's: --dispatcher-timeout.
        code, data = _status(
            db_url, seen + 30_001, "--check", "--max-pending-age", "1h",
            "--dispatcher-timeout", "2m",
        )  # fmt: skip
        assert (code, _states(data, proc.pid)) == (0, ["live"])
    finally:
        ob.close()


def test_sigtermed_dispatcher_is_stopped_at_once(
    db_url: str, dispatchers: list[subprocess.Popen[str]]
) -> None:
    ob = Outbox(db_url, auto_migrate=True)
    try:
        proc = _start(db_url, dispatchers)
        _until_row(ob, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        row = _row(ob, proc.pid)
        assert row is not None and row.stopped_at_ms is not None
        assert row.in_flight == 0
        _, data = _status(db_url, row.stopped_at_ms + 1)
        assert _states(data, proc.pid) == ["stopped"]
        assert data["live_dispatchers"] == 0
    finally:
        ob.close()


def test_heartbeat_rows_of_long_gone_dispatchers_are_pruned(db_url: str) -> None:
    from outbox.dispatch.heartbeat import FORGET_AFTER_MS

    ob = Outbox(db_url, auto_migrate=True)
    try:
        common = {"host": "h", "pid": 1, "version": "v", "concurrency": 1, "in_flight": 0}
        monitoring.heartbeat(ob.store, dispatcher_id="old", started_at_ms=0, now_ms=1_000,
                             **common)  # type: ignore[arg-type]
        monitoring.heartbeat(ob.store, dispatcher_id="new", started_at_ms=0,
                             now_ms=1_000 + FORGET_AFTER_MS, **common)  # type: ignore[arg-type]
        removed = monitoring.prune_dispatchers(ob.store, seen_before_ms=1_001)
        assert removed == 1
        assert [r.id for r in monitoring.list_dispatchers(ob.store)] == ["new"]
    finally:
        ob.close()


def test_check_fails_while_a_pending_operation_cannot_be_sent(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pending operation with ``last_error`` set (no dispatcher can send it, e.g. its
    endpoint is registered nowhere) fails ``--check`` and is counted per endpoint."""
    from sqlalchemy import update

    from outbox.store.tables import operations

    monkeypatch.setenv("OUTBOX_TEST_DB", db_url)
    now = 1_800_000_000_000
    monkeypatch.setenv("OUTBOX_TEST_NOW_MS", str(now))
    with observed_app.build() as app:
        app.enqueue(endpoint="rx", method="POST", path="/x", operation_id="stranded")
        code, data = _status(db_url, now, "--check", "--no-dispatcher-check")
        assert (code, data["unsendable"]) == (0, 0)
        with app.store.write() as conn:
            conn.execute(
                update(operations)
                .where(operations.c.operation_id == "stranded")
                .values(last_error="endpoint 'rx' is not registered in any dispatcher")
            )
    code, data = _status(db_url, now, "--check", "--no-dispatcher-check")
    assert code == 1
    assert data["unsendable"] == 1
    assert data["endpoints"]["rx"]["unsendable"] == 1  # type: ignore[index]
    assert data["problems"] == [
        "1 pending operations cannot be sent by any dispatcher (threshold 0); "
        "see `outbox show`"
    ]
