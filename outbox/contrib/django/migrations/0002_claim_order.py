"""The outbox schema to revision 0003 (priority, not_before and the fair claim's
indexes), through the outbox's own Alembic migrations, on Django's connection."""

from outbox.contrib.django.migrations._revision import outbox_revision

#: The outbox schema revision this Django migration brings the database to.
OUTBOX_REVISION = "0003"
Migration = outbox_revision(OUTBOX_REVISION, after="0001_outbox_schema")
