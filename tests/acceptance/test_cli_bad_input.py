"""Hostile and mistaken input to the real ``outbox`` command, on SQLite and PostgreSQL:
one line on stderr, the documented exit code, and nothing written (the tables and the
file system are compared before and after).

Each case here was found by a sweep of the CLI with bad input; each failed before its
fix (a refused purge that had already deleted, a typo'd endpoint paused, a traceback's
exit 4 for bytes that are not UTF-8, a console that printed a sign-in token for a port
it could not bind)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, insert, make_url, select

from outbox.store.engine import create_engine
from outbox.store.migrate import HEAD, upgrade
from outbox.store.tables import attempts, audit, endpoint_states, operations

REPO = Path(__file__).resolve().parents[2]
DAY_MS = 86_400_000


def _outbox(
    *args: str | bytes, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}, **(env or {})}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )


def _one_line(done: subprocess.CompletedProcess[bytes], code: int) -> str:
    """The single ``error: ...`` line of a refused command that exited ``code``."""
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == code, err
    assert "Traceback" not in err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def _tables(url: str) -> dict[str, Any]:
    """Everything a refused command must leave alone: row counts and the audit trail."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            counted = {
                t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
                for t in (operations, attempts, audit, endpoint_states)
            }
            trail = conn.execute(select(audit.c.action, audit.c.actor)).all()
            return {"counts": counted, "audit": trail}
    finally:
        engine.dispose()


@pytest.fixture
def settled(db_url: str) -> str:
    """``db_url`` holding two operations of endpoint ``payments``, settled a day ago."""
    engine = create_engine(db_url)
    upgrade(engine)
    now = int(time.time() * 1000)
    with engine.begin() as conn:
        for n in (1, 2):
            conn.execute(
                insert(operations).values(
                    operation_id=f"pay-{n}", endpoint="payments", method="POST",
                    path="/pay", headers="{}", args_sha256="x", state="succeeded",
                    created_at=now - 2 * DAY_MS, updated_at=now - DAY_MS,
                    finished_at=now - DAY_MS,
                )
            )  # fmt: skip
    engine.dispose()
    return db_url


@pytest.mark.parametrize(
    "operator", ["eve\x1b", "x" * 300, b"\xff"], ids=["escape", "too-long", "not-utf-8"]
)
def test_a_refused_purge_deletes_nothing(
    settled: str, tmp_path: Path, operator: str | bytes
) -> None:
    before = _tables(settled)
    assert before["counts"]["outbox_operations"] == 2
    done = _outbox("--db", settled, "purge", "--older-than", "1s", "--operator", operator,
                   cwd=tmp_path)  # fmt: skip
    _one_line(done, 2)
    assert _tables(settled) == before


def test_purge_writes_its_audit_row_with_the_checked_operator(settled: str, tmp_path: Path) -> None:
    done = _outbox("--db", settled, "purge", "--older-than", "1s", "--operator", "ops-alice",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    after = _tables(settled)
    assert after["counts"]["outbox_operations"] == 0
    assert after["audit"] == [("purge", "ops-alice")]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["nosuchendpoint", "--note", "maintenance"], "no endpoint 'nosuchendpoint' is known"),
        (["payments", "--note", ""], "a note is required"),
        (["payments", "--note", "x\x1b[2J"], "control character \\x1b"),
        (["payments", "--note", "n", "--operator", "a\x1b"], "operator name must be"),
        (["payments", "--note", "n", "--operator", "y" * 300], "operator name must be"),
    ],
    ids=["unknown-endpoint", "empty-note", "escape-in-note", "escape-in-operator", "long"],
)
@pytest.mark.parametrize("verb", ["pause", "resume"])
def test_endpoint_pause_and_resume_check_what_every_action_checks(
    settled: str, tmp_path: Path, verb: str, args: list[str], says: str
) -> None:
    before = _tables(settled)
    err = _one_line(_outbox("--db", settled, "endpoint", verb, *args, cwd=tmp_path), 2)
    assert says in err
    assert _tables(settled) == before


