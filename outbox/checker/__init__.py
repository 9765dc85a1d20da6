"""A conformance check of a receiver's idempotency, by probing it over HTTP.

:func:`check_receiver` sends a handful of probe operations (fresh operation IDs starting
with ``outbox-probe-``) to one endpoint, through httpx with the endpoint's base URL,
auth, static headers, idempotency and request ID headers, exactly as the dispatcher
would, and reports one verdict per property:

``same_key_same_result``
    The same key twice returns the same result, and (where the receiver can be asked
    through the endpoint's ``status_lookup``) one operation is recorded under the key.
``changed_payload_refused``
    The same key with changed arguments is refused (422, or whatever it does, said
    plainly), not silently replayed or applied.
``new_key_new_operation``
    A different key with the same payload is a new operation, not deduplicated by
    payload.
``replay_fresh_request_id``
    A replay carries the current attempt's request ID, not the cached first one.
``concurrent_duplicates``
    Several requests with one key at once yield one result.
``key_retained``
    The key is still honoured after a short delay: a hint about retention, no more.
``tenants_kept_apart``
    The same key under two tenants is two operations, the way the endpoint declares it
    scopes tenants (header, key prefix or per-tenant credentials).

Each verdict is passed (True), failed (False) or undecided (None), with the request IDs,
status codes, truncated bodies and header values it rests on (``evidence``, and in words
``rests_on``). An undecided verdict is either "could not tell" (ambiguous answers) or
"not observed" (``observed=False``): a property the answers cannot show, such as one
effect behind answers that look like replays, with nothing (a status lookup) to count
effects by; such a property is never passed. A run that decided nothing fails; with
``strict`` any undecided verdict does. The probe body takes the form the endpoint's
operations use (``json_body``, form ``data`` or raw ``content``). The probes create real
effects, so the check refuses an endpoint not marked ``probe_safe=True`` unless told
``allow_unsafe=True``. Passing proves nothing about production: it is one test receiver,
probed a few times, at one moment.
"""

from outbox.checker.probes import PROBE_PREFIX, PROBE_TENANTS, changed_payload
from outbox.checker.report import CHECKS, NOTICE, CheckReport, CheckVerdict
from outbox.checker.run import UnsafeProbeRefused, check_receiver, check_receiver_async

__all__ = [
    "CHECKS",
    "NOTICE",
    "PROBE_PREFIX",
    "PROBE_TENANTS",
    "CheckReport",
    "CheckVerdict",
    "UnsafeProbeRefused",
    "changed_payload",
    "check_receiver",
    "check_receiver_async",
]
