"""The operator at 3 a.m.: the installed ``outbox`` command as real processes, on a real
SQLite file and the real PostgreSQL server.

* It never lies: read commands never create a database; a missing file or schema is
  exit 3 with one line naming the URL and a fix that works when pasted (each is run).
* It never crashes: every failure is one line and a documented exit code; ``--debug``
  adds the traceback.
* ``--db`` before or after the command, ``OUTBOX_DB``; ``--schema`` on PostgreSQL.
* Requeue is decided from the database alone (the policy snapshot), without ``--app``.
* Bulk actions: dry run, confirmation on a terminal (a real pty), summary, audit rows,
  and an operation changed by another operator while the run waits for confirmation.
* ``purge --dry-run/--vacuum`` and ``dispatch --until-empty``.
"""

from __future__ import annotations

import json
import os
import pty
import select
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy import inspect, text

from outbox import FakeClock, Outbox
from outbox.store.revisions import HEAD
from outbox.testing.receiver import Receiver
from tests.conftest import POSTGRES_URL, require_postgres
from tests.integration import _reconcile_states as S

REPO = Path(__file__).resolve().parents[2]
OUTBOX = str(Path(sys.executable).with_name("outbox"))
_OUR_ENV = ("OUTBOX_DB", "OUTBOX_DATABASE_URL", "OUTBOX_SCHEMA", "OUTBOX_APP", S.APP_ENV)


