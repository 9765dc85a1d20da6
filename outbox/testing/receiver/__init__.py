"""A real local HTTP receiver with idempotency receipts and fault injection.

The :class:`Receiver` is what a correct receiving API looks like from the outside: it
deduplicates operations on ``(tenant, Idempotency-Key)`` in the same SQLite transaction
as the effect, binds each key to its canonical payload, replays the stored response with
the *current* request's ``X-Request-ID``, and injects faults on demand. Its SQLite file
is the oracle: tests count effects by reading the file, never by trusting responses.

Tables in the SQLite file (stable; the soak's checker reads them with plain SQL):

``requests``
    One row per non-admin request, written at arrival and updated with its outcome:
    ``seq, arrived_at_ms, method, path, tenant, idempotency_key, request_id,
    body_sha256, outcome, status, traceparent`` (``status`` is NULL when no response was
    sent; ``traceparent`` is the W3C trace context header, if the request had one).
``receipts``
    ``tenant, idempotency_key, payload_hash, state ('processing'|'complete'),
    response_status, response_body, created_at_ms, stuck``.
``effects``
    One row per applied operation: ``id, tenant, idempotency_key, method, path, body,
    body_sha256, client_operation_id, request_id, created_at_ms``.

Request outcomes: ``applied``, ``replayed``, ``conflict`` (422, key reused with another
payload), ``in_progress`` (409), ``missing_key`` (400), ``refused`` (handler refused),
``handler_error``, ``lookup``, ``not_found``, ``method_not_allowed``, ``bad_request``,
``fault:<kind>`` for injected faults, ``received`` while a new key is being processed and
``interrupted`` for such rows found when the receiver starts again.

Admin routes (never logged, never create effects), all JSON:

``GET /__receiver/health``
    ``{"ok": true, "pid": N}``
``GET /__receiver/faults``
    ``{"faults": [spec, ...]}`` with the remaining ``times`` of each rule.
``POST /__receiver/faults``
    One spec or ``{"faults": [spec, ...]}``. A spec is ``{"kind": K, ...}`` where ``K``
    is a :class:`Faults` method name and the other fields are its keyword arguments
    (``times, probability, seed, key, path, status, retry_after, stored, seconds,
    tenant``). Answers 400 ``{"error": "invalid_fault", "detail": ...}`` when invalid.
``POST /__receiver/faults/clear``
    Same as :meth:`Faults.clear`.

Run it in its own process with ``python -m outbox.testing.receiver --db PATH --port N``
(see ``--help``); it prints ``listening http://HOST:PORT`` and serves until SIGTERM or
SIGINT. :meth:`Receiver.spawn` does that and returns a :class:`RemoteReceiver`; it takes the
same options as :class:`Receiver` but ``handler`` (:class:`SpawnOptions`), each a flag
of the command.

The package, one concept per module: :mod:`.records` (the SQLite file and its rows),
:mod:`.faults` (fault controls, specs and the plan), :mod:`.dialects` (how answers are
worded), :mod:`.writer` (the one writer thread, group commit), :mod:`.service` (receipts,
effects, the request log, admin routes), :mod:`.server` (the HTTP/1.1 server and its
sockets), :mod:`.oracle` (reading the file), :mod:`.handle` (what both kinds share,
:class:`ReceiverHandle`), :mod:`.inprocess` (:class:`Receiver`),
:mod:`.remote` (:class:`RemoteReceiver`) and :mod:`.command` (the ``-m`` entry point).
"""

from outbox.testing.receiver.command import main
from outbox.testing.receiver.faults import Faults, RandomFaults, Target
from outbox.testing.receiver.handle import ReceiverHandle
from outbox.testing.receiver.inprocess import Receiver
from outbox.testing.receiver.records import Effect, Receipt, RequestRecord
from outbox.testing.receiver.remote import RemoteReceiver, SpawnOptions
from outbox.testing.receiver.service import EffectHandler, Refuse

__all__ = [
    "Effect",
    "EffectHandler",
    "Faults",
    "RandomFaults",
    "Receipt",
    "Receiver",
    "ReceiverHandle",
    "Refuse",
    "RemoteReceiver",
    "RequestRecord",
    "SpawnOptions",
    "Target",
    "main",
]
