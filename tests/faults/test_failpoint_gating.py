"""Failpoints are for tests: ``OUTBOX_FAILPOINTS`` alone arms nothing.

A production environment that carries a stray ``OUTBOX_FAILPOINTS`` (copied from a
test set-up, say) must not be able to SIGKILL its dispatcher. Only together with
``OUTBOX_FAILPOINTS_ENABLE=i-understand`` do the points fire, and then the dispatcher
says so loudly when it starts.
"""

from __future__ import annotations

from pathlib import Path

from outbox import State
from outbox.testing.receiver import Receiver
from tests.faults.support import dispatchers, open_outbox, until


def test_failpoints_without_the_opt_in_are_ignored_and_said_so(
    sqlite_url: str, tmp_path: Path
) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as rx, open_outbox(sqlite_url, rx.url) as ob:
        ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                   operation_id="gated")  # fmt: skip
        with dispatchers(tmp_path) as start:
            d = start(sqlite_url, rx.url, name="gated", failpoints_enabled=False,
                      failpoint_spec="after_claim=kill,after_attempt_commit=kill")  # fmt: skip
            until(lambda: ob.get("gated").state is State.SUCCEEDED, 30, "the send")
            assert d.alive()
            d.stop()
            ignored = [e for e in d.events() if e.get("event") == "failpoints_ignored"]
            assert len(ignored) == 1 and ignored[0]["level"] == "warning"
            assert not d.saw("failpoints_armed")
        assert rx.effect_count(key="gated") == 1


def test_failpoints_with_the_opt_in_fire_and_are_announced(
    sqlite_url: str, tmp_path: Path
) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as rx, open_outbox(sqlite_url, rx.url) as ob:
        ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                   operation_id="armed")  # fmt: skip
        with dispatchers(tmp_path) as start:
            d = start(sqlite_url, rx.url, name="armed", failpoint_spec="after_claim=kill")
            assert d.wait(30) == -9
            armed = [e for e in d.events() if e.get("event") == "failpoints_armed"]
            assert len(armed) == 1 and armed[0]["level"] == "warning"
            assert armed[0]["points"] == {"after_claim": "kill"}
        assert rx.requests(key="armed") == []