def test_an_endpoint_with_operations_is_paused_and_resumed_audited(
    settled: str, tmp_path: Path
) -> None:
    # Known without --app: a live operation names it (as the console's Endpoints page
    # lists it); its settled ones alone do not.
    engine = create_engine(settled)
    now = int(time.time() * 1000)
    with engine.begin() as conn:
        conn.execute(
            insert(operations).values(
                operation_id="pay-3", endpoint="payments", method="POST", path="/pay",
                headers="{}", args_sha256="x", state="pending", created_at=now,
                updated_at=now, next_attempt_at=now + DAY_MS,
            )
        )  # fmt: skip
    engine.dispose()
    for verb in ("pause", "resume"):
        done = _outbox("--db", settled, "endpoint", verb, "payments", "--note", "deploy",
                       "--operator", "ops-bob", cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert _tables(settled)["audit"] == [("pause", "ops-bob"), ("resume", "ops-bob")]


@pytest.mark.parametrize(
    "args",
    [
        ["audit", "--actor", b"\xff"],
        ["reconcile", "list", "--tenant", b"\xff"],
        ["cancel", "--all", "--dry-run", "--tenant", b"\xff", "--note", "n"],
        ["endpoint", "pause", "payments", "--note", b"\xff"],
        ["reconcile", "resolve", "pay-1", "--as", "failed", "--note", b"caf\xe9"],
    ],
    ids=["audit", "list", "cancel", "pause", "resolve"],
)
def test_an_argument_that_is_not_utf8_is_a_usage_error(
    settled: str, tmp_path: Path, args: list[str | bytes]
) -> None:
    before = _tables(settled)
    err = _one_line(_outbox("--db", settled, *args, cwd=tmp_path), 2)
    assert "is not valid UTF-8" in err
    assert _tables(settled) == before


def test_keys_shred_refuses_a_zero_age(settled: str, tmp_path: Path) -> None:
    before = _tables(settled)
    err = _one_line(_outbox("--db", settled, "keys", "shred", "--older-than", "0s",
                            cwd=tmp_path), 2)  # fmt: skip
    assert "--older-than must be positive" in err
    assert _tables(settled) == before


@pytest.mark.parametrize(
    "command", [["cancel"], ["reconcile", "resolve", "--as", "failed"]], ids=["cancel", "resolve"]
)
def test_verbose_goes_with_all_like_the_other_bulk_flags(
    settled: str, tmp_path: Path, command: list[str]
) -> None:
    # It was accepted with one operation and did nothing, unlike --dry-run or --yes.
    before = _tables(settled)
    for flag in ("-v", "--verbose"):
        done = _outbox("--db", settled, *command, "pay-1", flag, "--note", "n", cwd=tmp_path)
        assert "--verbose go with --all, not with one operation" in _one_line(done, 2)
    assert _tables(settled) == before


@pytest.mark.parametrize("command", [["audit"], ["reconcile", "list"]])
def test_an_offset_past_what_the_database_counts_is_a_usage_error(
    settled: str, tmp_path: Path, command: list[str]
) -> None:
    done = _outbox("--db", settled, *command, "--offset", str(2**63), cwd=tmp_path)
    assert "--offset" in _one_line(done, 2)


def test_a_dangling_shared_option_after_the_command_is_a_usage_error(
    settled: str, tmp_path: Path
) -> None:
    for option in ("--db", "--schema", "--app"):
        err = _one_line(_outbox("--db", settled, "status", option, cwd=tmp_path), 2)
        assert f"Option '{option}' requires an argument" in err


def test_a_long_operation_id_is_quoted_cut_short(settled: str, tmp_path: Path) -> None:
    err = _one_line(_outbox("--db", settled, "show", "x" * 100_000, cwd=tmp_path), 2)
    assert "(100,000 characters)" in err and len(err) < 400


def test_a_missing_choice_lists_the_choices_on_one_line(settled: str, tmp_path: Path) -> None:
    done = _outbox("--db", settled, "reconcile", "resolve", "pay-1", "--note", "n", cwd=tmp_path)
    assert "Choose from: succeeded, failed" in _one_line(done, 2)


def test_durations_take_ascii_digits_only(settled: str, tmp_path: Path) -> None:
    before = _tables(settled)
    for age in ("\uff15m", "\u0663d"):
        _one_line(_outbox("--db", settled, "purge", "--older-than", age, cwd=tmp_path), 2)
    assert _tables(settled) == before


# -- URLs and paths (no database behind them) ------------------------------------------


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql+psycopg://postgres@127.0.0.1:abc/test", "not a database URL"),
        ("sqlite+aiosqlite:///{tmp}/o.sqlite3", "unsupported driver 'sqlite+aiosqlite'"),
        # The driver would ignore it, with SQLAlchemy's two-line warning on stderr.
        ("sqlite:///{tmp}/o.sqlite3?timeuot=5", "the SQLite driver takes no 'timeuot' URL"),
    ],
    ids=["port-not-a-number", "async-driver", "argument-the-driver-ignores"],
)
@pytest.mark.parametrize("command", ["status", "migrate"])
def test_a_url_outbox_cannot_use_is_a_usage_error(
    tmp_path: Path, url: str, says: str, command: str
) -> None:
    done = _outbox("--db", url.format(tmp=tmp_path), command, cwd=tmp_path)
    assert says in _one_line(done, 2)
    assert list(tmp_path.iterdir()) == []  # migrate created no file either


@pytest.mark.parametrize("command", ["status", "migrate"])
def test_a_device_is_not_called_missing_nor_migrated(tmp_path: Path, command: str) -> None:
    # status said "does not exist ... to create it"; migrate "created" the schema in it.
    err = _one_line(_outbox("--db", "sqlite:////dev/null", command, cwd=tmp_path), 3)
    assert "/dev/null is not a regular file" in err
    assert "does not exist" not in err and "to create it" not in err


