"""Outbox schema revision 0005: the bytes of form and raw request bodies."""

from outbox.contrib.django.migrations._revision import outbox_revision

#: The outbox schema revision this Django migration brings the database to.
OUTBOX_REVISION = "0005"
Migration = outbox_revision(OUTBOX_REVISION, after="0003_outbox_wake_mode")
