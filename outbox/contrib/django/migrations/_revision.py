"""One Django migration per outbox schema revision, all made the same way.

Each migration module names its revision and the migration it follows; this builds the
``Migration`` class that brings Django's database to that revision through the outbox's
own Alembic migrations (:func:`outbox.contrib.django.connection.migrate_schema`). The
leading underscore keeps Django's migration loader from reading this module as one.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations


def outbox_revision(revision: str, *, after: str | None) -> type[migrations.Migration]:
    """The ``Migration`` class for outbox schema ``revision``, after migration ``after``.

    ``atomic`` is off: ``migrate_schema`` opens its own ``atomic()`` block, and SQLite's
    WAL switch in the first revision must come before it. ``after=None`` marks the
    initial migration.
    """

    def apply(apps: Any, schema_editor: Any) -> None:
        # Imported here, so that loading Django's migrations does not import SQLAlchemy.
        from outbox.contrib.django.connection import migrate_schema

        migrate_schema(schema_editor.connection.alias, revision)

    attributes: dict[str, Any] = {
        "__module__": __name__,
        "atomic": False,
        "initial": after is None,
        "dependencies": [] if after is None else [("outbox", after)],
        "operations": [migrations.RunPython(apply)],
    }
    return type("Migration", (migrations.Migration,), attributes)
