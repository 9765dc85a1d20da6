"""Every read command sees every committed row (SQLite, two processes).

An application enqueues on the outbox's SQLite file through an engine of its own (plain
``sqlalchemy.create_engine``, connected before its Outbox was made), in its own
transactions. The read commands run as separate processes in between, as an operator's
do. Before the fix, making the Outbox read the file's header with an ``open()`` and a
``close()`` of our own in the application's process, which dropped the POSIX locks of
the application's open connection; the next ``outbox status`` then believed itself the
file's last user, checkpointed and deleted the -wal and -shm files, and every later
commit of the application went to a WAL nobody else could see: ``pending: 0`` while the
application read its row, until it exited (``outbox.store.sqlitefile``).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


class App:
    """The application process (``tests.support.plain_engine_app``), one command at a time."""

    def __init__(self, url: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.plain_engine_app", url],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def ask(self, line: str) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, f"the application process ended (exit {self.process.wait(5)})"
        result: dict[str, Any] = json.loads(answer)
        return result

    def close(self) -> None:
        if self.process.poll() is None:
            self.ask_quit()

    def ask_quit(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("quit\n")
        self.process.stdin.close()
        assert self.process.wait(30) == 0
        assert self.process.stdout is not None
        self.process.stdout.close()


def cli(url: str, *args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "--db", url, *args, "--json"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def pending(url: str) -> int:
    counts: dict[str, int] = cli(url, "status")["counts"]
    return counts["pending"]


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    subprocess.run([sys.executable, "-m", "outbox", "--db", url, "migrate"],
                   cwd=REPO, check=True, capture_output=True, timeout=60)  # fmt: skip
    return url


@pytest.fixture
def app(url: str) -> Iterator[App]:
    app = App(url)
    try:
        yield app
    finally:
        app.close()


def test_status_and_show_see_a_commit_made_after_a_status_run(url: str, app: App) -> None:
    app.ask("rollback rolled-back")
    assert pending(url) == 0
    app.ask("commit committed")
    seen = app.ask("count committed rolled-back")
    assert seen["count"] == 1 and seen["get"] == ["committed"]

    assert pending(url) == 1
    shown = cli(url, "show", "committed")
    assert shown["operation_id"] == "committed" and shown["state"] == "pending"

    app.ask("dispose")
    app.ask("commit second")
    assert pending(url) == 2
    assert app.ask("count")["count"] == 2


def other_process_enqueues(url: str, op_id: str) -> None:
    """Another process (a second application instance) enqueues in its own transaction."""
    code = (
        "import sys; from outbox import Endpoint, Outbox; "
        "ob = Outbox(sys.argv[1], endpoints=[Endpoint(name='svc', base_url='http://127.0.0.1:9')],"
        " auto_migrate=False); "
        "ob.enqueue(endpoint='svc', method='POST', path='/orders', json={},"
        " operation_id=sys.argv[2]);"
        " ob.close()"
    )
    subprocess.run([sys.executable, "-c", code, url, op_id],
                   cwd=REPO, check=True, capture_output=True, timeout=60)  # fmt: skip


def test_no_commit_of_either_process_is_lost_when_the_application_exits(url: str, app: App) -> None:
    app.ask("commit first")
    assert pending(url) == 1
    other_process_enqueues(url, "other")
    app.ask("commit second")
    assert pending(url) == 3
    app.ask_quit()

    assert pending(url) == 3
    for op_id in ("first", "other", "second"):
        assert cli(url, "show", op_id)["state"] == "pending"
    path = url.removeprefix("sqlite:///")
    with closing(sqlite3.connect(path)) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
