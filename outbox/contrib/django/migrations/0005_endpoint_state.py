"""Outbox schema revision 0006: the endpoints' fleet state (circuit breaker, pause)."""

from outbox.contrib.django.migrations._revision import outbox_revision

#: The outbox schema revision this Django migration brings the database to.
OUTBOX_REVISION = "0006"
Migration = outbox_revision(OUTBOX_REVISION, after="0004_request_forms")
