"""Schema operations that are safe to race and to get wrong.

``outbox migrate`` runs as a real subprocess. Concurrent runs on PostgreSQL queue on an
advisory lock. Each bad target exits 3 naming the cause, without a traceback, and
leaves everything as it was: no file created, nothing converted (a foreign SQLite
database keeps its rollback journal; SQLite switches to WAL on the first open).
"""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from outbox import Outbox
from outbox.store.engine import create_engine
from outbox.store.migrate import HEAD, VERSION_TABLE, current_revision
from tests.faults.support import ROOT


def _migrate(url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return subprocess.run([sys.executable, "-m", "outbox.cli", "--db", url, "migrate"],
                          cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


def _refused(result: subprocess.CompletedProcess[str], cause: str) -> None:
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith("error: ") and cause in first, result.stderr


@pytest.mark.postgres
@pytest.mark.slow
def test_concurrent_migrations_on_postgres_all_succeed(pg_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    runs = [
        subprocess.Popen([sys.executable, "-m", "outbox.cli", "--db", pg_url, "migrate"],
                         cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(6)
    ]  # fmt: skip
    results = [(p.wait(120), p.stderr.read() if p.stderr else "") for p in runs]
    for p in runs:
        for stream in (p.stdout, p.stderr):
            if stream:
                stream.close()
    assert [code for code, _ in results] == [0] * 6, results
    engine = create_engine(pg_url)
    try:
        assert current_revision(engine) == HEAD
    finally:
        engine.dispose()


def _journal_mode(path: Path) -> str:
    with sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True) as conn:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])


def _foreign_db(path: Path, revision: str | None) -> None:
    with sqlite3.connect(path) as conn:  # rollback journal, as most applications use
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
        if revision is not None:
            conn.execute(f"CREATE TABLE {VERSION_TABLE} (version_num VARCHAR(32) NOT NULL)")
            conn.execute(f"INSERT INTO {VERSION_TABLE} VALUES (?)", (revision,))
    conn.close()


def test_a_database_migrated_by_a_newer_outbox_is_refused_untouched(tmp_path: Path) -> None:
    db = tmp_path / "app.db"
    _foreign_db(db, "0099")
    before = db.read_bytes()
    _refused(_migrate(f"sqlite:///{db}", tmp_path), "revision 0099")
    assert db.read_bytes() == before
    assert _journal_mode(db) == "delete"  # not switched to WAL
    assert not Path(f"{db}-wal").exists()


def test_truncated_not_sqlite_and_directory_are_refused_untouched(tmp_path: Path) -> None:
    good = tmp_path / "good.sqlite3"
    Outbox(f"sqlite:///{good}").close()
    with sqlite3.connect(good) as raw:
        raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw.close()
    truncated = tmp_path / "truncated.sqlite3"
    data = good.read_bytes()
    truncated.write_bytes(data[: len(data) // 2 + 100])
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"PK\x03\x04 this is a zip file, not a database" * 50)
    folder = tmp_path / "folder.sqlite3"
    folder.mkdir()
    for path, cause in ((truncated, "truncated"), (junk, "not a SQLite database"),
                        (folder, "is a directory")):  # fmt: skip
        before = path.read_bytes() if path.is_file() else None
        _refused(_migrate(f"sqlite:///{path}", tmp_path), cause)
        if before is not None:
            assert path.read_bytes() == before
        assert not Path(f"{path}-wal").exists() and not Path(f"{path}-journal").exists()


def test_read_only_url_creates_nothing_and_converts_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "missing.sqlite3"
    _refused(_migrate(f"sqlite:///{missing}?mode=ro", tmp_path), "does not exist")
    assert not missing.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    foreign = tmp_path / "foreign.db"
    _foreign_db(foreign, None)
    before = foreign.read_bytes()
    _refused(_migrate(f"sqlite:///{foreign}?mode=ro", tmp_path), "readonly")
    assert foreign.read_bytes() == before
    assert _journal_mode(foreign) == "delete"


def test_unreachable_server_is_one_line_exit_3(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _refused(_migrate(f"postgresql://postgres@127.0.0.1:{port}/test", tmp_path),
             "cannot connect to the database")  # fmt: skip
