"""The outbox tables, through the outbox's own Alembic migrations, on Django's connection.

``manage.py migrate`` and ``outbox migrate`` apply the same migrations and record them in
the same version table (``outbox_alembic_version``), so either may run first and the
other finds nothing to do. The migrations run in one ``atomic()`` block on Django's
connection. Irreversible: unapplying would drop undelivered intents.
"""

from outbox.contrib.django.migrations._revision import outbox_revision

#: The outbox schema revision this Django migration brings the database to. A new
#: outbox revision ships with a new Django migration (a test checks they agree).
OUTBOX_REVISION = "0002"
Migration = outbox_revision(OUTBOX_REVISION, after=None)
