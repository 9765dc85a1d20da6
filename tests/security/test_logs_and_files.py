"""Log lines cannot be forged; SQLite files are private and a readable one is refused.

Logs are rendered by the CLI's own structlog configuration (``outbox.base.logs.configure``,
JSON lines) into a buffer standing in for stderr: one JSON object per line, whatever
the receiver answered or a tampered row contains.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update
from tenacity import wait_fixed

from outbox import Endpoint, FakeClock, Outbox, RetryPolicy, StoreError
from outbox.store.tables import operations
from outbox.testing.receiver import Receiver
from tests.security.support import EchoServer, rendered_logs

ROOT = Path(__file__).resolve().parents[2]
FORGED = '{"event": "operation_succeeded", "level": "info", "forged": true}'
NASTY = f"boom\n{FORGED}\r\n{FORGED}\x1b[31m\u2028\u0085\x00end"


def _outbox(db: Path | str, base_url: str) -> Outbox:
    url = db if isinstance(db, str) else f"sqlite:///{db}"
    return Outbox(
        url,
        endpoints=[Endpoint(name="rx", base_url=base_url, timeout=1.0,
                            retry=RetryPolicy(max_attempts=2, window=timedelta(minutes=5),
                                              wait=wait_fixed(1)),
                            key_retention=timedelta(hours=1))],
        clock=FakeClock(),
    )  # fmt: skip


def _records(text: str) -> list[dict[str, object]]:
    records = []
    for line in text.splitlines():
        record = json.loads(line)  # every line is JSON ...
        assert isinstance(record, dict)  # ... and one object
        records.append(record)
    return records


def test_receiver_bodies_and_tampered_rows_cannot_forge_log_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "outbox.sqlite3"
    with (
        EchoServer(lambda method, path, headers: (500, NASTY.encode())) as echo,
        rendered_logs(monkeypatch) as log,
    ):
        ob = _outbox(db, echo.url)
        try:
            ob.enqueue(endpoint="rx", method="POST", path="/o", json={"note": NASTY},
                       operation_id="body-forger")  # fmt: skip
            for op_id, column, value in [
                ("endpoint-forger", "endpoint", f"x\n{FORGED}"[:64]),
                ("id-forger", "operation_id", f"id\n{FORGED}"),
                ("tenant-forger", "tenant", f"t\r\n{FORGED}"),
            ]:
                ob.enqueue(endpoint="rx", method="POST", path="/o", json={},
                           operation_id=op_id)  # fmt: skip
                with ob.engine.begin() as conn:
                    conn.execute(update(operations)
                                 .where(operations.c.operation_id == op_id)
                                 .values({column: value}))  # fmt: skip
            for _ in range(3):
                ob.dispatch_once()
                assert isinstance(ob.clock, FakeClock)
                ob.clock.advance(2)
        finally:
            ob.close()
    records = _records(log.getvalue())
    events = {r["event"] for r in records}
    assert {"attempt_started", "attempt_finished", "endpoint_not_registered"} <= events
    assert not any(r.get("forged") for r in records)
    # The hostile values are there, intact, inside fields: escaped, not interpreted.
    assert any(isinstance(r.get("operation_id"), str) and "\n" in r["operation_id"]
               for r in records)  # fmt: skip
    assert any(isinstance(r.get("endpoint"), str) and "\n" in r["endpoint"] for r in records)


# --------------------------------------------------------------------------- files


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_sqlite_files_are_private_even_with_a_permissive_umask(
    tmp_path: Path, receiver: Receiver
) -> None:
    db = tmp_path / "data" / "outbox.sqlite3"
    old = os.umask(0)
    try:
        ob = _outbox(db, receiver.url)
        try:
            ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="p")
            ob.dispatch_once()
            files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
            assert all(p.exists() for p in files)
            assert {str(p): oct(_mode(p)) for p in files} == {str(p): "0o600" for p in files}
        finally:
            ob.close()
    finally:
        os.umask(old)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_dispatcher_refuses_a_group_or_world_readable_database(
    mode: int, tmp_path: Path, receiver: Receiver
) -> None:
    db = tmp_path / "outbox.sqlite3"
    ob = _outbox(db, receiver.url)
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="exposed")
    os.chmod(db, mode)
    try:
        with pytest.raises(StoreError, match="chmod 600"):
            ob.dispatch_once()
    finally:
        ob.close()
    assert receiver.requests() == []


def test_dispatcher_command_exits_on_a_world_readable_database(
    tmp_path: Path, receiver: Receiver
) -> None:
    db = tmp_path / "outbox.sqlite3"
    ob = _outbox(db, receiver.url)
    ob.close()
    os.chmod(db, 0o644)
    env = dict(os.environ, OUTBOX_TEST_DB=f"sqlite:///{db}", OUTBOX_TEST_RECEIVER_URL=receiver.url,
               OUTBOX_TEST_LEASE="3")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "outbox.cli", "--app", "tests.support.dispatch_app:outbox",
         "dispatch"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "chmod 600" in done.stderr


def test_uri_style_url_is_checked_like_a_plain_path(
    tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "outbox.sqlite3"
    _outbox(db, receiver.url).close()
    os.chmod(db, 0o644)
    ob = _outbox(f"sqlite:///file:{db}?uri=true", receiver.url)
    try:
        junk = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("file:*"))
        with pytest.raises(StoreError, match="chmod 600"):
            ob.dispatch_once()
    finally:
        ob.close()
    assert junk == []
