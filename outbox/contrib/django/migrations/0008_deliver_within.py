"""Outbox schema revision 0009: a business deadline of the operation's own
(``enqueue(deliver_within=...)``)."""

from outbox.contrib.django.migrations._revision import outbox_revision

#: The outbox schema revision this Django migration brings the database to.
OUTBOX_REVISION = "0009"
Migration = outbox_revision(OUTBOX_REVISION, after="0007_autovacuum")
