"""Clock steps and Retry-After, against a real receiver, on SQLite and PostgreSQL.

The outbox runs on a FakeClock so that wall time can jump without the monotonic clock
(``jump_wall``), as an NTP step or a VM resume does.
"""

from __future__ import annotations

import email.utils
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from tenacity import wait_fixed

from outbox import (
    Endpoint,
    FakeClock,
    Outbox,
    Reason,
    RetryPolicy,
    State,
    SystemClock,
)
from outbox.dispatch import failpoints
from outbox.testing.receiver import Receiver
from tests.faults.support import Hold

WINDOW = 60.0


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture(autouse=True)
def _no_failpoints() -> Iterator[None]:
    failpoints.clear()
    yield
    failpoints.clear()


@pytest.fixture
def ob(db_url: str, receiver: Receiver) -> Iterator[Outbox]:
    outbox = Outbox(
        db_url,
        endpoints=[
            Endpoint(
                name="rx",
                base_url=receiver.url,
                timeout=1.0,
                retry=RetryPolicy(max_attempts=5, window=timedelta(seconds=WINDOW),
                                  wait=wait_fixed(1)),
                key_retention=timedelta(hours=1),
                # The policy's reading of Retry-After, without the fleet's throttle (under
                # it a 503 is bounded by deliver_within: tests/integration/test_rate_limits).
                throttle=None,
            )
        ],
        clock=FakeClock(),
    )  # fmt: skip
    yield outbox
    outbox.close()


def _clock(ob: Outbox) -> FakeClock:
    assert isinstance(ob.clock, FakeClock)
    return ob.clock


def _enqueue(ob: Outbox, op_id: str) -> None:
    ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"operation_id": op_id},
               operation_id=op_id)  # fmt: skip


# --------------------------------------------------------------------------- clock steps


def test_wall_clock_jumping_past_the_window_sends_nothing_more(
    ob: Outbox, receiver: Receiver
) -> None:
    _enqueue(ob, "jump-forward")
    receiver.faults.drop_after_commit(times=1, key="jump-forward")
    ob.dispatch_once()  # sent, response lost: outcome unknown, retry scheduled
    assert ob.get("jump-forward").state is State.PENDING
    _clock(ob).jump_wall(WINDOW + 600)  # an NTP step forward, past the window
    ob.dispatch_once()
    op = ob.get("jump-forward")
    assert (op.state, op.reason) == (State.UNRESOLVED, Reason.OUTCOME_UNKNOWN)
    assert len(receiver.requests(key="jump-forward")) == 1  # no reissue
    assert receiver.effect_count(key="jump-forward") == 1
    _clock(ob).advance(3600)
    assert ob.dispatch_once().claimed == 0  # and never on its own


def test_wall_clock_jumping_backwards_does_not_resend_early(ob: Outbox, receiver: Receiver) -> None:
    _enqueue(ob, "jump-back")
    receiver.faults.fail_before_work(503, retry_after="30", times=1, key="jump-back")
    ob.dispatch_once()
    op = ob.get("jump-back")
    assert op.state is State.PENDING
    assert op.next_attempt_at_ms is not None
    due = op.next_attempt_at_ms
    _clock(ob).jump_wall(-3600)  # the clock steps back an hour
    for _ in range(5):
        _clock(ob).advance(10)  # fifty real seconds pass: past the 30 s Retry-After
        assert ob.dispatch_once().claimed == 0
    assert len(receiver.requests(key="jump-back")) == 1
    # Once the wall clock is past the stored due time again, the retry goes out.
    _clock(ob).jump_wall(due / 1000 - _clock(ob).now_ms() / 1000 + 1)
    assert ob.dispatch_once().succeeded == 1
    assert len(receiver.requests(key="jump-back")) == 2
    assert receiver.effect_count(key="jump-back") == 1


