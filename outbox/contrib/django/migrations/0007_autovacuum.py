"""Outbox schema revision 0008: autovacuum settings of the queue tables (PostgreSQL)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

#: The outbox schema revision this Django migration brings the database to.
OUTBOX_REVISION = "0008"


def apply(apps: Any, schema_editor: Any) -> None:
    from outbox.contrib.django.connection import migrate_schema

    migrate_schema(schema_editor.connection.alias, OUTBOX_REVISION)


class Migration(migrations.Migration):
    atomic = False  # apply() opens its own atomic(), as the first migration does
    dependencies: ClassVar[list[tuple[str, str]]] = [("outbox", "0006_endpoint_limits")]
    operations: ClassVar[list[Any]] = [migrations.RunPython(apply)]
