"""The ``outbox`` command line, operator side, on SQLite and PostgreSQL.

Most commands run in-process through click's CliRunner against ``outbox.cli:main``; a
few run the installed command as a real subprocess. The database holds an operation in
every state, each reached through a real receiver and real dispatches (see
``tests/integration/_reconcile_states.py``). ``--app`` names an application module whose
Outbox has the same endpoints and a FakeClock set to the time the test chooses.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner, Result

from outbox.cli import main
from outbox.testing.receiver import Receiver
from tests.integration import _reconcile_states as S
from tests.integration._reconcile_states import (
    ATTEMPT_KEYS,
    DARK,
    LIST_KEYS,
    LOST,
    OPERATION_KEYS,
    REPORT_KEYS,
    RETENTION,
    STATUS_KEYS,
    UNRESOLVED,
)

REPO = Path(__file__).resolve().parents[2]
OUTBOX_SCRIPT = Path(sys.executable).with_name("outbox")
DAY_MS = 86_400_000
#: The environment variables the command line reads; tests start without them.
OUR_ENV = ("OUTBOX_DATABASE_URL", "OUTBOX_DB", "OUTBOX_SCHEMA", "OUTBOX_APP")

#: `reconcile list` order: oldest first (lost went unresolved 120 s before busy and dark).
UNRESOLVED_IN_LIST_ORDER = (LOST, S.BUSY, DARK)
EVERY_STATE_COUNTS = {
    "pending": 1,
    "in_flight": 1,
    "succeeded": 1,
    "failed": 1,
    "cancelled": 1,
    "unresolved": 3,
}


class World(S.World):
    """A database with an operation in every state, and the command line over it."""

    def env(self, now_ms: int | None = None) -> dict[str, str | None]:
        env: dict[str, str | None] = {name: None for name in OUR_ENV}
        env.update(
            S.app_env(
                self.db_url,
                self.receiver.url,
                self.offline_url,
                self.clock.now_ms() if now_ms is None else now_ms,
            )
        )
        return env

    def cli(self, *args: str, app: bool = True, now_ms: int | None = None) -> Result:
        """``outbox --app ... ARGS`` (or ``--db URL`` with ``app=False``), in-process."""
        base = ["--app", S.APP] if app else ["--db", self.db_url]
        return CliRunner().invoke(
            main, [*base, *args], env=self.env(now_ms), catch_exceptions=False
        )

    def json(self, *args: str, app: bool = True, now_ms: int | None = None) -> Any:
        result = self.cli(*args, "--json", app=app, now_ms=now_ms)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        return json.loads(result.stdout)


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    # The CLI configures structlog to write to the (captured) stderr of the moment.
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def world(db_url: str, receiver: Receiver) -> Iterator[World]:
    with S.every_state_world(World, db_url, receiver) as w:
        yield w


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def shared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    """One world per database for the tests that only read or are refused."""
    directory = tmp_path_factory.mktemp(f"cli-{request.param}")
    with (
        S.database(request.param, directory) as url,
        Receiver(directory / "receiver.sqlite3") as rx,
        S.every_state_world(World, url, rx) as w,
    ):
        yield w


def table(text: str) -> list[list[str]]:
    """The body rows of every rich table in ``text``, as lists of cell strings."""
    return [
        [cell.strip() for cell in line.strip().strip("│").split("│")]
        for line in text.splitlines()
        if line.lstrip().startswith("│")
    ]


def first_column(text: str) -> list[str]:
    return [row[0] for row in table(text)]


def run_outbox(
    args: Sequence[str], *, env: dict[str, str | None] | None = None, module: bool = False
) -> subprocess.CompletedProcess[str]:
    """The installed command (or ``python -m outbox.cli``) as a real process."""
    command = [sys.executable, "-m", "outbox.cli"] if module else [str(OUTBOX_SCRIPT)]
    full_env = {k: v for k, v in os.environ.items() if k not in OUR_ENV}
    full_env.update({k: v for k, v in (env or {}).items() if v is not None})
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=full_env,
        check=False,
    )


# -- status -------------------------------------------------------------------------------


def test_status_table_and_json(shared: World) -> None:
    world = shared
    result = world.cli("status")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "outbox status" in out
    states = out.split("oldest pending:")[0]
    assert {row[0]: int(row[1]) for row in table(states)} == EVERY_STATE_COUNTS
    assert "oldest pending: 0.0s" in out
    assert (
        "reconciliation backlog: 3 (never_delivered=1, outcome_unknown=1, retries_exhausted=1)"
        in out
    )
    assert "attempts in the last hour: 8" in out
    assert "keys near expiry (within 1h): 0; keys already expired: 0" in out
    assert "PROBLEM" not in out

    data = world.json("status")
    assert set(data) == STATUS_KEYS
    assert data["counts"] == EVERY_STATE_COUNTS
    assert {k: v for k, v in data["unresolved_by_reason"].items() if v} == {
        "never_delivered": 1,
        "outcome_unknown": 1,
        "retries_exhausted": 1,
    }
    assert data["reconciliation_backlog"] == 3
    assert data["attempts_last_hour"] == 8
    assert data["oldest_pending_age_seconds"] == 0.0
    assert data["keys_near_expiry"] == 0
    assert (data["problems"], data["ok"]) == ([], True)

    # Two minutes later by the application's clock.
    later = world.json("status", now_ms=world.clock.now_ms() + 120_000)
    assert later["oldest_pending_age_seconds"] == 120.0

    # --db alone (no application code) reads the same counts.
    bare = world.json("status", app=False)
    assert bare["counts"] == EVERY_STATE_COUNTS
    assert bare["reconciliation_backlog"] == 3


def test_status_check_exit_codes_follow_the_thresholds(world: World) -> None:
    failing = world.cli("status", "--check")
    assert failing.exit_code == 1
    assert "PROBLEM: 3 unresolved operations (threshold 0)" in failing.stdout
    # The pending operation is due and no dispatcher ever ran (tests/acceptance/
    # test_observability.py covers that rule); the thresholds below are tested without it.
    assert "PROBLEM: 1 operations are due and no dispatcher was seen" in failing.stdout

    assert world.cli("status", "--check", "--max-unresolved", "3").exit_code == 1
    assert (
        world.cli("status", "--check", "--max-unresolved", "3", "--no-dispatcher-check").exit_code
        == 0
    )

    # 90 minutes on, every attempted live key (two hours' retention) expires within the hour.
    two_hours_later = world.clock.now_ms() + 90 * 60_000
    late = world.cli("status", "--check", "--max-unresolved", "3", "--no-dispatcher-check",
                     "--json", now_ms=two_hours_later)  # fmt: skip
    assert late.exit_code == 1
    data = json.loads(late.stdout)
    assert data["ok"] is False
    assert data["keys_near_expiry"] == 4  # busy, lost, dark, stuck: attempted and live
    assert data["problems"] == [
        "oldest pending operation is 5400s old (threshold 3600s)",
        "4 live operations within 1h of key expiry (threshold 0)",
    ]
    relaxed = world.cli(
        "status",
        "--check",
        "--max-unresolved",
        "3",
        "--max-pending-age",
        "3h",
        "--max-near-expiry",
        "4",
        "--no-dispatcher-check",
        now_ms=two_hours_later,
    )
    assert relaxed.exit_code == 0, relaxed.stdout

    # Settle the reconciliation queue: the default thresholds are met again.
    for ref in UNRESOLVED:
        done = world.cli(
            "reconcile", "resolve", ref.operation_id, "--tenant", ref.tenant,
            "--as", "failed", "--note", "checked with the receiver",
        )  # fmt: skip
        assert done.exit_code == 0, done.stderr
    ok = world.cli("status", "--check", "--no-dispatcher-check")
    assert ok.exit_code == 0, ok.stdout
    assert "PROBLEM" not in ok.stdout
    assert "reconciliation backlog: 0" in ok.stdout


# -- reconcile list -------------------------------------------------------------------------


def test_reconcile_list_table_json_filters_and_paging(shared: World) -> None:
    world = shared
    result = world.cli("reconcile", "list")
    assert result.exit_code == 0, result.stderr
    assert "unresolved operations (3 shown of 3 matching)" in result.stdout
    rows = table(result.stdout)
    assert [r[0] for r in rows] == ["op-lost", "op-busy", "op-dark"]  # oldest first
    assert [r[1] for r in rows] == ["globex", "acme", ""]
    assert [r[2] for r in rows] == ["fragile", "inventory", "offline"]
    assert [r[4] for r in rows] == ["1", "2", "2"]
    assert "next: outbox reconcile show op-lost --tenant globex --app " in result.stdout

    def listed(*args: str) -> list[str]:
        r = world.cli("reconcile", "list", *args)
        assert r.exit_code == 0, r.stderr
        return first_column(r.stdout)

    assert listed("--tenant", "acme") == ["op-busy"]
    assert listed("--tenant", "") == ["op-dark"]
    assert listed("--tenant", "nobody") == []
    assert listed("--endpoint", "fragile") == ["op-lost"]
    assert listed("--reason", "never_delivered") == ["op-dark"]
    assert listed("--reason", "retries_exhausted", "--tenant", "acme") == ["op-busy"]
    assert listed("--limit", "1") == ["op-lost"]
    assert listed("--limit", "1", "--offset", "1") == ["op-busy"]
    assert listed("--older-than", "1m") == ["op-lost"]  # busy and dark: 120 s younger
    empty = world.cli("reconcile", "list", "--offset", "3")
    assert "(0 shown of 3 matching)" in empty.stdout and "next:" not in empty.stdout
    page = world.cli("reconcile", "list", "--limit", "1", "--reason", "outcome_unknown")
    assert "(1 shown of 1 matching)" in page.stdout and "more:" not in page.stdout
    first = world.cli("reconcile", "list", "--limit", "2")
    assert "(2 shown of 3 matching)" in first.stdout
    assert "more: outbox reconcile list --limit 2 --offset 2 --app " in first.stdout

    listing = world.json("reconcile", "list")
    assert set(listing) == LIST_KEYS
    assert (listing["total"], listing["limit"], listing["offset"]) == (3, 50, 0)
    data = listing["operations"]
    assert [d["operation_id"] for d in data] == ["op-lost", "op-busy", "op-dark"]
    for item in data:
        assert set(item) == OPERATION_KEYS
        assert item["state"] == "unresolved"
        assert item["next_attempt_at"] is None
        assert item["body"] == {"op": item["operation_id"], "quantity": 2}
    assert [d["reason"] for d in data] == [r.reason for r in UNRESOLVED_IN_LIST_ORDER]
    paged = world.json("reconcile", "list", "--limit", "2", "--offset", "1")
    assert [d["operation_id"] for d in paged["operations"]] == ["op-busy", "op-dark"]
    assert (paged["total"], paged["limit"], paged["offset"]) == (3, 2, 1)
    # Without application code it lists the same queue.
    bare = world.json("reconcile", "list", "--endpoint", "offline", app=False)
    assert [d["operation_id"] for d in bare["operations"]] == ["op-dark"]
    assert bare["total"] == 1


# -- show -------------------------------------------------------------------------------------


def test_show_json_has_the_evidence_and_a_stable_shape(shared: World) -> None:
    world = shared
    for ref in UNRESOLVED:
        data = world.json("reconcile", "show", ref.operation_id, "--tenant", ref.tenant)
        assert set(data) == REPORT_KEYS
        assert set(data["requeue_risk"]) == {
            "key_expires_at",
            "key_retention_passed",
            "note",
            "policy_source",
        }
        assert all(set(a) == ATTEMPT_KEYS for a in data["attempts"])
        assert (data["state"], data["reason"]) == ("unresolved", ref.reason)
        assert data["requeue_risk"]["key_retention_passed"] is False
        request_ids = [a["request_id"] for a in data["attempts"]]
        assert len(set(request_ids)) == len(request_ids) == data["attempts_total"]
        seen = world.receiver.requests(key=ref.operation_id, tenant=ref.tenant)
        assert [r.request_id for r in seen] == ([] if ref is DARK else request_ids)
        assert all(r.key == ref.operation_id for r in seen)  # one operation ID throughout
        # `outbox show` is the same report.
        assert world.json("show", ref.operation_id, "--tenant", ref.tenant) == data

    lost = world.json("show", "op-lost", "--tenant", "globex")
    assert "may have reached the receiver" in lost["explanation"]
    assert lost["attempts"][0]["delivery"] == "unknown"
    assert lost["attempts"][0]["error_class"] == "RemoteProtocolError"
    busy = world.json("show", "op-busy", "--tenant", "acme")
    assert [a["status"] for a in busy["attempts"]] == [503, 503]
    # The test receiver only echoes our own X-Request-ID: that is not its own request ID.
    assert [a["receiver_request_id"] for a in busy["attempts"]] == [None, None]
    ok = world.json("show", "op-ok", "--tenant", "acme")
    assert ok["state"] == "succeeded" and ok["result"]["status"] == 201
    cancelled = world.json("show", "op-cancel", "--tenant", "globex")
    assert [(a["actor"], a["action"]) for a in cancelled["audit"]] == [
        (getpass.getuser(), "cancel")
    ]
    # Reading needs no application code.
    assert (
        world.json("show", "op-busy", "--tenant", "acme", app=False)["attempts"]
        == (busy["attempts"])
    )


def test_show_table_tells_the_story(shared: World) -> None:
    world = shared
    result = world.cli("reconcile", "show", "op-busy", "--tenant", "acme")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    op = world.ob.get("op-busy", tenant="acme")
    assert "op-busy  tenant='acme'  endpoint=inventory" in out
    assert "state: unresolved (retries_exhausted)" in out
    assert "why: every answer was a refusal before work (503)" in out
    assert "request: POST /reservations" in out
    assert 'body: {"op": "op-busy", "quantity": 2}' in out
    rows = table(out)
    assert [r[0] for r in rows] == ["1", "2"]
    assert [r[3] for r in rows] == ["sent", "sent"]
    assert [r[4] for r in rows] == ["503", "503"]
    for row, attempt in zip(rows, op.attempts, strict=True):
        # However narrow the terminal, the start of each request ID is shown.
        assert attempt.request_id.startswith(row[1].rstrip("…"))
    assert "  - attempt 1: the receiver refused it with 503 before doing any work" in out
    assert "  - attempt 2: the receiver refused it with 503 before doing any work" in out
    assert "requeue risk: the receiver still remembers the key" in out

    lost = world.cli("show", "op-lost", "--tenant", "globex").stdout
    assert "state: unresolved (outcome_unknown)" in lost
    assert "why: attempt 1 may have reached the receiver" in lost
    assert "resolve or requeue" in lost

    cancelled = world.cli("show", "op-cancel", "--tenant", "globex").stdout
    assert "state: cancelled" in cancelled
    assert "requeue risk" not in cancelled  # only for the reconciliation queue
    assert "audit:" in cancelled
    user = getpass.getuser()
    assert f"{user} cancel pending -> cancelled: customer withdrew the order" in cancelled


def test_tables_print_whole_request_ids_and_reasons(shared: World) -> None:
    world = shared
    shown = world.cli("show", "op-busy", "--tenant", "acme").stdout
    for attempt in world.ob.get("op-busy", tenant="acme").attempts:
        assert attempt.request_id in shown
    listed = world.cli("reconcile", "list").stdout
    for reason in ("outcome_unknown", "retries_exhausted", "never_delivered"):
        assert reason in listed


# -- operator actions ---------------------------------------------------------------------


def test_resolve_succeeds_and_is_audited(world: World) -> None:
    result = world.cli(
        "reconcile", "resolve", "op-lost", "--tenant", "globex", "--as", "succeeded",
        "--note", "receiver shows reservation R-17", "--operator", "alice",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "resolved op-lost as succeeded"
    (row,) = world.audit("op-lost")
    assert (row["actor"], row["action"], row["from_state"], row["to_state"], row["note"]) == (
        "alice",
        "resolve",
        "unresolved",
        "succeeded",
        "receiver shows reservation R-17",
    )

    data = world.json(
        "reconcile", "resolve", "op-busy", "--tenant", "acme", "--as", "failed",
        "--note", "never applied",
    )  # fmt: skip
    assert set(data) == OPERATION_KEYS
    assert (data["operation_id"], data["state"]) == ("op-busy", "failed")
    (row,) = world.audit("op-busy")
    assert row["actor"] == getpass.getuser()  # the OS user by default
    shown = world.json("reconcile", "show", "op-busy", "--tenant", "acme")
    assert [(a["actor"], a["to_state"], a["note"]) for a in shown["audit"]] == [
        (getpass.getuser(), "failed", "never applied")
    ]


def test_refused_actions_exit_1_say_why_and_change_nothing(shared: World) -> None:
    world = shared
    retention_passed = world.clock.now_ms() + int(RETENTION.total_seconds() * 1000) + 1000
    resolve = ("reconcile", "resolve")
    cases: list[tuple[tuple[str, ...], str, dict[str, Any]]] = [
        ((*resolve, "op-ok", "--tenant", "acme", "--as", "failed", "--note", "n"),
         "'op-ok' is succeeded, not unresolved", {}),
        ((*resolve, "op-bad", "--tenant", "acme", "--as", "succeeded", "--note", "n"),
         "is failed, not unresolved", {}),
        ((*resolve, "op-wait", "--tenant", "acme", "--as", "failed", "--note", "n"),
         "is pending, not unresolved", {}),
        ((*resolve, "op-stuck", "--as", "failed", "--note", "n"),
         "is in_flight, not unresolved", {}),
        ((*resolve, "op-cancel", "--tenant", "globex", "--as", "failed", "--note", "n"),
         "is cancelled, not unresolved", {}),
        (("reconcile", "requeue", "op-ok", "--tenant", "acme", "--note", "n"),
         "only operations in the reconciliation queue can be requeued", {}),
        (("reconcile", "requeue", "op-wait", "--tenant", "acme", "--note", "n"),
         "is pending, not unresolved", {}),
        (("cancel", "op-busy", "--tenant", "acme", "--note", "n"),
         "is unresolved; only pending operations can be cancelled", {}),
        (("cancel", "op-stuck", "--note", "n"), "is in_flight; only pending", {}),
        (("cancel", "op-ok", "--tenant", "acme", "--note", "n"), "is succeeded", {}),
        (("cancel", "op-cancel", "--tenant", "globex", "--note", "n"), "is cancelled", {}),
        # Operation IDs live in a tenant: the default tenant "" has no op-lost.
        ((*resolve, "op-lost", "--as", "failed", "--note", "n"),
         "no operation 'op-lost' in tenant ''", {}),
        (("show", "op-nope"), "no operation 'op-nope'", {}),
        (("reconcile", "show", "op-lost", "--tenant", "acme"), "no operation", {}),
        # After the receiver's key retention, only with --accept-duplicate-risk.
        (("reconcile", "requeue", "op-lost", "--tenant", "globex", "--note", "n"),
         "--accept-duplicate-risk requeues it anyway and restarts the key's life",
         {"now_ms": retention_passed}),
    ]  # fmt: skip
    for args, message, options in cases:
        before = world.rows()
        result = world.cli(*args, **options)
        assert result.exit_code == 1, (args, result.stdout, result.stderr)
        assert result.stderr.startswith("error: "), (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert result.stdout == "", args
        assert world.rows() == before, f"{args} changed the tables"
    assert [r["action"] for r in world.audit()] == ["cancel"]  # the fixture's own


def test_usage_errors_exit_2_and_change_nothing(shared: World) -> None:
    world = shared
    lost = ("op-lost", "--tenant", "globex")
    cases: list[tuple[tuple[str, ...], str]] = [
        (("reconcile", "resolve", *lost, "--as", "maybe", "--note", "n"), "'maybe'"),
        (("reconcile", "resolve", *lost, "--as", "failed"), "--note"),
        (("reconcile", "resolve", *lost, "--note", "n"), "--as"),
        (("reconcile", "resolve", *lost, "--as", "failed", "--note", "  "), "note is required"),
        (("reconcile", "resolve", *lost, "--as", "failed", "--note", "n",
          "--operator", "eve\x07"), "operator name"),
        (("reconcile", "requeue", *lost), "--note"),
        (("cancel", "op-wait", "--tenant", "acme"), "--note"),
        (("purge",), "--older-than"),
        (("purge", "--older-than", "soon"), "duration must look like 90s, 30m, 1h30m"),
        (("purge", "--older-than", "0d"), "must be positive"),
        (("reconcile", "list", "--limit", "0"), "--limit"),
        (("reconcile", "list", "--offset", "-1"), "--offset"),
        (("reconcile", "list", "--reason", "bogus"), "'bogus'"),
        (("reconcile", "list", "--older-than", "yesterday"), "duration must look like"),
        (("status", "--check", "--max-pending-age", "forever"), "duration must look like"),
        (("show", "not an id!"), "operation"),
        (("reconcile", "frobnicate", "op-lost"), "frobnicate"),
    ]  # fmt: skip
    for args, message in cases:
        before = world.rows()
        result = world.cli(*args)
        assert result.exit_code == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert world.rows() == before, f"{args} changed the tables"

    runner = CliRunner()
    no_db = runner.invoke(main, ["status"], env={name: None for name in OUR_ENV})
    assert no_db.exit_code == 2
    assert "--db URL" in no_db.stderr
    bad_app = runner.invoke(main, ["--app", "no_attribute_named", "status"], env=world.env())
    assert bad_app.exit_code == 2
    assert "module:attr" in bad_app.stderr
    assert [r["action"] for r in world.audit()] == ["cancel"]


def test_requeue_then_dispatch_sends_the_same_operation_id_and_the_receiver_replays(
    world: World,
) -> None:
    before = world.json("show", "op-lost", "--tenant", "globex")
    data = world.json("reconcile", "requeue", "op-lost", "--tenant", "globex", "--note", "unsure")
    assert set(data) == OPERATION_KEYS
    assert (data["state"], data["reason"], data["attempts_counted"]) == ("pending", None, 0)
    assert data["version"] == before["version"] + 1
    (row,) = world.audit("op-lost")
    assert (row["action"], row["from_state"], row["to_state"], row["actor"]) == (
        "requeue",
        "unresolved",
        "pending",
        getpass.getuser(),
    )

    summary = world.json("dispatch", "--once")
    assert summary["succeeded"] == 2  # op-lost, and op-wait that was pending all along
    assert summary["attempts"] == 2

    after = world.json("show", "op-lost", "--tenant", "globex")
    assert after["state"] == "succeeded"
    first, second = after["attempts"]
    assert first["request_id"] == before["attempts"][0]["request_id"]
    assert second["request_id"] != first["request_id"]
    seen = world.receiver.requests(key="op-lost", tenant="globex")
    assert [r.request_id for r in seen] == [first["request_id"], second["request_id"]]
    assert [r.outcome for r in seen] == ["fault:drop_after_commit", "replayed"]
    assert world.receiver.effect_count(key="op-lost", tenant="globex") == 1
    assert after["result"]["headers"]["idempotent-replayed"] == "true"


def test_requeue_after_key_retention_needs_accept_duplicate_risk(world: World) -> None:
    later = world.clock.now_ms() + int(RETENTION.total_seconds() * 1000) + 1000
    risk = world.json("reconcile", "show", "op-lost", "--tenant", "globex", now_ms=later)
    assert risk["requeue_risk"]["key_retention_passed"] is True
    shown = world.cli("reconcile", "show", "op-lost", "--tenant", "globex", now_ms=later)
    assert "requeue risk: the receiver's key retention has passed" in shown.stdout

    args = ("reconcile", "requeue", "op-lost", "--tenant", "globex", "--note", "checked")
    before = world.rows()
    refused = world.cli(*args, now_ms=later)
    assert refused.exit_code == 1
    assert "--accept-duplicate-risk" in refused.stderr
    assert world.rows() == before

    accepted = world.cli(*args, "--accept-duplicate-risk", "--operator", "dana", now_ms=later)
    assert accepted.exit_code == 0, accepted.stderr
    assert "requeued op-lost" in accepted.stdout
    (row,) = world.audit("op-lost")
    assert row["actor"] == "dana"
    assert json.loads(row["details"])["accept_duplicate_risk"] is True
    assert world.ob.get("op-lost", tenant="globex").state.value == "pending"


def test_purge_deletes_old_terminal_operations_and_nothing_else(world: World) -> None:
    engine = world.ob.engine
    world.clock.advance(31 * 86_400)
    # Terminal a moment ago: resolved and cancelled "now", 31 days on.
    assert world.cli(
        "reconcile", "resolve", "op-dark", "--as", "failed", "--note", "host is gone"
    ).exit_code == 0  # fmt: skip
    S.enqueue(world.ob, S.Ref("", "op-fresh", "inventory", "pending"))
    assert world.cli("cancel", "op-fresh", "--note", "duplicate").exit_code == 0
    live = ["op-busy", "op-lost", "op-stuck", "op-wait", "op-dark", "op-fresh"]
    kept_before = [r for r in world.rows()["outbox_operations"] if r[2] in live]
    attempts_before = S.attempt_count(engine, live)
    assert S.attempt_count(engine, ["op-ok", "op-bad", "op-cancel"]) == 2

    data = world.json("purge", "--older-than", "30d")
    assert data == {
        "removed": {"cancelled": 1, "failed": 1, "succeeded": 1},
        "total": 3,
        "dry_run": False,
    }
    assert S.state_counts(engine) == {
        "unresolved": 2,
        "in_flight": 1,
        "pending": 1,
        "failed": 1,
        "cancelled": 1,
    }
    assert [r for r in world.rows()["outbox_operations"] if r[2] in live] == kept_before
    assert S.attempt_count(engine, live) == attempts_before
    assert S.attempt_count(engine, ["op-ok", "op-bad", "op-cancel"]) == 0
    assert S.orphan_attempts(engine) == 0
    assert world.cli("show", "op-ok", "--tenant", "acme").exit_code == 1
    (purge_row,) = [r for r in world.audit() if r["action"] == "purge"]
    assert json.loads(purge_row["details"]) == data["removed"]

    again = world.cli("purge", "--older-than", "30d")
    assert again.exit_code == 0
    assert again.stdout.strip() == "purged 0 operations (nothing)"
    # A second later everything terminal is old enough; the rest is never touched.
    everything = world.cli("purge", "--older-than", "1s", now_ms=world.clock.now_ms() + 5000)
    assert everything.stdout.strip() == "purged 2 operations (cancelled=1, failed=1)"
    assert S.state_counts(engine) == {"unresolved": 2, "in_flight": 1, "pending": 1}


# -- the installed command, as real processes --------------------------------------------


def test_installed_command_reads_refuses_and_exits_with_the_documented_codes(
    shared: World,
) -> None:
    world = shared
    db = ["--db", world.db_url]
    shown = run_outbox([*db, "show", "op-lost", "--tenant", "globex", "--json"])
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert set(data) == REPORT_KEYS
    seen = world.receiver.requests(key="op-lost", tenant="globex")
    assert [a["request_id"] for a in data["attempts"]] == [r.request_id for r in seen]

    check = run_outbox([*db, "status", "--check"], module=True)
    assert check.returncode == 1
    assert "PROBLEM: 3 unresolved operations" in check.stdout

    before = world.rows()
    later = world.clock.now_ms() + int(RETENTION.total_seconds() * 1000) + 1000
    risky = run_outbox(
        ["--app", S.APP, "reconcile", "requeue", "op-lost", "--tenant", "globex", "--note", "n"],
        env=world.env(later),
    )
    assert risky.returncode == 1, risky.stderr
    assert "--accept-duplicate-risk" in risky.stderr
    assert world.rows() == before


def test_two_operators_resolving_at_once_from_two_processes_exactly_one_wins(
    world: World,
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in OUR_ENV}
    resolve = [str(OUTBOX_SCRIPT), "--db", world.db_url, "reconcile", "resolve", "op-lost"]
    procs = {
        who: subprocess.Popen(
            [*resolve, "--tenant", "globex", "--as", outcome, "--operator", who, "--note", who],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for who, outcome in (("alice", "succeeded"), ("bob", "failed"))
    }
    results = {who: (*p.communicate(timeout=60), p.returncode) for who, p in procs.items()}
    assert sorted(code for _, _, code in results.values()) == [0, 1], results
    winner = next(who for who, (_, _, code) in results.items() if code == 0)
    (loser_err,) = [err for _, err, code in results.values() if code == 1]
    # Either it lost on the version check, or it read the operation after the winner.
    assert re.search(r"changed while you acted|not unresolved", loser_err), loser_err
    rows = world.audit("op-lost")
    assert [(r["action"], r["actor"]) for r in rows] == [("resolve", winner)]
    state = world.ob.get("op-lost", tenant="globex").state.value
    assert state == ("succeeded" if winner == "alice" else "failed") == rows[0]["to_state"]
