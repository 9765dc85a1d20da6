"""Small deterministic companions of the soak: each planted bug, caught without luck.

Each scenario runs twice: on the library as it is (the safety property holds) and with
one bug from ``tests.soak.planted`` installed in-process (the property visibly breaks).
Time is a FakeClock; a dispatcher is held at a named failpoint by a registered callback,
so "A pauses past its lease while B takes over" happens exactly, every time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from tenacity import wait_fixed

from outbox import Endpoint, FakeClock, Outbox, RetryPolicy, State
from outbox.dispatch import failpoints
from outbox.dispatch.dispatcher import DispatchSummary
from outbox.testing.receiver import Receiver
from tests.faults.support import Hold
from tests.soak import oracle, planted

LEASE_SECONDS = 30.0  # the default for a 1 s endpoint timeout


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def ob(tmp_path: Path, receiver: Receiver) -> Iterator[Outbox]:
    outbox = Outbox(
        f"sqlite:///{tmp_path / 'outbox.sqlite3'}",
        endpoints=[
            Endpoint(
                name="rx",
                base_url=receiver.url,
                timeout=1.0,
                retry=RetryPolicy(max_attempts=5, window=timedelta(seconds=60),
                                  wait=wait_fixed(1)),
                key_retention=timedelta(hours=1),
            )
        ],
        clock=FakeClock(),
    )  # fmt: skip
    oracle.install_instruments(outbox.engine)
    yield outbox
    outbox.close()
    failpoints.clear()


@pytest.fixture(autouse=True)
def _no_failpoints() -> Iterator[None]:
    failpoints.clear()
    yield
    failpoints.clear()


def _clock(ob: Outbox) -> FakeClock:
    assert isinstance(ob.clock, FakeClock)
    return ob.clock


def _enqueue(ob: Outbox, op_id: str) -> None:
    ob.enqueue(endpoint="rx", method="POST", path="/orders",
               json={"operation_id": op_id}, operation_id=op_id)  # fmt: skip


def _in_thread(ob: Outbox) -> tuple[threading.Thread, dict[str, DispatchSummary]]:
    out: dict[str, DispatchSummary] = {}
    thread = threading.Thread(
        target=lambda: out.update(summary=ob.dispatch_once()), name="dispatcher-A"
    )
    thread.start()
    return thread, out


def _settled_writes(ob: Outbox) -> int:
    with ob.engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {oracle.SETTLED_WRITES}")).scalar_one())


def _install(bug: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    planted.install(bug, monkeypatch.setattr)


# --------------------------------------------------------------------------- fencing


@pytest.mark.parametrize("bug", [None, "no_fencing"])
def test_stale_owner_outcome_write_changes_nothing(
    bug: str | None, ob: Outbox, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claims and sends; its response is lost and A pauses past its lease; B claims,
    replays, succeeds; A resumes and writes "retry": fenced, nothing changes."""
    _install(bug, monkeypatch)
    _enqueue(ob, "fenced")
    receiver.faults.drop_after_commit(times=1, key="fenced")
    with Hold("after_response") as hold:
        thread, a = _in_thread(ob)
        assert hold.reached.wait(10)
        _clock(ob).advance(LEASE_SECONDS + 1)
        b = ob.dispatch_once()  # B, in this thread: not held
        before = ob.get("fenced")
        hold.release.set()
        thread.join(30)
    after = ob.get("fenced")
    assert b.succeeded == 1
    assert receiver.effect_count(key="fenced") == 1
    if bug is None:
        assert a["summary"].fenced == 1
        assert after == before
        assert after.state is State.SUCCEEDED
        assert _settled_writes(ob) == 0
    else:  # the oracle's O13 sees the stale write
        assert after.state is State.PENDING
        assert _settled_writes(ob) >= 1


# --------------------------------------------------------------------------- lease check


@pytest.mark.parametrize("bug", [None, "no_lease_check"])
def test_dispatcher_paused_past_its_lease_does_not_send(
    bug: str | None, ob: Outbox, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(bug, monkeypatch)
    _enqueue(ob, "paused")
    with Hold("after_attempt_commit") as hold:
        thread, a = _in_thread(ob)
        assert hold.reached.wait(10)
        _clock(ob).advance(LEASE_SECONDS + 1)  # wall and monotonic: the lease is gone
        hold.release.set()
        thread.join(30)
    [attempt] = ob.get("paused").attempts
    sent = receiver.requests(key="paused")
    if bug is None:
        assert sent == []
        assert a["summary"].lease_check_failed == 1
    else:  # the oracle's O12: a request after its attempt's lease end
        assert [r.request_id for r in sent] == [attempt.request_id]
        assert _clock(ob).now_ms() > attempt.lease_until_ms


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("bug", [None, "key_per_attempt"])
def test_retry_after_lost_response_reuses_the_key(
    bug: str | None, ob: Outbox, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(bug, monkeypatch)
    _enqueue(ob, "lost")
    receiver.faults.drop_after_commit(times=1)
    ob.dispatch_once()
    _clock(ob).advance(2)
    ob.dispatch_once()
    effects = [e for e in receiver.effects() if e.client_operation_id == "lost"]
    if bug is None:
        assert len(effects) == 1  # O3
        assert {r.key for r in receiver.requests()} == {"lost"}  # O9
    else:
        assert len(effects) == 2
        assert "lost" not in {r.key for r in receiver.requests()}


# --------------------------------------------------------------------------- write-ahead


@pytest.mark.parametrize("bug", [None, "send_before_commit"])
def test_attempt_row_is_committed_before_the_request_arrives(
    bug: str | None, ob: Outbox, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the moment the response is back (a crash here loses the process), the
    receiver's request must already be in the attempt log."""
    _install(bug, monkeypatch)
    _enqueue(ob, "wal")
    seen: dict[str, bool] = {}

    def look() -> None:
        [request] = receiver.requests(key="wal")
        with ob.engine.connect() as conn:
            seen["recorded"] = bool(
                conn.execute(
                    text("SELECT count(*) FROM outbox_attempts WHERE request_id = :r"),
                    {"r": request.request_id},
                ).scalar_one()
            )

    with Hold("after_response") as hold:
        hold.hook = look
        thread, _ = _in_thread(ob)
        assert hold.reached.wait(10)
        hold.release.set()
        thread.join(30)
    assert seen["recorded"] is (bug is None)  # O8


# --------------------------------------------------------------------------- window


@pytest.mark.parametrize("bug", [None, "no_window_check"])
def test_nothing_is_sent_after_the_window(
    bug: str | None, ob: Outbox, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(bug, monkeypatch)
    _enqueue(ob, "late")
    receiver.faults.drop_after_commit(times=1)
    ob.dispatch_once()  # outcome unknown, retry scheduled
    first = ob.get("late").attempts[0].started_at_ms
    _clock(ob).advance(61)  # past the 60 s window
    ob.dispatch_once()
    late: list[Any] = [a for a in ob.get("late").attempts if a.started_at_ms > first + 60_000]
    if bug is None:
        assert late == []  # O11
        assert len(receiver.requests(key="late")) == 1
        assert ob.get("late").state is State.UNRESOLVED
    else:
        assert len(late) == 1
        assert len(receiver.requests(key="late")) == 2
