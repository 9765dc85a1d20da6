"""``outbox status`` stays cheap however long the history: the settled operations are
counted only up to a limit (more: not counted, and the report says so), ``--settled``
counts them all, the live figures are exact either way (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from outbox import Endpoint, Outbox
from outbox.cli import main
from outbox.reconcile import status as status_module
from outbox.testing.receiver import Receiver

SETTLED = ("succeeded", "failed", "cancelled")


@pytest.fixture
def ob(db_url: str, tmp_path: Path) -> Iterator[Outbox]:
    with Receiver(tmp_path / "rx.sqlite3") as rx:
        box = Outbox(db_url, endpoints=[Endpoint(name="rx", base_url=rx.start().url)])
        for i in range(5):
            box.enqueue(endpoint="rx", method="POST", path="/o", json={"i": i},
                        operation_id=f"done-{i}")  # fmt: skip
        box.dispatch_once()
        box.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="live")
        yield box
        box.close()


def test_settled_counts_up_to_the_limit_and_not_beyond(ob: Outbox) -> None:
    rec = ob.reconcile
    exact = rec.status(settled_limit=5)  # at the limit: counted
    assert exact.counts["succeeded"] == 5 and exact.counts["failed"] == 0
    assert exact.figures.settled_over is None
    over = rec.status(settled_limit=4)
    assert all(over.counts[s] is None for s in SETTLED)
    assert over.counts["pending"] == 1  # the live figures are exact either way
    assert over.figures.settled_over == 4
    assert over.as_dict()["figures"]["settled_over_limit"] == 4
    everything = rec.status(settled_limit=None)
    assert everything.counts["succeeded"] == 5 and everything.figures.settled_over is None
    none = rec.status(settled=False)
    assert none.counts["succeeded"] is None and none.figures.settled_over is None
    assert rec.status().counts["succeeded"] == 5  # the default limit, far above 5


def test_the_cli_says_when_it_did_not_count_and_settled_counts_all(
    ob: Outbox, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = CliRunner().invoke(main, ["--db", db_url, "status"])
    assert plain.exit_code == 0, plain.output
    assert "settled: more than" not in plain.output
    monkeypatch.setattr(status_module, "SETTLED_COUNT_LIMIT", 4)
    capped = CliRunner().invoke(main, ["--db", db_url, "status"])
    assert capped.exit_code == 0, capped.output
    assert "settled: more than 4, not counted (outbox status --settled counts them" in (
        capped.output
    )
    data = json.loads(CliRunner().invoke(main, ["--db", db_url, "status", "--json"]).output)
    assert data["counts"]["succeeded"] is None and data["counts"]["pending"] == 1
    assert data["figures"]["settled_over_limit"] == 4
    full = json.loads(
        CliRunner().invoke(main, ["--db", db_url, "status", "--json", "--settled"]).output
    )
    assert full["counts"]["succeeded"] == 5 and full["figures"]["settled_over_limit"] is None
    none = json.loads(
        CliRunner().invoke(main, ["--db", db_url, "status", "--json", "--no-settled"]).output
    )
    assert none["counts"]["succeeded"] is None
    assert none["figures"]["settled_over_limit"] is None


def test_past_the_default_limit_status_and_the_console_say_more_than(tmp_path: Path) -> None:
    import html

    from starlette.testclient import TestClient

    from benchmarks.status_history import populate
    from outbox.console import Credentials, create_app
    from outbox.reconcile.status import SETTLED_COUNT_LIMIT

    url = f"sqlite:///{tmp_path / 'history.sqlite3'}"
    populate(url, SETTLED_COUNT_LIMIT + 1)  # settled rows, and a live backlog of 70
    with Outbox(url) as box:
        report = box.reconcile.status()
        assert report.counts["succeeded"] is None and report.counts["pending"] == 50
        assert report.figures.settled_over == SETTLED_COUNT_LIMIT
        token = "alice-" + "a" * 20
        creds = Credentials.parse(f"alice:{token}\n", default_name="nobody", source="test")
        c = TestClient(create_app(box, creds), base_url="http://127.0.0.1")
        assert c.post("/login", data={"token": token}, follow_redirects=False).status_code == 303
        page = html.unescape(c.get("/").text)
    assert f'>{SETTLED_COUNT_LIMIT}</span><span class="label">succeeded' in page
    assert "None" not in page
