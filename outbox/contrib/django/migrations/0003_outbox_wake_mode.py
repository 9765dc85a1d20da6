"""Outbox revision 0004: ``outbox_dispatchers.wake_mode`` (see 0001 for how these run)."""

from outbox.contrib.django.migrations._revision import outbox_revision

#: The outbox schema revision this Django migration brings the database to.
OUTBOX_REVISION = "0004"
Migration = outbox_revision(OUTBOX_REVISION, after="0002_claim_order")
