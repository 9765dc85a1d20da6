"""The receiver kit: idempotency receipts beside the handler's effect, for teams that
own both sides of an outbox integration.

A receipt row commits in the same transaction as the handler's effect; the scope comes
from the application's own authentication; replays are marked ``Idempotent-Replayed``;
``409`` + ``Retry-After`` while the first request runs; ``422`` (RFC 9457) for a changed
payload; ``400`` for a missing key; a handler exception stores nothing and frees the key;
a claim lease frees a key after a crash; every answer declares the key's retention in
``Idempotency-Key-Retention``; ``GET /operations/{key}`` answers what the outbox's
default status lookup reads. See ``docs/guide/owning-both-sides.md``.

Adapters: :mod:`outbox.receiver.asgi` (Starlette/FastAPI), :mod:`outbox.receiver.djangokit`
and :meth:`Receipts.handle` (any other framework).
"""

from outbox.receiver.answers import REPLAYED_HEADER, RETENTION_HEADER, Reply, fingerprint
from outbox.receiver.kit import Claim, Identity, Receipts, Request
from outbox.receiver.store import Scope

__all__ = [
    "REPLAYED_HEADER",
    "RETENTION_HEADER",
    "Claim",
    "Identity",
    "Receipts",
    "Reply",
    "Request",
    "Scope",
    "fingerprint",
]
