"""The fleet's throttle, as every operator view shows it (issue 23): a real receiver in
its rate-limited mode refuses what exceeds 20 requests/s (429 + the IETF RateLimit
fields), a real dispatcher learns the rate from it, and then ``outbox status`` (JSON
and text), ``outbox endpoint list`` (the real CLI, in a subprocess), a scrape of
``/metrics`` over HTTP and the console's endpoints page must all show the rate the
database holds, with the declared limits, on SQLite and PostgreSQL.

Nothing runs the dispatcher while the views read, so the throttle cannot move between
them (it is raised only by a dispatcher, after a quiet second).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from outbox import Endpoint, Intent, Outbox
from outbox.console import Credentials, create_app
from outbox.console.render import when
from outbox.model import ms_to_iso
from outbox.observe.metrics import serve
from outbox.store.endpoints import EndpointState
from outbox.testing.receiver import Receiver

REPO = Path(__file__).resolve().parents[2]
APP = "tests.support.limits_app:outbox"
TOKEN = "alice-" + "a" * 20
#: What the endpoint declares (tests/support/limits_app.py reads it from the environment).
DECLARED_RATE, DECLARED_IN_FLIGHT = 100.0, 16
#: What the receiver admits, and says it admits, in requests per second.
RECEIVER_RATE = 20


@pytest.fixture
def world(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Outbox]:
    """An outbox whose endpoint the receiver throttled, as its application builds it."""
    with Receiver(tmp_path / "rx.sqlite3") as rx:
        rx.faults.rate_limit(RECEIVER_RATE, headers="ietf")
        env = {
            "DB": db_url,
            "RECEIVER_URL": rx.url,
            "RATE_LIMIT": str(DECLARED_RATE),
            "MAX_IN_FLIGHT": str(DECLARED_IN_FLIGHT),
        }
        for name, value in env.items():
            monkeypatch.setenv(f"OUTBOX_TEST_{name}", value)
        from tests.support.limits_app import build

        with build() as ob:
            ob.enqueue_many(
                [Intent("rx", "POST", "/orders", {}, None, f"op-{i}", "") for i in range(64)]
            )
            for _ in range(8):  # 16 a claim, sent at the declared 100/s: the second finds it
                ob.dispatch_once()
                if _state(ob).rate is not None:
                    break
            assert any(r.outcome == "rate_limited" for r in rx.requests())
            yield ob


def _state(ob: Outbox) -> EndpointState:
    [state] = [s for s in ob.store.endpoint_states() if s.name == "rx"]
    return state


def _cli(*args: str) -> str:
    argv = [sys.executable, "-m", "outbox", *args]
    options: dict[str, Any] = {"env": dict(os.environ), "cwd": REPO, "timeout": 60}
    done = subprocess.run(argv, check=False, capture_output=True, text=True, **options)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _scrape(ob: Outbox) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    server = serve(ob.metrics(registry=registry))
    try:
        text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10).text
    finally:
        server.close()
    return {
        (s.name, s.labels.get("endpoint", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _console_row(ob: Outbox) -> str:
    creds = Credentials.parse(f"alice:{TOKEN}\n", default_name="nobody", source="test")
    c = TestClient(create_app(ob, creds), base_url="http://127.0.0.1")
    assert c.post("/login", data={"token": TOKEN}, follow_redirects=False).status_code == 303
    page = c.get("/endpoints").text
    start = page.index('data-endpoint="rx"')
    return page[start : page.index("</tr>", start)]


def _fields(row: dict[str, Any]) -> dict[str, Any]:
    keys = "rate throttled throttle_rate rate_limit max_in_flight rate_changed_at refused_at"
    return {k: row[k] for k in [*keys.split(), "registered"]}


def test_status_endpoint_list_metrics_and_console_show_the_same_throttle(
    world: Outbox, db_url: str
) -> None:
    state = _state(world)
    # What the 429s said, in the database (a dispatcher slowed past a quiet second may
    # have raised it by one step before it stopped: the views must show what is held).
    assert state.rate is not None and RECEIVER_RATE <= state.rate <= RECEIVER_RATE + 1
    rate = state.rate
    expected = {
        "rate": rate,  # the lower of the declared 100/s and the throttle
        "throttled": True,
        "throttle_rate": rate,
        "rate_limit": DECLARED_RATE,
        "max_in_flight": DECLARED_IN_FLIGHT,
        "rate_changed_at": ms_to_iso(state.rate_changed_at),
        "refused_at": ms_to_iso(state.refused_at),
        "registered": True,
    }
    assert expected["rate_changed_at"] and expected["refused_at"]

    status = json.loads(_cli("--app", APP, "status", "--json"))
    [row] = [r for r in status["endpoint_states"] if r["endpoint"] == "rx"]
    assert _fields(row) == expected
    assert row["circuit"] == "closed" and row["throttle_enabled"] is True
    assert _fields(status["figures"]["limits"]["rx"]) == expected

    listed = json.loads(_cli("--app", APP, "endpoint", "list", "--json"))
    assert [_fields(r) for r in listed if r["endpoint"] == "rx"] == [expected]
    # Without the application the declared limits are not known; the fleet's are.
    bare = json.loads(_cli("--db", db_url, "endpoint", "list", "--json"))
    [row] = [r for r in bare if r["endpoint"] == "rx"]
    assert (row["rate"], row["throttled"], row["registered"]) == (rate, True, False)
    assert (row["rate_limit"], row["max_in_flight"]) == (None, None)

    words = (
        f"rate {rate:g} req/s, throttled (this rate since {expected['rate_changed_at']}), "
        f"last refusal {expected['refused_at']}; declared rate_limit 100 req/s, "
        f"max_in_flight {DECLARED_IN_FLIGHT}"
    )
    assert words in _cli("--app", APP, "endpoint", "list")
    assert words in _cli("--app", APP, "status")

    samples = _scrape(world)
    assert samples[("outbox_endpoint_rate_limit", "rx")] == rate
    assert samples[("outbox_endpoint_throttled", "rx")] == 1.0
    assert samples[("outbox_endpoint_circuit_state", "rx")] == 0.0

    row_html = _console_row(world)
    assert f'data-rate="{rate}"' in row_html
    assert 'data-throttled="1"' in row_html
    assert f"{rate:g} req/s" in row_html and "throttled</span>" in row_html
    assert "declared 100 req/s" in row_html
    assert f"this rate since {when(state.rate_changed_at)}" in row_html
    assert f"last refusal {when(state.refused_at)}" in row_html
    assert f'<td class="num">{DECLARED_IN_FLIGHT}</td>' in row_html


def test_an_endpoint_that_was_never_throttled_shows_its_declared_rate(db_url: str) -> None:
    declared = Endpoint(name="rx", base_url="http://127.0.0.1:9", rate_limit=5, throttle=None)
    with Outbox(db_url, endpoints=[declared]) as ob:
        samples = _scrape(ob)
        assert samples[("outbox_endpoint_rate_limit", "rx")] == 5.0
        assert samples[("outbox_endpoint_throttled", "rx")] == 0.0
        row_html = _console_row(ob)
        assert 'data-rate="5.0"' in row_html and 'data-throttled="0"' in row_html
        assert "throttle off" in row_html
        unlimited = Outbox(db_url, endpoints=[Endpoint(name="free", base_url="http://x:9")])
        with unlimited:
            samples = _scrape(unlimited)
        assert ("outbox_endpoint_rate_limit", "free") not in samples  # nothing limits it
        assert samples[("outbox_endpoint_throttled", "free")] == 0.0
