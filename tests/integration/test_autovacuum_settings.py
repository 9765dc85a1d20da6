"""Migration 0008: the queue tables' autovacuum settings on PostgreSQL (set by upgrade,
reset by downgrade), nothing on SQLite, and the retention guide shows the same values."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.store.engine import create_engine
from outbox.store.migrate import HEAD, current_revision, downgrade, upgrade
from outbox.store.revisions import migrations_dir

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "retention.md"


def _migration() -> Any:
    path = next((migrations_dir() / "versions").glob("0008_*.py"))
    spec = importlib.util.spec_from_file_location("outbox_migration_0008", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reloptions(engine: sa.Engine) -> dict[str, dict[str, str]]:
    out = {}
    with engine.connect() as conn:
        for table in ("outbox_operations", "outbox_attempts"):
            options = conn.execute(
                sa.text("SELECT reloptions FROM pg_class WHERE oid = CAST(:t AS regclass)"),
                {"t": table},
            ).scalar_one()
            out[table] = dict(o.split("=", 1) for o in options or [])
    return out


def test_postgres_tables_get_the_settings_and_downgrade_resets_them(pg_url: str) -> None:
    engine = create_engine(pg_url)
    try:
        upgrade(engine)
        assert current_revision(engine) == HEAD
        assert _reloptions(engine) == _migration().SETTINGS
        downgrade(engine, "0006")
        assert _reloptions(engine) == {"outbox_operations": {}, "outbox_attempts": {}}
        upgrade(engine)
        assert _reloptions(engine) == _migration().SETTINGS
    finally:
        engine.dispose()


def test_sqlite_upgrade_and_downgrade_are_a_no_op(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    try:
        upgrade(engine)
        assert current_revision(engine) == HEAD
        downgrade(engine, "0006")
        assert current_revision(engine) == "0006"
        upgrade(engine)
        assert current_revision(engine) == HEAD
    finally:
        engine.dispose()


@pytest.mark.parametrize("table", ["outbox_operations", "outbox_attempts"])
def test_the_retention_guide_shows_the_migrations_values(table: str) -> None:
    text = GUIDE.read_text()
    block = re.search(rf"ALTER TABLE {table} SET \((.*?)\);", text, re.S)
    assert block is not None, f"no ALTER TABLE {table} in {GUIDE.name}"
    shown = dict(re.findall(r"(\w+) = ([\d.]+)", block.group(1)))
    assert shown == _migration().SETTINGS[table]
