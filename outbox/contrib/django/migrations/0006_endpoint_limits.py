"""Outbox schema revision 0007: the endpoints' fleet limits (throttle, rate budget,
in-flight slices)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

#: The outbox schema revision this Django migration brings the database to.
OUTBOX_REVISION = "0007"


def apply(apps: Any, schema_editor: Any) -> None:
    from outbox.contrib.django.connection import migrate_schema

    migrate_schema(schema_editor.connection.alias, OUTBOX_REVISION)


class Migration(migrations.Migration):
    atomic = False  # apply() opens its own atomic(), as the first migration does
    dependencies: ClassVar[list[tuple[str, str]]] = [("outbox", "0005_endpoint_state")]
    operations: ClassVar[list[Any]] = [migrations.RunPython(apply)]
