"""The Alembic migrations, applied to a real SQLite file and a real PostgreSQL schema."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import outbox.store.engine
from outbox import Endpoint, Outbox, SchemaError, State
from outbox.canonical import canonicalize
from outbox.store.engine import create_engine
from outbox.store.migrate import HEAD, VERSION_TABLE, current_revision, downgrade, upgrade
from outbox.store.rows import operation_row
from outbox.store.tables import metadata, operations

OUTBOX_TABLES = {
    "outbox_operations",
    "outbox_attempts",
    "outbox_audit",
    "outbox_endpoints",
    "outbox_endpoint_slices",
    "outbox_dispatchers",
}
HOST_REVISION = "host_app_rev_42"


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_url(request: pytest.FixtureRequest) -> str:
    """An empty, unmigrated database."""
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def engine(fresh_url: str) -> Iterator[sa.Engine]:
    eng = create_engine(fresh_url)
    yield eng
    eng.dispose()


def tables(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(sa.inspect(conn).get_table_names())


def host_revision(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars())


def schema_diff(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={
                "version_table": VERSION_TABLE,
                "compare_type": True,
                "compare_server_default": True,
            },
        )
        diff = compare_metadata(context, metadata)
    # The host application's own table is not ours to compare.
    return [
        d
        for d in diff
        if not (d[0] == "remove_table" and d[1].name == "alembic_version")
        and not _same_string_default(d)
    ]


def _same_string_default(diff: Any) -> bool:
    """Alembic reports SQLite's reflected ``DEFAULT ''`` (as the SQL text ``('')``) as
    differing from the metadata's ``server_default=""``; the DDL is identical."""
    if isinstance(diff, list):  # column-level changes come grouped per column
        return bool(diff) and all(_same_string_default(d) for d in diff)
    if diff[0] != "modify_default":
        return False
    reflected, wanted = diff[5], diff[6]
    text = getattr(getattr(reflected, "arg", None), "text", None)
    value = getattr(wanted, "arg", None)
    if not isinstance(value, str) or not isinstance(text, str):
        return False
    return text.strip("()") == "'" + value.replace("'", "''") + "'"


def _normalise(predicate: str) -> str:
    return re.sub(r"\s+", " ", predicate).strip()


def index_predicates(engine: sa.Engine) -> dict[str, tuple[Any, ...]]:
    """Every outbox index: columns, uniqueness and partial-index predicate, as reflected.

    compare_metadata does not compare partial-index WHERE clauses, so this does.
    """
    out: dict[str, tuple[Any, ...]] = {}
    with engine.connect() as conn:
        inspector = sa.inspect(conn)
        key = f"{engine.dialect.name}_where"
        for table in sorted(OUTBOX_TABLES):
            for ix in inspector.get_indexes(table):
                where = ix.get("dialect_options", {}).get(key)
                out[ix["name"]] = (
                    tuple(ix["column_names"]),
                    bool(ix["unique"]),
                    None if where is None else _normalise(str(where)),
                )
    return out


def test_upgrade_downgrade_upgrade(engine: sa.Engine) -> None:
    # A host application with its own Alembic history in the same database.
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
        conn.execute(sa.text(f"INSERT INTO alembic_version VALUES ('{HOST_REVISION}')"))
    assert current_revision(engine) is None

    upgrade(engine)
    assert tables(engine) == OUTBOX_TABLES | {VERSION_TABLE, "alembic_version"}
    assert current_revision(engine) == HEAD
    assert host_revision(engine) == [HOST_REVISION]
    assert schema_diff(engine) == []

    upgrade(engine)  # idempotent
    assert current_revision(engine) == HEAD

    downgrade(engine)
    assert tables(engine) & OUTBOX_TABLES == set()
    assert current_revision(engine) is None
    assert host_revision(engine) == [HOST_REVISION]

    upgrade(engine)
    assert tables(engine) >= OUTBOX_TABLES
    assert current_revision(engine) == HEAD
    assert host_revision(engine) == [HOST_REVISION]
    assert schema_diff(engine) == []

    # The migrated schema works: an operation can be stored and read back.
    with Outbox(engine, endpoints=[Endpoint(name="e", base_url="https://e.example")]) as ob:
        op = ob.enqueue(endpoint="e", method="POST", path="/x", json={"a": 1}, operation_id="o1")
        assert ob.get("o1").pk == op.pk


