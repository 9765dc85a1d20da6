"""outbox.contrib.django in a real, minimal Django project (tests/django_project/), on a
SQLite file and on a PostgreSQL schema.

Every step is a ``manage.py`` (or ``outbox``) subprocess, as a deployment runs them;
effects are read from the database with SQLAlchemy and from the receiver's own store.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.store.migrate import HEAD
from outbox.testing.receiver import Receiver

PROJECT = Path(__file__).resolve().parents[1] / "django_project"


class Shop:
    def __init__(self, url: str, tmp: Path) -> None:
        self.url = url
        self.tmp = tmp
        self.env = {
            **os.environ,
            "SHOP_DATABASE_URL": url,
            "DJANGO_SETTINGS_MODULE": "shop.settings",
            "PYTHONPATH": os.pathsep.join([str(PROJECT), os.environ.get("PYTHONPATH", "")]),
        }

    def run(self, *argv: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            argv,
            cwd=self.tmp,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        if ok:
            assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stderr}"
        return done

    def manage(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(sys.executable, "-W", "error", str(PROJECT / "manage.py"), *args, ok=ok)

    def outbox(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(str(Path(sys.executable).parent / "outbox"), *args)

    def query(self, sql: str) -> list[tuple[object, ...]]:
        engine = sa.create_engine(self.url)
        try:
            with engine.connect() as conn:
                return [tuple(r) for r in conn.execute(sa.text(sql))]
        finally:
            engine.dispose()

    def orders(self) -> list[tuple[object, ...]]:
        return self.query("SELECT id, status FROM shop_order ORDER BY id")

    def operations(self) -> list[tuple[object, ...]]:
        return self.query("SELECT operation_id, state FROM outbox_operations ORDER BY id")

    def private(self) -> None:
        """The dispatcher refuses a SQLite file others can read; Django made it 0644."""
        if self.url.startswith("sqlite"):
            os.chmod(sa.make_url(self.url).database or "", 0o600)


@pytest.fixture(params=["sqlite", "postgres"])
def shop(request: pytest.FixtureRequest, tmp_path: Path) -> Shop:
    if request.param == "sqlite":
        return Shop(f"sqlite:///{tmp_path / 'shop.sqlite3'}", tmp_path)
    return Shop(request.getfixturevalue("pg_url"), tmp_path)


@pytest.fixture
def inventory(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "inventory.sqlite3") as rx:
        yield rx


def test_manage_py_migrate_creates_the_schema_and_outbox_migrate_agrees(shop: Shop) -> None:
    shop.manage("migrate", "-v0")
    assert shop.query("SELECT version_num FROM outbox_alembic_version") == [(HEAD,)]
    assert shop.query(
        "SELECT app, name FROM django_migrations WHERE app = 'outbox' ORDER BY name"
    ) == [
        ("outbox", "0001_outbox_schema"),
        ("outbox", "0002_claim_order"),
        ("outbox", "0003_outbox_wake_mode"),
        ("outbox", "0004_request_forms"),
        ("outbox", "0005_endpoint_state"),
        ("outbox", "0006_endpoint_limits"),
        ("outbox", "0007_autovacuum"),
        ("outbox", "0008_deliver_within"),
    ]
    out = shop.outbox("--db", shop.url, "migrate").stdout
    assert f"(was {HEAD})" in out
    if shop.url.startswith("sqlite"):
        assert shop.query("PRAGMA journal_mode") == [("wal",)]


def test_outbox_migrate_first_then_manage_py_migrate_finds_nothing_to_do(shop: Shop) -> None:
    shop.outbox("--db", shop.url, "migrate")
    shop.manage("migrate", "-v0")
    assert shop.query("SELECT version_num FROM outbox_alembic_version") == [(HEAD,)]
    assert shop.operations() == []
    assert shop.query(
        "SELECT app, name FROM django_migrations WHERE app = 'outbox' ORDER BY name"
    ) == [
        ("outbox", "0001_outbox_schema"),
        ("outbox", "0002_claim_order"),
        ("outbox", "0003_outbox_wake_mode"),
        ("outbox", "0004_request_forms"),
        ("outbox", "0005_endpoint_state"),
        ("outbox", "0006_endpoint_limits"),
        ("outbox", "0007_autovacuum"),
        ("outbox", "0008_deliver_within"),
    ]


def test_model_and_operation_commit_together_or_not_at_all(shop: Shop) -> None:
    shop.manage("migrate", "-v0")
    # The enqueue is the first use of the outbox in the process, after the order row was
    # written in the same atomic(): nothing may end Django's transaction there.
    assert "placed 17" in shop.manage("place_order", "17").stdout
    assert "declined" in shop.manage("place_order", "18", "--fail").stdout
    assert shop.orders() == [(17, "reserving")]
    assert shop.operations() == [("order-17-reserve", "pending")]


def test_dispatch_through_the_management_command(shop: Shop, inventory: Receiver) -> None:
    shop.env["SHOP_INVENTORY_URL"] = inventory.url
    shop.manage("migrate", "-v0")
    shop.private()
    shop.manage("place_order", "17")
    out = shop.manage("outbox_dispatch", "--once").stdout
    # The summary in `outbox dispatch`'s words: key=value (JSON with --json).
    words = dict(p.split("=", 1) for p in out.strip().splitlines()[-1].split())
    assert words["succeeded"] == "1", out
    assert shop.operations() == [("order-17-reserve", "succeeded")]
    assert inventory.effect_count(key="order-17-reserve") == 1
    again = shop.manage("outbox_dispatch", "--once", "--json").stdout
    assert json.loads(again.strip().splitlines()[-1])["succeeded"] == 0


def test_plain_outbox_dispatch_works_on_the_same_database(shop: Shop, inventory: Receiver) -> None:
    shop.env["SHOP_INVENTORY_URL"] = inventory.url
    shop.manage("migrate", "-v0")
    shop.private()
    shop.manage("place_order", "17")
    shop.manage("place_order", "19")
    app = "outbox.contrib.django:outbox_from_settings"
    shop.outbox("--app", app, "dispatch", "--once")
    assert shop.operations() == [
        ("order-17-reserve", "succeeded"),
        ("order-19-reserve", "succeeded"),
    ]
    assert inventory.effect_count(key="order-17-reserve") == 1
    assert inventory.effect_count(key="order-19-reserve") == 1


def test_the_django_migration_reaches_the_outbox_schema_head() -> None:
    migrations = Path(importlib.import_module("outbox.contrib.django.migrations").__path__[0])
    last = sorted(p.stem for p in migrations.glob("0*.py"))[-1]
    module = importlib.import_module(f"outbox.contrib.django.migrations.{last}")
    assert module.OUTBOX_REVISION == HEAD


def test_enqueue_outside_atomic_commits_at_once_like_save(shop: Shop) -> None:
    shop.manage("migrate", "-v0")
    assert "autocommit done" in shop.manage("shop_scenario", "autocommit").stdout
    assert shop.orders() == [(20, "new")]
    assert shop.operations() == [("order-20-reserve", "pending")]


def test_priority_not_before_and_deliver_within_on_djangos_connection(shop: Shop) -> None:
    shop.manage("migrate", "-v0")
    out = shop.manage("shop_scenario", "scheduled").stdout
    assert "naive refused" in out and "no deadline refused" in out and "scheduled done" in out
    assert shop.orders() == [(40, "new")]
    assert shop.operations() == [("order-40-reserve", "pending"), ("order-42-reserve", "pending")]
    row = shop.query(
        "SELECT priority, not_before, next_attempt_at FROM outbox_operations ORDER BY id"
    )
    at = 1925089445000  # 2031-01-02T03:04:05Z
    assert [tuple(int(v) for v in r) for r in row[:1]] == [(5, at, at)]
    within = shop.query("SELECT deliver_within_ms FROM outbox_operations ORDER BY id")
    assert [r[0] for r in within] == [None, 2 * 3600 * 1000]


def test_a_conflict_inside_atomic_leaves_djangos_transaction_usable(shop: Shop) -> None:
    shop.manage("migrate", "-v0")
    shop.manage("place_order", "17")
    out = shop.manage("shop_scenario", "conflict").stdout
    assert "conflict refused" in out
    assert "conflict done" in out
    assert shop.orders() == [(17, "reserving"), (30, "kept")]
    assert shop.operations() == [("order-17-reserve", "pending")]
    body = shop.query("SELECT body FROM outbox_operations")[0][0]
    assert json.loads(str(body))["order_id"] == 17  # the stored intent is untouched


def test_outbox_dispatch_before_migrate_is_one_line_and_exit_3(shop: Shop) -> None:
    done = shop.manage("outbox_dispatch", "--once", ok=False)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert "manage.py migrate" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_projects_own_tests_pass_under_djangos_test_runner(tmp_path: Path) -> None:
    """manage.py test creates a test database (a file here), migrates it through the
    contrib app's migration, and the outbox follows Django to it."""
    shop = Shop(f"sqlite:///{tmp_path / 'shop.sqlite3'}", tmp_path)
    shop.env["SHOP_TEST_DATABASE"] = str(tmp_path / "test-shop.sqlite3")
    done = shop.manage("test", "shop", "-v", "2", "--noinput")
    assert "Ran 2 tests" in done.stderr
    assert "Applying outbox.0001_outbox_schema... OK" in done.stdout + done.stderr