def run(args: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``outbox ARGS`` as a real process, from the repository root, no terminal."""
    full_env = {k: v for k, v in os.environ.items() if k not in _OUR_ENV}
    full_env.update(env or {})
    return subprocess.run(
        [OUTBOX, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=full_env,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The failure's single stderr line (and nothing like a traceback)."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def run_hint(line: str, marker: str) -> subprocess.CompletedProcess[str]:
    """Run the command a message tells the operator to paste."""
    command = line.split(marker, 1)[1].strip()
    words = shlex.split(command)
    assert words[0] == "outbox", command
    return run(words[1:])


def run_on_terminal(
    args: Sequence[str],
    answer: str | None,
    extra_env: dict[str, str] | None = None,
    at_prompt: Callable[[], None] | None = None,
) -> tuple[int, str]:
    """``outbox ARGS`` on a pseudo-terminal; type ``answer`` at the prompt (after running
    ``at_prompt``: the command is then held between its selection and its changes)."""
    env = {k: v for k, v in os.environ.items() if k not in _OUR_ENV}
    env.update({"COLUMNS": "200", "TERM": "xterm", **(extra_env or {})})
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.chdir(REPO)
        os.execve(OUTBOX, [OUTBOX, *args], env)  # noqa: S606 - our own command
    output = b""
    answered = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        output += chunk
        if answer is not None and not answered and b"[y/N]" in output:
            if at_prompt is not None:
                at_prompt()
            os.write(fd, answer.encode() + b"\n")
            answered = True
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace")


@pytest.fixture
def fresh_schema() -> Iterator[str]:
    """A schema name nobody has created yet; dropped afterwards if something did."""
    require_postgres()
    name = f"t14_{uuid.uuid4().hex[:10]}"
    yield name
    admin = sa_create_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
    admin.dispose()


def _schema_exists(name: str) -> bool:
    admin = sa_create_engine(POSTGRES_URL)
    try:
        with admin.connect() as conn:
            return bool(
                conn.execute(
                    text("SELECT count(*) FROM pg_namespace WHERE nspname = :n"), {"n": name}
                ).scalar()
            )
    finally:
        admin.dispose()


READ_COMMANDS: list[list[str]] = [
    ["status"],
    ["status", "--check"],
    ["show", "op-1"],
    ["reconcile", "list"],
    ["reconcile", "show", "op-1"],
    ["reconcile", "resolve", "op-1", "--as", "failed", "--note", "n"],
    ["purge", "--older-than", "30d"],
]


# -- never lie: read commands never create --------------------------------------------------


def test_a_mistyped_sqlite_path_is_exit_3_creates_nothing_and_the_hint_works(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "typo" / "outbox.sqlite3"
    url = f"sqlite:///{missing}"
    for args in READ_COMMANDS:
        for placed in ([*args, "--db", url], ["--db", url, *args]):
            result = run(placed)
            assert result.returncode == 3, (placed, result.stderr)
            line = one_error_line(result)
            assert url in line and "does not exist" in line, line
            assert result.stdout == ""
    assert not missing.parent.exists()  # neither the file nor its directory

    # The printed fix, pasted as it is, creates the database; then the read works.
    made = run_hint(line, "to create it:")
    assert made.returncode == 0, made.stderr
    assert "outbox schema at revision" in made.stdout
    ok = run(["status", "--check", "--db", url])
    assert ok.returncode == 0, ok.stderr


def test_a_file_without_the_schema_or_an_old_one_is_exit_3_with_a_runnable_fix(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty.sqlite3"
    empty.touch(mode=0o600)
    url = f"sqlite:///{empty}"
    result = run(["status", "--check", "--db", url])
    assert result.returncode == 3
    line = one_error_line(result)
    assert f"the outbox schema is missing in {url}" in line
    assert run_hint(line, "run:").returncode == 0
    assert run(["status", "--db", url]).returncode == 0

    # A schema revisions behind: named, and the same fix upgrades it.
    from outbox.store.engine import create_engine
    from outbox.store.migrate import downgrade

    engine = create_engine(url)
    downgrade(engine, "0001")
    engine.dispose()
    old = run(["reconcile", "list", "--db", url])
    assert old.returncode == 3
    line = one_error_line(old)
    assert f"is at revision 0001, not {HEAD}" in line
    assert run_hint(line, "run:").returncode == 0
    assert run(["reconcile", "list", "--db", url]).returncode == 0


@pytest.mark.postgres
def test_a_missing_postgres_schema_is_exit_3_and_the_hint_creates_it_there(
    fresh_schema: str,
) -> None:
    for args in READ_COMMANDS:
        result = run([*args, "--db", POSTGRES_URL, "--schema", fresh_schema])
        assert result.returncode == 3, (args, result.stderr)
        line = one_error_line(result)
        assert "the outbox schema is missing" in line and f"schema {fresh_schema}" in line
    assert not _schema_exists(fresh_schema)  # reading created nothing

    made = run_hint(line, "run:")
    assert made.returncode == 0, made.stderr
    assert f"in schema {fresh_schema}" in made.stdout
    engine = sa_create_engine(POSTGRES_URL)
    try:
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names(schema=fresh_schema))
            public = set(inspect(conn).get_table_names(schema="public"))
    finally:
        engine.dispose()
    # The tables and Alembic's version table all live in the schema, none in public.
    assert {
        "outbox_operations",
        "outbox_attempts",
        "outbox_audit",
        "outbox_alembic_version",
    } <= tables
    assert not {t for t in public if t.startswith("outbox_")} & tables - public
    # And the schema can come from the environment too.
    ok = run(["status", "--check"], env={"OUTBOX_DB": POSTGRES_URL, "OUTBOX_SCHEMA": fresh_schema})
    assert ok.returncode == 0, ok.stderr


@pytest.mark.postgres
def test_outbox_schema_argument_keeps_the_library_in_its_schema(fresh_schema: str) -> None:
    assert run(["migrate", "--db", POSTGRES_URL, "--schema", fresh_schema]).returncode == 0
    receiver_less = S.endpoints("http://127.0.0.1:9", "http://127.0.0.1:9")
    with Outbox(POSTGRES_URL, schema=fresh_schema, endpoints=receiver_less) as ob:
        ob.enqueue(endpoint="inventory", method="POST", path="/r", json={}, operation_id="s-1")
    engine = sa_create_engine(POSTGRES_URL)
    try:
        with engine.connect() as conn:
            n = conn.execute(text(f'SELECT count(*) FROM "{fresh_schema}".outbox_operations'))
            assert n.scalar() == 1
    finally:
        engine.dispose()
    shown = run(["show", "s-1", "--json", "--db", POSTGRES_URL, "--schema", fresh_schema])
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["operation_id"] == "s-1"


# -- never crash: one line, a documented code ----------------------------------------------


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.postgres
def test_every_failure_is_one_line_and_a_documented_exit_code(
    tmp_path: Path, sqlite_url: str
) -> None:
    require_postgres()
    assert run(["migrate", "--db", sqlite_url]).returncode == 0
    (tmp_path / "broken_app.py").write_text("import os\nSECRET = os.environ['NO_SUCH_SECRET']\n")
    (tmp_path / "not_outbox.py").write_text("outbox = 42\n")
    app_env = {"PYTHONPATH": str(tmp_path)}
    unreachable = f"postgresql://postgres@127.0.0.1:{_closed_port()}/test"
    wrong_user = "postgresql://no_such_role_14:secret@127.0.0.1:5432/test"
    db = ["--db", sqlite_url]
    cases: list[tuple[list[str], dict[str, str], int, str]] = [
        (["status", "--db", unreachable], {}, 3, "cannot connect to the database"),
        (["status", "--db", wrong_user], {}, 3, "no_such_role_14"),
        (["status", "--db", "mysql://x@h/db"], {}, 2, "unsupported database"),
        (["status", "--db", "not a url"], {}, 2, "not a database URL"),
        (["--app", "no_such_module_14:ob", "status"], {}, 2, "no module named"),
        (["--app", "not_outbox:missing", "status"], app_env, 2, "has no attribute 'missing'"),
        (["--app", "not_outbox:outbox", "status"], app_env, 2, "not an outbox.Outbox"),
        (["--app", "broken_app:ob", "status"], app_env, 2, "NO_SUCH_SECRET"),
        (["--app", "just-a-module", "status"], {}, 2, "module:attr"),
        (["--log-level", "loud", *db, "status"], {}, 2, "'loud' is not one of"),
        (["purge", "--older-than", "soon", *db], {}, 2, "duration must look like"),
        (["reconcile", "list", "--older-than", "30m1h", *db], {}, 2, "largest first"),
        (["status", "--check", "--max-pending-age", "1y", *db], {}, 2, "duration"),
        (["status"], {}, 2, "name the database"),
        (["show", "op-nope", *db], {}, 1, "no operation 'op-nope'"),
        (["show", "bad id!", *db], {}, 2, "operation"),
        (["status", "--db", sqlite_url, "--schema", "x"], {}, 2, "PostgreSQL only"),
        (["status", "--db", POSTGRES_URL, "--schema", "bad-name;"], {}, 2, "plain identifier"),
    ]
    for args, env, code, message in cases:
        result = run(args, env)
        assert result.returncode == code, (args, result.stdout, result.stderr)
        line = one_error_line(result)
        assert message in line, (args, line)
        assert "secret" not in line  # a password in the URL is never printed
    # --debug (before or after the command) adds the traceback, same exit code.
    for args in (
        ["--debug", "status", "--db", unreachable],
        ["status", "--db", unreachable, "--debug"],
    ):
        debug = run(args)
        assert debug.returncode == 3
        assert "Traceback (most recent call last)" in debug.stderr
        assert debug.stderr.splitlines()[-1].startswith("error: cannot connect")


def test_db_before_or_after_the_command_and_from_the_environment(sqlite_url: str) -> None:
    assert run(["migrate", "--db", sqlite_url]).returncode == 0
    for args, env in (
        (["--db", sqlite_url, "status", "--json"], {}),
        (["status", "--json", "--db", sqlite_url], {}),
        (["status", "--json"], {"OUTBOX_DB": sqlite_url}),
        (["status", "--json"], {"OUTBOX_DATABASE_URL": sqlite_url}),  # the older name
        # After the command beats before it and the environment.
        (["--db", "sqlite:////nonexistent/x.sqlite3", "status", "--json", "--db", sqlite_url],
         {"OUTBOX_DB": "sqlite:////nonexistent/y.sqlite3"}),
    ):  # fmt: skip
        result = run(args, env)
        assert result.returncode == 0, (args, env, result.stderr)
        assert json.loads(result.stdout)["ok"] is True


def test_a_password_is_never_printed_and_the_hint_names_the_variable_instead() -> None:
    url = "postgresql://postgres:hunter2@127.0.0.1:1/test"
    result = run(["status"], env={"OUTBOX_DB": url})
    assert result.returncode == 3
    assert "hunter2" not in result.stderr
    from outbox.cli.support import Context

    obj = Context()
    obj.db, obj.db_env, obj.schema = url, "OUTBOX_DB", "ops"
    assert obj.command_hint("migrate") == 'outbox migrate --db "$OUTBOX_DB" --schema ops'


# -- requeue without the application ----------------------------------------------------------


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def world(db_url: str, receiver: Receiver) -> Iterator[S.World]:
    with S.every_state_world(S.World, db_url, receiver) as w:
        yield w


@pytest.fixture
def old_world(db_url: str, receiver: Receiver) -> Iterator[S.World]:
    """Every state, built three hours ago: past the receivers' two-hour key retention by
    the real clock that a command line without ``--app`` reads."""
    clock = FakeClock(start_ms=time.time_ns() // 1_000_000 - 3 * 3_600_000)
    offline = S.closed_port_url()
    ob = S.make_outbox(db_url, receiver.url, offline, clock)
    try:
        S.build_every_state(ob, receiver, clock)
        yield S.World(ob, clock, receiver, offline, db_url)
    finally:
        ob.close()


def test_requeue_with_only_the_database_is_decided_by_the_stored_policy(
    world: S.World,
) -> None:
    args = ["reconcile", "requeue", "op-lost", "--tenant", "globex", "--note", "checked"]
    done = run([*args, "--db", world.db_url, "--json"])  # no --app, no secrets
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "pending"
    (row,) = world.audit("op-lost")
    assert json.loads(row["details"])["policy_source"] == "snapshot"
    # Sending it is the application's business: its dispatcher replays the first result.
    assert world.ob.dispatch_once().succeeded >= 1
    assert world.receiver.effect_count(key="op-lost", tenant="globex") == 1


def test_requeue_past_the_key_retention_is_refused_and_says_what_the_flag_does(
    old_world: S.World,
) -> None:
    world = old_world
    args = ["reconcile", "requeue", "op-lost", "--tenant", "globex", "--note", "checked"]
    before = world.rows()
    refused = run([*args, "--db", world.db_url])
    assert refused.returncode == 1
    line = one_error_line(refused)
    assert "key retention has passed" in line
    assert "--accept-duplicate-risk requeues it anyway and restarts the key's life" in line
    assert "new retry window and key retention" in line
    assert "may cause a second effect" in line
    assert world.rows() == before
    accepted = run([*args, "--db", world.db_url, "--accept-duplicate-risk", "--json"])
    assert accepted.returncode == 0, accepted.stderr
    data = json.loads(accepted.stdout)
    assert (data["state"], data["first_attempt_at"]) == ("pending", None)


def test_the_hints_of_a_listing_run_when_pasted(world: S.World) -> None:
    listed = run(["reconcile", "list", "--limit", "1", "--newer-than", "1d", "--db", world.db_url])
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    (more,) = [line for line in lines if line.startswith("more: ")]
    (next_,) = [line for line in lines if line.startswith("next: ")]
    assert "--newer-than 1d" in more and "--offset 1" in more
    page_two = run_hint(more, "more:")
    assert page_two.returncode == 0, page_two.stderr
    assert "op-busy" in page_two.stdout and "op-lost" not in page_two.stdout
    shown = run_hint(next_.removesuffix(", then resolve or requeue it"), "next:")
    assert shown.returncode == 0, shown.stderr
    assert "op-lost  tenant='globex'" in shown.stdout


# -- bulk actions -----------------------------------------------------------------------------


def test_bulk_requeue_dry_run_then_run_counts_refusals_and_audits_each(
    old_world: S.World,
) -> None:
    world = old_world
    db = ["--db", world.db_url]
    bulk = ["reconcile", "requeue", "--all", "--note", "incident 42"]
    before = world.rows()

    dry = run([*bulk, "--dry-run", *db])
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[0] == (
        "dry run: requeue: 3 matched, would change 1, refused 2, changed by someone else 0"
    )
    # Grouped by default; every operation with --verbose.
    assert dry.stdout.splitlines()[1:] == [
        "  would change 1 -> pending (op-dark)",
        "  refused 2: key retention passed: needs --accept-duplicate-risk (op-lost, op-busy)",
    ]
    every = run([*bulk, "--dry-run", "--verbose", *db]).stdout
    assert "  op-dark: would change -> pending" in every
    assert "  op-lost (tenant 'globex'): refused: refusing to requeue 'op-lost'" in every
    data = json.loads(run([*bulk, "--dry-run", "--json", *db]).stdout)
    assert data["counts"] == {"changed": 1, "refused": 2, "changed_by_someone_else": 0}
    assert data["dry_run"] is True and data["matched"] == 3
    assert world.rows() == before  # a dry run writes nothing

    # Filters narrow it down; the total is what `reconcile list` says matches.
    listed = run(["reconcile", "list", "--reason", "never_delivered", *db])
    assert "(1 shown of 1 matching)" in listed.stdout
    narrow = json.loads(
        run([*bulk, "--dry-run", "--json", "--reason", "never_delivered", *db]).stdout
    )
    assert [o["operation_id"] for o in narrow["operations"]] == ["op-dark"]
    assert narrow["selection"]["reason"] == "never_delivered"

    # No terminal and no --yes: refused before anything is written.
    unconfirmed = run([*bulk, *db])
    assert unconfirmed.returncode == 2
    assert "pass --yes" in one_error_line(unconfirmed)
    assert world.rows() == before

    done = run([*bulk, "--yes", "--json", *db])
    assert done.returncode == 1  # some were refused: not everything changed
    report = json.loads(done.stdout)
    assert report["counts"] == {"changed": 1, "refused": 2, "changed_by_someone_else": 0}
    (row,) = world.audit("op-dark")
    assert (row["action"], row["to_state"], row["note"]) == ("requeue", "pending", "incident 42")
    assert json.loads(row["details"])["bulk"] == {}
    assert world.audit("op-lost") == [] and world.audit("op-busy") == []


def test_bulk_resolve_with_filters_and_cancel_all(world: S.World) -> None:
    db = ["--db", world.db_url]
    resolved = run(
        ["reconcile", "resolve", "--all", "--tenant", "acme", "--as", "failed",
         "--note", "receiver has no record", "--yes", *db]
    )  # fmt: skip
    assert resolved.returncode == 0, resolved.stderr
    assert resolved.stdout.startswith(
        "resolve: 1 matched, changed 1, refused 0, changed by someone else 0"
    )
    assert world.ob.get("op-busy", tenant="acme").state.value == "failed"
    (row,) = world.audit("op-busy")
    assert json.loads(row["details"])["bulk"] == {"tenant": "acme"}
    assert world.ob.get("op-lost", tenant="globex").state.value == "unresolved"

    # Cancel every pending operation never sent; the pending one here was never tried.
    cancelled = run(["cancel", "--all", "--note", "shutting the feature down", "--yes", *db])
    assert cancelled.returncode == 0, cancelled.stderr
    assert "cancel: 1 matched, changed 1" in cancelled.stdout
    assert world.ob.get("op-wait", tenant="acme").state.value == "cancelled"
    # Bulk-only flags with one operation ID, or neither: usage errors.
    assert run(["cancel", "op-x", "--dry-run", "--note", "n", *db]).returncode == 2
    assert run(["cancel", "--note", "n", *db]).returncode == 2
    assert run(["cancel", "--all", "--reason", "never_delivered", "--note", "n", "--yes",
                *db]).returncode == 2  # fmt: skip


def test_bulk_on_a_terminal_asks_first_and_shows_progress(world: S.World) -> None:
    db = ["--db", world.db_url]
    bulk = ["reconcile", "resolve", "--all", "--as", "failed", "--note", "n", *db]
    before = world.rows()
    code, screen = run_on_terminal(bulk, answer="n")
    assert code == 1, screen
    assert "dry run: resolve: 3 matched, would change 3" in screen
    assert "resolve 3 operations? [y/N]" in screen
    assert "aborted; nothing was changed" in screen
    assert "━" not in screen  # no progress bar for a run that did not start
    assert world.rows() == before

    code, screen = run_on_terminal(bulk, answer="y")
    assert code == 0, screen
    assert "resolve: 3 matched, changed 3, refused 0" in screen
    assert "━" in screen  # the progress bar was drawn (rich, on the terminal's stderr)
    assert [r["action"] for r in world.audit()].count("resolve") == 3


def test_bulk_counts_an_operation_changed_after_its_selection_and_leaves_it_alone(
    world: S.World,
) -> None:
    # Held at its confirmation prompt, the bulk run has selected (and shown) the three
    # unresolved operations; another operator then resolves one of them on their own,
    # and only then is the bulk run confirmed.
    db = ["--db", world.db_url]
    bulk = ["reconcile", "resolve", "--all", "--as", "failed", "--note", "bulk", *db]
    other: list[subprocess.CompletedProcess[str]] = []

    def another_operator() -> None:
        other.append(
            run(["reconcile", "resolve", "op-busy", "--tenant", "acme", "--as", "succeeded",
                 "--note", "found it", "--operator", "carol", *db])
        )  # fmt: skip

    code, screen = run_on_terminal(bulk, answer="y", at_prompt=another_operator)
    (single,) = other
    assert single.returncode == 0, single.stderr
    assert "dry run: resolve: 3 matched, would change 3" in screen
    assert code == 1, screen  # not everything selected was changed
    assert "resolve: 3 matched, changed 2, refused 0, changed by someone else 1" in screen
    assert "op-busy" in screen.split("changed by someone else 1", 1)[1]
    # The other operator's change stands; the bulk run wrote nothing for that operation.
    assert world.ob.get("op-busy", tenant="acme").state.value == "succeeded"
    assert [(r["actor"], r["note"]) for r in world.audit("op-busy")] == [("carol", "found it")]
    for ref in (S.LOST, S.DARK):
        assert world.ob.get(ref.operation_id, tenant=ref.tenant).state.value == "failed"
        assert [r["note"] for r in world.audit(ref.operation_id)] == ["bulk"]


# -- purge and dispatch ------------------------------------------------------------------------


def test_purge_dry_run_counts_and_vacuum_reports_bytes(old_world: S.World) -> None:
    """``purge --dry-run`` counts and deletes nothing; ``--vacuum`` (SQLite) reports the
    bytes on disk before and after, as the file system sees them."""
    world = old_world
    kind = "sqlite" if world.db_url.startswith("sqlite") else "postgres"
    db = ["--db", world.db_url]
    before = world.rows()
    # The terminal operations finished about three hours ago.
    assert run(["purge", "--older-than", "4h", "--dry-run", "--json", *db]).stdout.count(
        '"total": 0'
    )
    dry = run(["purge", "--older-than", "1h", "--dry-run", "--json", *db])
    assert dry.returncode == 0, dry.stderr
    counted = json.loads(dry.stdout)
    assert counted["dry_run"] is True
    assert counted["removed"] == {"cancelled": 1, "failed": 1, "succeeded": 1}
    assert world.rows() == before
    if kind == "postgres":
        refused = run(["purge", "--older-than", "1h", "--vacuum", *db])
        assert refused.returncode == 2
        assert "--vacuum is for SQLite" in one_error_line(refused)
        return
    done = run(["purge", "--older-than", "1h", "--vacuum", "--json", *db])
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["total"] == 3
    assert data["bytes_before"] >= data["bytes_after"] > 0
    path = Path(world.db_url.removeprefix("sqlite:///"))
    assert data["bytes_after"] == path.stat().st_size + (
        path.with_name(path.name + "-wal").stat().st_size
        if path.with_name(path.name + "-wal").exists()
        else 0
    )


def test_dispatch_until_empty_drains_what_is_due_and_exits(db_url: str, receiver: Receiver) -> None:
    clock = S.real_now_clock()
    offline = S.closed_port_url()
    with S.make_outbox(db_url, receiver.url, offline, clock) as ob:
        for n in range(250):  # more than one claim batch
            S.enqueue(ob, S.Ref("acme", f"drain-{n}", "inventory", "pending"))
    env = S.app_env(db_url, receiver.url, offline, clock.now_ms())
    result = run(["--app", S.APP, "dispatch", "--until-empty", "--json"], env)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["claimed"], summary["succeeded"]) == (250, 250)
    with S.make_outbox(db_url, receiver.url, offline, clock) as ob:
        assert S.state_counts(ob.engine) == {"succeeded": 250}
    assert receiver.effect_count() == 250
    # On a terminal: the same, with a live progress line, and the summary at the end.
    with S.make_outbox(db_url, receiver.url, offline, clock) as ob:
        for n in range(20):
            S.enqueue(ob, S.Ref("acme", f"tty-{n}", "inventory", "pending"))
    code, screen = run_on_terminal(["--app", S.APP, "dispatch", "--until-empty"], None, env)
    assert code == 0, screen
    assert "claimed=20 attempts=20 succeeded=20" in screen
