"""Shared fixtures: every store test runs on a real SQLite file and a real PostgreSQL.

PostgreSQL comes from ``OUTBOX_TEST_POSTGRES_URL`` (default: the local server with
trust auth). Each test gets its own schema, so tests never see each other's rows. When
the server is unreachable the PostgreSQL variants skip with the reason, unless
``OUTBOX_REQUIRE_POSTGRES=1`` (CI sets it), which turns the skip into a failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

POSTGRES_URL = os.environ.get(
    "OUTBOX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
_pg_error: str | None = None
_pg_checked = False
_current: pytest.Item | None = None


def _uses_postgres(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    return (
        "pg_url" in getattr(item, "fixturenames", ())
        or any(value == "postgres" for value in params)
        or "postgres" in item.name.lower()
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that can reach PostgreSQL carries the ``postgres`` marker, so
    ``-m "not postgres"`` means what it says (``require_postgres`` enforces it)."""
    for item in items:
        if _uses_postgres(item) and item.get_closest_marker("postgres") is None:
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(autouse=True)
def _track_current_test(request: pytest.FixtureRequest) -> Iterator[None]:
    global _current  # noqa: PLW0603
    _current = request.node
    yield
    _current = None


def postgres_unavailable() -> str | None:
    global _pg_checked, _pg_error  # noqa: PLW0603
    if not _pg_checked:
        _pg_checked = True
        try:
            engine = create_engine(POSTGRES_URL)
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            engine.dispose()
        except Exception as exc:
            _pg_error = f"PostgreSQL at {POSTGRES_URL} unreachable: {type(exc).__name__}: {exc}"
    return _pg_error


def require_postgres() -> None:
    if _current is not None and _current.get_closest_marker("postgres") is None:
        pytest.fail(
            f"{_current.nodeid} reaches PostgreSQL but is not marked: add "
            "@pytest.mark.postgres (or a 'postgres' parameter) so -m 'not postgres' holds"
        )
    reason = postgres_unavailable()
    if reason is None:
        return
    if os.environ.get("OUTBOX_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"OUTBOX_REQUIRE_POSTGRES=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def _unconfigure_outbox_logging() -> Iterator[None]:
    """The CLI configures the ``outbox`` loggers (``outbox.base.logs.configure``) for the
    stderr of the moment; no test leaves that behind for the next one."""
    yield
    from outbox.base import logs

    logs.reset()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped after the test."""
    require_postgres()
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'outbox.sqlite3'}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty outbox database: SQLite file or PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    url: str = request.getfixturevalue("pg_url")
    from outbox.store.engine import create_engine as outbox_engine
    from outbox.store.migrate import upgrade

    engine = outbox_engine(url)
    upgrade(engine)
    engine.dispose()
    return url