def test_a_path_the_system_refuses_is_a_database_error_that_creates_nothing(
    tmp_path: Path,
) -> None:
    (tmp_path / "notes.txt").write_text("not a directory")
    long_name = "a" * 5000
    cases = [
        (["--db", f"sqlite:///{tmp_path}/{long_name}.sqlite3", "status"], "File name too long"),
        (["--db", f"sqlite:///{tmp_path}/notes.txt/o.sqlite3", "migrate"], "a file is in the way"),
        (["demo", "--dir", str(tmp_path / "notes.txt")], "a file is in the way"),
    ]
    for args, says in cases:
        err = _one_line(_outbox(*args, cwd=tmp_path), 3)
        assert says in err and len(err) < 400, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_the_console_on_a_port_in_use_prints_no_token(settled: str, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _outbox("--db", settled, "console", "--port", str(port), cwd=tmp_path)
    err = _one_line(done, 2)
    assert f"cannot listen on 127.0.0.1:{port}" in err
    assert done.stdout == b""  # no address, no sign-in token for a server that never ran


def _app(tmp_path: Path, url: str) -> str:
    """An application module in ``tmp_path`` (the command's working directory) whose
    Outbox is on ``url``; its ``--app`` spelling."""
    (tmp_path / "shopapp.py").write_text(
        f"from outbox import Outbox\n\noutbox = Outbox({url!r}, auto_migrate=False)\n"
    )
    return "shopapp:outbox"


def test_a_db_or_schema_that_is_not_the_apps_is_refused(settled: str, tmp_path: Path) -> None:
    # --app names the database; a --db naming another used to be silently not used, so
    # an operator "pausing on staging" paused on the application's database.
    app = _app(tmp_path, settled)
    other = tmp_path / "staging.sqlite3"
    before = _tables(settled)
    pause = ["endpoint", "pause", "payments", "--note", "n"]
    err = _one_line(_outbox("--app", app, "--db", f"sqlite:///{other}", *pause, cwd=tmp_path), 2)
    assert f"--app {app} is on " in err and "not the --db given" in err
    err = _one_line(_outbox("--app", app, *pause, "--schema", "elsewhere", cwd=tmp_path), 2)
    assert "names no schema to outbox" in err and "--schema elsewhere is not used" in err
    assert _tables(settled) == before
    assert not other.exists()


def test_a_db_that_is_the_apps_is_accepted_and_the_environment_is_not_read(
    settled: str, tmp_path: Path
) -> None:
    app = _app(tmp_path, settled)
    same = settled
    if settled.startswith("sqlite:///"):  # the same file, spelled relative to the cwd
        same = "sqlite:///" + os.path.relpath(settled.removeprefix("sqlite:///"), tmp_path)
    else:  # the same database, spelled with the default port and another driver name
        same = settled.replace("postgresql+psycopg://", "postgresql://").replace(":5432/", "/")
    done = _outbox("--app", app, "--db", same, "status", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # OUTBOX_DB and OUTBOX_SCHEMA in the environment are a deployment's settings, not the
    # operator's word.
    elsewhere = {"OUTBOX_DB": f"sqlite:///{tmp_path / 'elsewhere.sqlite3'}",
                 "OUTBOX_SCHEMA": "elsewhere"}  # fmt: skip
    done = _outbox("--app", app, "endpoint", "pause", "payments", "--note", "n",
                   "--operator", "ops-bob", cwd=tmp_path, env=elsewhere)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _tables(settled)["audit"] == [("pause", "ops-bob")]
    assert not (tmp_path / "elsewhere.sqlite3").exists()


def test_a_postgres_apps_schema_is_the_one_every_command_and_migrate_use(
    pg_url: str, tmp_path: Path
) -> None:
    # An application keeping its tables in schema S (Outbox(url, schema=S)): migrate
    # --app migrated the connection's default search_path instead of S.
    from tests.conftest import POSTGRES_URL

    schema = str(make_url(pg_url).query["options"]).split("search_path=")[1]  # fresh
    in_schema = create_engine(POSTGRES_URL, schema=schema)
    upgrade(in_schema)
    in_schema.dispose()
    (tmp_path / "shopapp.py").write_text(
        "from outbox import Outbox\n\n"
        f"outbox = Outbox({POSTGRES_URL!r}, schema={schema!r}, auto_migrate=False)\n"
    )
    done = _outbox("--app", "shopapp:outbox", "migrate", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    said = done.stdout.decode()
    assert said == f"outbox schema at revision {HEAD} in schema {schema} (was {HEAD})\n"
    err = _one_line(_outbox("--app", "shopapp:outbox", "--schema", "other", "status",
                            cwd=tmp_path), 2)  # fmt: skip
    assert f"keeps its tables in schema {schema}, not other" in err
    done = _outbox("--app", "shopapp:outbox", "--schema", schema, "status", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
