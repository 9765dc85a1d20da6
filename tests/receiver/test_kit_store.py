"""The receipts flow through the plain function API, on SQLite and PostgreSQL, with an
injected clock: lease takeover and fencing, stored 5xx, purge, the migrations' own
version table, the fingerprint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Column, Connection, Engine, Integer, MetaData, Table, inspect, select

import outbox
from outbox.receiver import Receipts, Reply, Request, Scope, fingerprint
from outbox.receiver.migrate import HEAD, VERSION_TABLE, current_revision

effects_md = MetaData()
effects = Table("kit_effects", effects_md, Column("id", Integer, primary_key=True))
SCOPE = Scope("acme", "orders-app", "POST", "/reservations")
REQ = Request("POST", "/reservations", b'{"a":1,"b":2}', "application/json")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'kit.sqlite3'}"
    else:
        url = request.getfixturevalue("pg_url")
    eng = outbox.create_engine(url)
    effects_md.create_all(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def kit(engine: Engine, clock: Clock) -> Receipts:
    receipts = Receipts(engine, lease=timedelta(seconds=10), retention=timedelta(hours=1),
                        clock=clock)  # fmt: skip
    receipts.migrate()
    return receipts


def _count(engine: Engine) -> int:
    with engine.connect() as conn:
        return len(conn.execute(select(effects.c.id)).all())


def _effect(status: int = 201) -> object:
    def handler(conn: Connection) -> Reply:
        new = conn.execute(effects.insert().returning(effects.c.id)).scalar_one()
        return Reply(status, {"content-type": "application/json"}, json.dumps({"id": new}).encode())

    return handler


def test_own_version_table(kit: Receipts, engine: Engine) -> None:
    assert current_revision(engine) == HEAD
    names = set(inspect(engine).get_table_names())
    assert {VERSION_TABLE, "outbox_receipts"} <= names
    assert "outbox_alembic_version" not in names and "alembic_version" not in names
    kit.migrate()  # idempotent
    assert current_revision(engine) == HEAD


def test_replay_and_json_key_order(kit: Receipts, engine: Engine) -> None:
    first = kit.handle(SCOPE, "k", REQ, _effect())  # type: ignore[arg-type]
    reordered = Request("POST", "/reservations", b'{ "b": 2, "a": 1 }', "application/json")
    again = kit.handle(SCOPE, "k", reordered, _effect())  # type: ignore[arg-type]
    assert again.replayed and again.body == first.body and again.status == 201
    assert again.headers["idempotent-replayed"] == "true"
    changed = Request("POST", "/reservations", b'{"a":1,"b":3}', "application/json")
    assert kit.handle(SCOPE, "k", changed, _effect()).status == 422  # type: ignore[arg-type]
    assert _count(engine) == 1


def test_a_stale_holder_is_fenced_after_takeover(
    kit: Receipts, engine: Engine, clock: Clock
) -> None:
    slow = kit.claim(SCOPE, "k", REQ)
    assert not isinstance(slow, Reply)
    held = kit.claim(SCOPE, "k", REQ)
    assert isinstance(held, Reply) and held.status == 409
    assert held.headers["retry-after"] == "10"
    clock.now += 11  # the first holder's lease ran out (it is paused, or crashed)
    fresh = kit.handle(SCOPE, "k", REQ, _effect())  # type: ignore[arg-type]
    assert fresh.status == 201 and not fresh.replayed
    with kit.transaction(slow) as conn:
        late = kit.finish(slow, conn, _effect()(conn))  # type: ignore[operator]
    assert late.status == 409  # its effect rolled back: the key is another's now
    assert _count(engine) == 1
    assert kit.handle(SCOPE, "k", REQ, _effect()).replayed  # type: ignore[arg-type]


def test_a_5xx_is_not_stored_by_default(kit: Receipts, engine: Engine) -> None:
    failed = kit.handle(SCOPE, "k", REQ, _effect(500))  # type: ignore[arg-type]
    assert failed.status == 500 and _count(engine) == 0
    assert kit.handle(SCOPE, "k", REQ, _effect()).status == 201  # type: ignore[arg-type]
    assert _count(engine) == 1


def test_store_5xx_replays_it(engine: Engine, clock: Clock) -> None:
    kit = Receipts(engine, store_5xx=True, clock=clock)
    kit.migrate()
    assert kit.handle(SCOPE, "k", REQ, _effect(500)).status == 500  # type: ignore[arg-type]
    again = kit.handle(SCOPE, "k", REQ, _effect())  # type: ignore[arg-type]
    assert again.status == 500 and again.replayed and _count(engine) == 1


def test_exception_frees_the_key(kit: Receipts, engine: Engine) -> None:
    def boom(conn: Connection) -> Reply:
        conn.execute(effects.insert())
        raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError):
        kit.handle(SCOPE, "k", REQ, boom)
    assert _count(engine) == 0
    assert kit.handle(SCOPE, "k", REQ, _effect()).status == 201  # type: ignore[arg-type]


def test_status_and_expiry_and_purge(kit: Receipts, engine: Engine, clock: Clock) -> None:
    kit.handle(SCOPE, "k", REQ, _effect())  # type: ignore[arg-type]
    assert kit.status("acme", "orders-app", "k").status == 200
    assert kit.status("acme", "someone-else", "k").status == 404
    claim = kit.claim(SCOPE, "running", REQ)
    assert not isinstance(claim, Reply)
    assert kit.status("acme", "orders-app", "running").status == 409
    clock.now += 3601
    assert kit.status("acme", "orders-app", "k").json() == {"state": "expired"}
    seen: list[int] = []
    assert kit.purge(batch=1, progress=seen.append) == 2
    assert seen == [1, 2]
    assert kit.status("acme", "orders-app", "k").status == 404
    # A resend after the retention is a new request: a new effect.
    assert not kit.handle(SCOPE, "k", REQ, _effect()).replayed  # type: ignore[arg-type]


def test_missing_and_invalid_keys_write_nothing(kit: Receipts, engine: Engine) -> None:
    assert kit.handle(SCOPE, None, REQ, _effect()).status == 400  # type: ignore[arg-type]
    assert kit.handle(SCOPE, "bad key", REQ, _effect()).status == 400  # type: ignore[arg-type]
    assert _count(engine) == 0 and kit.status("acme", "orders-app", "bad key").status == 404


def test_fingerprint_covers_the_validated_request() -> None:
    base = fingerprint("POST", "/r", "application/json", b'{"a":1,"b":[1,2]}')
    assert base == fingerprint(
        "post", "/r", "application/json; charset=utf-8", b'{"b":[1,2],"a":1}'
    )
    assert base != fingerprint("POST", "/r", "application/json", b'{"a":1,"b":[2,1]}')
    assert base != fingerprint("POST", "/other", "application/json", b'{"a":1,"b":[1,2]}')
    form = "application/x-www-form-urlencoded"
    assert fingerprint("POST", "/r", form, b"a=1&b=2") == fingerprint(
        "POST", "/r", form, b"b=2&a=1"
    )
    assert fingerprint("POST", "/r", "text/plain", b"x ") != fingerprint(
        "POST", "/r", "text/plain", b"x"
    )
    assert fingerprint("POST", "/r", None, b"", "q=1") != fingerprint(
        "POST", "/r", None, b"", "q=2"
    )


def test_migrations_match_the_table_source(kit: Receipts, engine: Engine) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from outbox.receiver.tables import metadata

    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"version_table": VERSION_TABLE, "compare_type": True}
        )
        diff = compare_metadata(context, metadata)
    ours = [d for d in diff if not (d[0] == "remove_table" and d[1].name != "outbox_receipts")]
    assert ours == []


def test_the_wheel_ships_the_receipts_migrations(tmp_path: Path) -> None:
    import subprocess
    import sys
    import zipfile

    pytest.importorskip("hatchling")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys; from hatchling.builders.wheel import WheelBuilder; "
         "print(WheelBuilder(sys.argv[1]).build_standard(sys.argv[2]))", str(root), str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    wheel = Path(done.stdout.strip().splitlines()[-1])
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "outbox/receiver/migrations/env.py" in names
    assert "outbox/receiver/migrations/versions/r0001_receipts.py" in names


def test_the_wheel_layout_is_declared_and_found() -> None:
    """Without a wheel builder here: pyproject force-includes the directory where the
    installed kit looks for it."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    wheel = config["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert wheel["receiver_migrations"] == "outbox/receiver/migrations"
    from outbox.receiver import migrate

    installed = Path(migrate.__file__).resolve().parent / "migrations"
    assert installed.relative_to(root) == Path("outbox/receiver/migrations")
    assert migrate.migrations_dir() == root / "receiver_migrations"  # the checkout's


