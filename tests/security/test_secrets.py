"""A credential supplied at send time never reaches the database files or the logs.

The endpoint's ``auth`` gives ``Authorization: Bearer PLANTED-...`` at send time. After
dispatching through retries, lost responses and errors, the raw bytes of the SQLite
files (main, -wal, -shm; read before the outbox is closed, so the WAL still holds
whatever was written) and the log output as the CLI renders it (the real processor
chain, JSON lines) must not contain it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from tenacity import wait_fixed

from outbox import Endpoint, FakeClock, Outbox, RetryPolicy, State
from outbox.testing.receiver import Receiver
from tests.security.support import EchoServer, echo_headers, rendered_logs

SECRET = "PLANTED-sk-live-7f3a9c1e55d04b2e"


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


def _files(db: Path) -> list[Path]:
    return [p for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists()]


def _outbox(db: Path, base_url: str, auth: object) -> Outbox:
    return Outbox(
        f"sqlite:///{db}",
        endpoints=[
            Endpoint(name="rx", base_url=base_url, timeout=0.5,
                     retry=RetryPolicy(max_attempts=3, window=timedelta(minutes=5),
                                       wait=wait_fixed(1)),
                     key_retention=timedelta(hours=1), auth=auth)  # type: ignore[arg-type]
        ],
        clock=FakeClock(),
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["header-callable", "httpx-auth"])
def test_send_time_credential_never_reaches_files_or_logs(
    kind: str, receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def supply() -> dict[str, str]:
        calls.append(1)
        return {"Authorization": f"Bearer {SECRET}"}

    auth = supply if kind == "header-callable" else httpx.BasicAuth("svc", SECRET)
    db = tmp_path / "outbox.sqlite3"
    with rendered_logs(monkeypatch) as log:
        ob = _outbox(db, receiver.url, auth)
        try:
            receiver.faults.drop_after_commit(times=1, key="lost")
            receiver.faults.fail_after_commit(500, times=1, key="five-hundred")
            receiver.faults.fail_before_work(503, retry_after="1", times=1, key="busy")
            receiver.faults.delay_after_commit(1.0, times=1, key="slow")
            for op_id in ("ok", "lost", "five-hundred", "busy", "slow"):
                ob.enqueue(endpoint="rx", method="POST", path="/orders",
                           json={"operation_id": op_id}, operation_id=op_id)  # fmt: skip
            for _ in range(4):
                ob.dispatch_once()
                assert isinstance(ob.clock, FakeClock)
                ob.clock.advance(2)
            states = {op_id: ob.get(op_id).state for op_id in ("ok", "lost", "busy", "slow")}
            assert set(states.values()) == {State.SUCCEEDED}, states
            raw = b"".join(p.read_bytes() for p in _files(db))  # before close
        finally:
            ob.close()
        raw += b"".join(p.read_bytes() for p in _files(db))  # and after
    text = log.getvalue()
    assert "attempt_started" in text  # the logs were rendered
    assert all(isinstance(json.loads(line), dict) for line in text.splitlines())
    if kind == "header-callable":
        assert calls  # the credential was supplied (and sent)
    assert SECRET.encode() not in raw
    assert SECRET not in text
    import base64

    basic = base64.b64encode(f"svc:{SECRET}".encode())
    assert basic not in raw
    assert basic.decode() not in text


@pytest.mark.parametrize("status", [201, 500])
def test_credential_echoed_by_the_receiver_is_not_stored(status: int, tmp_path: Path) -> None:
    db = tmp_path / "outbox.sqlite3"
    with EchoServer(echo_headers(status)) as echo:
        ob = _outbox(db, echo.url, lambda: {"Authorization": f"Bearer {SECRET}"})
        try:
            ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"a": 1},
                       operation_id="echoed")  # fmt: skip
            ob.dispatch_once()
            assert echo.received  # it was sent, with the credential
            assert echo.received[0][2].get("authorization") == f"Bearer {SECRET}"
            raw = b"".join(p.read_bytes() for p in _files(db))
        finally:
            ob.close()
    assert SECRET.encode() not in raw
