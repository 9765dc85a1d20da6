"""The dispatcher as users run it: `outbox dispatch` subprocesses, killed and raced.

Real SIGKILLs and SIGTERMs, a real receiver, both databases.
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

from outbox import Delivery, Endpoint, Intent, Outbox, State
from outbox.testing.receiver import Receiver

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.support.dispatch_app:outbox"


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


def _env(db_url: str, receiver: Receiver, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OUTBOX_TEST_DB=db_url, OUTBOX_TEST_RECEIVER_URL=receiver.url,
               **extra)
    return env


def _dispatcher(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", "--log-level", "warning", "--app", APP, "dispatch",
         *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def _outbox(db_url: str, receiver: Receiver) -> Outbox:
    return Outbox(db_url, endpoints=[Endpoint(name="receiver", base_url=receiver.url)])


def _wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)


def test_sigkill_mid_request_then_restart_gives_one_effect(
    db_url: str, receiver: Receiver
) -> None:
    ob = _outbox(db_url, receiver)
    try:
        ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                   operation_id="killed-1")
        receiver.faults.delay_after_commit(1.0, key="killed-1")
        env = _env(db_url, receiver, OUTBOX_TEST_TIMEOUT="1.5", OUTBOX_TEST_LEASE="3")
        first = _dispatcher(env)
        try:
            _wait_for(lambda: receiver.requests(key="killed-1"), 15, "the first request")
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=10)
        finally:
            _stop(first)
        assert ob.get("killed-1").state is State.IN_FLIGHT
        second = _dispatcher(env)
        try:
            _wait_for(lambda: ob.get("killed-1").state.is_settled, 30, "recovery")
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=15)
            _stop(second)
        op = ob.get("killed-1")
        assert op.state is State.SUCCEEDED
        assert op.attempts[0].delivery is Delivery.UNKNOWN
        assert op.attempts[0].error_class == "LeaseExpired"
        assert op.attempts[-1].status_code == 201
        assert receiver.effect_count(key="killed-1") == 1
        assert len({r.request_id for r in receiver.requests(key="killed-1")}) == len(op.attempts)
    finally:
        ob.close()


@pytest.mark.timeout(180)
def test_two_dispatcher_processes_send_each_operation_once(
    db_url: str, receiver: Receiver
) -> None:
    n = 200
    ob = _outbox(db_url, receiver)
    try:
        ob.enqueue_many([
            Intent("receiver", "POST", "/orders", {"n": i}, operation_id=f"race-{i}")
            for i in range(n)
        ])
        env = _env(db_url, receiver, OUTBOX_TEST_CONCURRENCY="8")
        procs = [_dispatcher(env), _dispatcher(env)]
        try:
            _wait_for(lambda: ob.reconcile.status().counts["succeeded"] == n, 120,
                      "all operations to succeed")
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            codes = [p.wait(timeout=30) for p in procs]
            for p in procs:
                _stop(p)
        assert codes == [0, 0]
        assert receiver.effect_count() == n
        requests = receiver.requests()
        assert len(requests) == n  # no operation was sent twice
        assert len({r.key for r in requests}) == n
    finally:
        ob.close()


def test_sigterm_lets_requests_in_flight_finish(db_url: str, receiver: Receiver) -> None:
    ob = _outbox(db_url, receiver)
    try:
        ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                   operation_id="graceful")
        receiver.faults.delay_after_commit(1.0, key="graceful")
        proc = _dispatcher(_env(db_url, receiver, OUTBOX_TEST_TIMEOUT="5"))
        try:
            _wait_for(lambda: receiver.requests(key="graceful"), 15, "the request")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            _stop(proc)
        op = ob.get("graceful")
        assert op.state is State.SUCCEEDED  # the outcome was recorded before exit
        assert len(op.attempts) == 1
    finally:
        ob.close()


# --------------------------------------------------------------------------- --processes


def _children(pid: int) -> set[int]:
    """Live child processes of ``pid`` (from /proc: the parent is field 4 of stat)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(entry.name))
    return found