def test_system_clock_never_runs_backwards_in_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import outbox.clock as clock_module

    now = [1_800_000_000_000_000_000]
    monkeypatch.setattr(clock_module.time, "time_ns", lambda: now[0])
    clock = SystemClock()
    first = clock.now_ms()
    now[0] -= 3_600 * 10**9  # the system clock steps back an hour
    assert clock.now_ms() == first  # time stands still instead
    now[0] += 3_600 * 10**9 + 5_000_000
    assert clock.now_ms() == first + 5


# --------------------------------------------------------------------------- Retry-After


def _http_date(ms: int) -> str:
    return email.utils.format_datetime(datetime.fromtimestamp(ms / 1000, UTC), usegmt=True)


RetryAfter = Callable[[int], str]

CASES: dict[str, tuple[RetryAfter, float, float]] = {
    # name: (header from "now" in ms, least wait, most wait) in seconds
    "seconds": (lambda now: "7", 7.0, 7.5),
    "http-date": (lambda now: _http_date(now + 20_000), 19.0, 21.0),
    "http-date-in-the-past": (lambda now: _http_date(now - 600_000), 1.0, 1.5),
    # Garbage is ignored: the endpoint's own backoff (wait_fixed(1)) decides.
    "garbage": (lambda now: "soon-ish, maybe", 1.0, 1.5),
    "negative": (lambda now: "-5", 1.0, 1.5),
    "huge-number": (lambda now: "9" * 40, 0.0, 0.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_retry_after_forms(case: str, ob: Outbox, receiver: Receiver) -> None:
    header, least, most = CASES[case]
    op_id = f"ra-{case}"
    _enqueue(ob, op_id)
    now = _clock(ob).now_ms()
    receiver.faults.fail_before_work(503, retry_after=header(now), times=1, key=op_id)
    ob.dispatch_once()
    op = ob.get(op_id)
    if case == "huge-number":
        # Beyond the window: reconciliation now, rather than waiting blindly.
        assert (op.state, op.reason) == (State.UNRESOLVED, Reason.RETRIES_EXHAUSTED)
        return
    assert op.state is State.PENDING
    assert op.next_attempt_at_ms is not None
    wait = (op.next_attempt_at_ms - op.attempts[0].started_at_ms) / 1000
    assert least <= wait <= most, (case, header(now), wait)
    _clock(ob).advance(least - 0.5)
    assert ob.dispatch_once().claimed == 0  # not before it
    _clock(ob).advance(most - least + 1)
    assert ob.dispatch_once().succeeded == 1
    assert receiver.effect_count(key=op_id) == 1


def test_retry_after_date_past_the_window_goes_to_reconciliation_now(
    ob: Outbox, receiver: Receiver
) -> None:
    _enqueue(ob, "ra-date-late")
    later = _clock(ob).now_ms() + int(WINDOW * 1000) + 3_600_000
    receiver.faults.fail_before_work(503, retry_after=_http_date(later), times=1,
                                     key="ra-date-late")  # fmt: skip
    ob.dispatch_once()
    op = ob.get("ra-date-late")
    assert (op.state, op.reason) == (State.UNRESOLVED, Reason.RETRIES_EXHAUSTED)
    assert len(receiver.requests(key="ra-date-late")) == 1


# --------------------------------------------------------------------------- window at send


def test_a_send_delayed_inside_its_lease_does_not_go_out_after_the_window(
    ob: Outbox, receiver: Receiver
) -> None:
    _enqueue(ob, "edge")
    receiver.faults.drop_after_commit(times=1, key="edge")
    ob.dispatch_once()  # outcome unknown; retry due in 1 s
    first = ob.get("edge").attempts[0].started_at_ms
    _clock(ob).advance(WINDOW - 0.5)  # the retry is due, half a second before the window ends
    with Hold("after_attempt_commit") as hold:
        holder = threading.Thread(target=ob.dispatch_once, name="dispatcher-A")
        holder.start()
        assert hold.reached.wait(10)
        # 20 s pass: the lease (30 s, 3 s needed for a send) still allows the send ...
        _clock(ob).advance(20)
        assert _clock(ob).now_ms() > first + WINDOW * 1000  # ... but the window is closed
        hold.release.set()
        holder.join(30)
    assert len(receiver.requests(key="edge")) == 1, "sent after the window"
