"""The outbox tables, through the outbox's own Alembic migrations, on Django's connection.

``manage.py migrate`` and ``outbox migrate`` apply the same migrations and record them in
the same version table (``outbox_alembic_version``), so either may run first and the
other finds nothing to do. The migrations run in one ``atomic()`` block on Django's
connection. Irreversible: unapplying would drop undelivered intents.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

#: The outbox schema revision this Django migration brings the database to. A new
#: outbox revision ships with a new Django migration (a test checks they agree).
OUTBOX_REVISION = "0002"


def apply(apps: Any, schema_editor: Any) -> None:
    from outbox.contrib.django.connection import migrate_schema

    migrate_schema(schema_editor.connection.alias, OUTBOX_REVISION)


class Migration(migrations.Migration):
    initial = True
    atomic = False  # apply() opens its own atomic(): SQLite's WAL switch must come first
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [migrations.RunPython(apply)]
