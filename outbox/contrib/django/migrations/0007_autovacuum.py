"""Outbox schema revision 0008: autovacuum settings of the queue tables (PostgreSQL)."""

from outbox.contrib.django.migrations._revision import outbox_revision

#: The outbox schema revision this Django migration brings the database to.
OUTBOX_REVISION = "0008"
Migration = outbox_revision(OUTBOX_REVISION, after="0006_endpoint_limits")