def test_0009_applies_to_a_database_holding_rows_and_back(engine: sa.Engine) -> None:
    upgrade(engine, "0008")
    args = canonicalize(
        endpoint="e",
        method="POST",
        path="/x",
        json_body={"a": 1},
        headers=None,
        max_body_bytes=1024,
    )
    row = operation_row(tenant="", operation_id="old", args=args, ordering_key=None, now_ms=1)
    del row["deliver_within_ms"]  # the column 0009 adds
    with engine.begin() as conn:
        conn.execute(operations.insert(), [row])
    upgrade(engine)
    assert current_revision(engine) == HEAD
    assert schema_diff(engine) == []
    with Outbox(engine, endpoints=[Endpoint(name="e", base_url="https://e.example")]) as ob:
        old = ob.get("old")
        assert (old.state, old.deliver_within_ms) == (State.PENDING, None)  # the policy's
        new = ob.enqueue(
            endpoint="e",
            method="POST",
            path="/x",
            json={},
            operation_id="new",
            deliver_within=timedelta(minutes=5),
        )
        assert ob.get("new").deliver_within_ms == new.deliver_within_ms == 300_000
    downgrade(engine, "0008")  # the rows stay; only their own deadlines go
    with engine.connect() as conn:
        columns = {c["name"] for c in sa.inspect(conn).get_columns("outbox_operations")}
        ids = conn.execute(sa.text("SELECT operation_id FROM outbox_operations ORDER BY id"))
        assert [r[0] for r in ids] == ["old", "new"]
    assert "deliver_within_ms" not in columns and "not_before" in columns
    upgrade(engine)
    with Outbox(engine, endpoints=[Endpoint(name="e", base_url="https://e.example")]) as ob:
        assert ob.get("new").deliver_within_ms is None


def test_schema_diff_sees_a_difference(engine: sa.Engine) -> None:
    """The comparison is not vacuous: a missing index is reported."""
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX ix_outbox_attempts_started_at"))
    diff = schema_diff(engine)
    assert [d[0] for d in diff] == ["add_index"]
    assert diff[0][1].name == "ix_outbox_attempts_started_at"


def test_partial_index_predicates_match_the_metadata(engine: sa.Engine) -> None:
    upgrade(engine)
    migrated = index_predicates(engine)
    downgrade(engine)
    metadata.create_all(engine)
    try:
        from_metadata = index_predicates(engine)
    finally:
        metadata.drop_all(engine)
    assert migrated == from_metadata
    partial = {name for name, (_, _, where) in migrated.items() if where is not None}
    assert partial == {
        "ix_outbox_operations_due",
        "ix_outbox_operations_ordering",
        "ix_outbox_attempts_open",
        "ix_outbox_operations_fair",
        "ix_outbox_operations_tenant_in_flight",
    }


def test_outbox_refuses_an_unmigrated_postgres_schema(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keep hold of every engine the Outbox makes (store.engine.outbox_engine), so this
    # test can dispose of it whatever Outbox.__init__ does on failure.
    made: list[sa.Engine] = []

    def tracking_create_engine(*args: Any, **kwargs: Any) -> sa.Engine:
        eng = create_engine(*args, **kwargs)
        made.append(eng)
        return eng

    monkeypatch.setattr(outbox.store.engine, "create_engine", tracking_create_engine)
    try:
        with pytest.raises(SchemaError, match="outbox migrate") as info:
            Outbox(pg_url)
        assert "missing" in str(info.value)
    finally:
        for eng in made:
            eng.dispose()
    probe = create_engine(pg_url)
    try:
        assert tables(probe) == set()  # nothing was created behind the operator's back
    finally:
        probe.dispose()


def test_outbox_refuses_a_postgres_schema_at_another_revision(pg_url: str) -> None:
    engine = create_engine(pg_url)
    try:
        upgrade(engine)
        with engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '0000'"))
        with pytest.raises(SchemaError, match="revision 0000"):
            Outbox(engine)  # a caller's engine: the caller disposes it
    finally:
        engine.dispose()


def test_outbox_creates_the_sqlite_schema_itself(sqlite_url: str) -> None:
    with Outbox(sqlite_url) as ob:
        assert tables(ob.engine) == OUTBOX_TABLES | {VERSION_TABLE}
        assert current_revision(ob.engine) == HEAD
        assert schema_diff(ob.engine) == []
    with Outbox(sqlite_url) as ob:  # a second open finds it in place
        assert current_revision(ob.engine) == HEAD