def test_receipt_lookup_comes_before_the_version_check(kit: Receipts, engine: Engine) -> None:
    """Seed 000: a retry of an edit that committed is recognised from its receipt,
    though the version it carries is stale now; a new edit with that version is refused."""
    settings = Table("kit_settings", effects_md, Column("id", Integer, primary_key=True),
                     Column("interval", Integer), Column("version", Integer),
                     extend_existing=True)  # fmt: skip
    settings.create(engine, checkfirst=True)
    with engine.begin() as conn:
        conn.execute(settings.insert().values(id=1, interval=15, version=1))
    edit = Request("PATCH", "/settings/1", b'{"expected_version":1,"interval":30}',
                   "application/json")  # fmt: skip

    def set_interval(conn: Connection) -> Reply:
        row = conn.execute(
            settings.update().where(settings.c.id == 1, settings.c.version == 1)
            .values(interval=30, version=settings.c.version + 1)
            .returning(settings.c.version)
        ).first()  # fmt: skip
        if row is None:
            return Reply(412, {"content-type": "application/json"}, b'{"error":"stale_version"}')
        return Reply(200, {"content-type": "application/json"}, b'{"version":%d}' % row[0])

    scope = Scope("acme", "orders-app", "PATCH", "/settings/{id}")
    first = kit.handle(scope, "edit-42", edit, set_interval)
    assert (first.status, first.body) == (200, b'{"version":2}')
    retry = kit.handle(scope, "edit-42", edit, set_interval)
    assert (retry.status, retry.body, retry.replayed) == (200, b'{"version":2}', True)
    other = kit.handle(scope, "edit-43", edit, set_interval)
    assert other.status == 412 and not other.replayed
    with engine.connect() as conn:
        assert conn.execute(select(settings.c.interval, settings.c.version)).all() == [(30, 2)]
