"""Outbox schema revision 0007: the endpoints' fleet limits (throttle, rate budget,
in-flight slices)."""

from outbox.contrib.django.migrations._revision import outbox_revision

#: The outbox schema revision this Django migration brings the database to.
OUTBOX_REVISION = "0007"
Migration = outbox_revision(OUTBOX_REVISION, after="0005_endpoint_state")
