"""The console's sessions and rendering helpers, without a server."""

from __future__ import annotations

from outbox.console.auth import Sessions
from outbox.console.render import MASK, age, masked, pretty_json


def test_sessions_expire_and_can_be_dropped() -> None:
    now = [1000.0]
    sessions = Sessions(ttl_seconds=60, clock=lambda: now[0])
    first = sessions.create("alice")
    assert sessions.get(first.id) == first
    assert first.csrf_ok(first.csrf) and not first.csrf_ok(first.csrf + "x")
    assert not first.csrf_ok(None) and not first.csrf_ok("")
    now[0] += 61
    assert sessions.get(first.id) is None
    second = sessions.create("bob")
    assert second.id != first.id and second.csrf != first.csrf
    sessions.drop(second.id)
    assert sessions.get(second.id) is None and sessions.get(None) is None


def test_credential_headers_are_masked_whatever_their_case() -> None:
    shown = masked(
        {"Authorization": "Bearer abc", "x-api-key": "k", "x-custom-secret": "s", "x-a": "1"},
        ["X-Custom-Secret"],
    )
    assert shown == {
        "Authorization": MASK,
        "x-a": "1",
        "x-api-key": MASK,
        "x-custom-secret": MASK,
    }


def test_ages_and_capped_json() -> None:
    assert [age(s) for s in (None, 5, 65, 3700, 90000, -3)] == [
        "-",
        "5s",
        "1m 5s",
        "1h 1m",
        "1d 1h",
        "0s",
    ]
    small = pretty_json({"b": 1, "a": [1, 2]})
    assert not small.truncated and small.text.startswith('{\n  "a"')
    big = pretty_json("é" * 100, limit=10)
    assert big.truncated and len(big.text) == 10 and big.size > 100
