"""Outbox revision 0004: ``outbox_dispatchers.wake_mode`` (see 0001 for how these run)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

#: The outbox schema revision this Django migration brings the database to.
OUTBOX_REVISION = "0004"


def apply(apps: Any, schema_editor: Any) -> None:
    from outbox.contrib.django.connection import migrate_schema

    migrate_schema(schema_editor.connection.alias, OUTBOX_REVISION)


class Migration(migrations.Migration):
    atomic = False  # as 0001
    dependencies: ClassVar[list[tuple[str, str]]] = [("outbox", "0002_claim_order")]
    operations: ClassVar[list[Any]] = [migrations.RunPython(apply)]