@pytest.mark.timeout(180)
def test_supervisor_restarts_a_killed_child_and_sigterm_drains_all(
    db_url: str, receiver: Receiver
) -> None:
    ob = _outbox(db_url, receiver)
    supervisor = _dispatcher(_env(db_url, receiver), "--processes", "2", "--json")
    try:
        _wait_for(lambda: len(_children(supervisor.pid)) == 2, 30, "two dispatcher processes")
        first = _children(supervisor.pid)
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        _wait_for(
            lambda: len(_children(supervisor.pid)) == 2 and victim not in _children(supervisor.pid),
            30,
            "the killed dispatcher to be replaced",
        )
        ob.enqueue_many([
            Intent("receiver", "POST", "/orders", {"n": i}, operation_id=f"sup-{i}")
            for i in range(20)
        ])
        _wait_for(lambda: ob.reconcile.status().counts.get("succeeded") == 20, 60,
                  "the restarted fleet to send everything")
        children = _children(supervisor.pid)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=60) == 0
        out, err = supervisor.communicate(timeout=10)
    finally:
        _stop(supervisor)
        ob.close()
    report = json.loads(out)
    assert report["processes"] == 2 and report["restarts"] == 1
    # The killed child (-9), then the two running at SIGTERM drained and exited 0.
    assert sorted(report["exit_codes"]) == sorted([-signal.SIGKILL, 0, 0])
    # The drained children's own summaries, added up.
    assert report["succeeded"] == 20
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in children)
    events = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    exited = [e for e in events if e.get("event") == "dispatcher_process_exited"]
    assert len(exited) == 1 and exited[0]["exit_code"] == -signal.SIGKILL
    assert receiver.effect_count() == 20
    assert len(receiver.requests()) == 20


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_processes_refuses_once(db_url: str, receiver: Receiver) -> None:
    proc = _dispatcher(_env(db_url, receiver), "--processes", "2", "--once")
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert b"--once and --processes" in err


def test_a_probe_holder_killed_is_replaced_after_its_lease(
    db_url: str, receiver: Receiver
) -> None:
    """An open circuit, its probe due: the first `outbox dispatch` takes the probe lease,
    commits the probe's attempt and is SIGKILLed before sending. Nothing else of the
    endpoint goes out; the second process takes the probe once the lease ends, and its
    success closes the circuit for everyone."""
    from outbox.store.endpoints import Circuit

    ob = _outbox(db_url, receiver)
    try:
        for i in range(3):
            ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": i},
                       operation_id=f"probe-{i}")  # fmt: skip
        now = ob.clock.now_ms()
        assert ob.store.count_failures("receiver", failures=5, threshold=5, reason="test",
                                       now_ms=now, next_probe_at=now)  # fmt: skip
        env = _env(db_url, receiver, OUTBOX_TEST_TIMEOUT="1", OUTBOX_TEST_LEASE="3",
                   OUTBOX_FAILPOINTS="after_attempt_commit=kill",
                   OUTBOX_FAILPOINTS_ENABLE="i-understand")  # fmt: skip
        first = _dispatcher(env)
        try:
            first.wait(timeout=30)
        finally:
            _stop(first)
        assert first.returncode == -signal.SIGKILL
        [held] = ob.store.endpoint_states()
        assert held.circuit is Circuit.HALF_OPEN and held.probe_owner is not None
        assert held.probe_until is not None
        assert receiver.requests() == []
        env.pop("OUTBOX_FAILPOINTS")
        second = _dispatcher(env)
        try:
            _wait_for(lambda: all(ob.get(f"probe-{i}").state is State.SUCCEEDED
                                  for i in range(3)), 40, "the backlog to drain")  # fmt: skip
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=15)
            _stop(second)
        [closed] = ob.store.endpoint_states()
        assert closed.circuit is Circuit.CLOSED and closed.probe_owner is None
        first_sent = min(r.arrived_at_ms for r in receiver.requests())
        assert first_sent >= held.probe_until  # not before the killed holder's lease ended
        assert all(receiver.effect_count(key=f"probe-{i}") == 1 for i in range(3))
    finally:
        ob.close()
