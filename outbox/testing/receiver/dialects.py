"""How the test receiver words its idempotency answers: one dialect per family of
real receivers.

Receivers agree on what they do (one effect per key, the first result kept) and disagree
on how they say it. A dialect fixes the three answers that differ:

* a request whose key is still being processed ("in progress");
* a key reused with a changed payload ("conflict");
* a replay of a completed key (its status).

=============  =======================================  ==================================
dialect        in progress                              changed payload
=============  =======================================  ==================================
``ietf``       409 ``{"error": "idempotency_key_in_     422 ``{"error": "idempotency_key_
               use"}``                                  reused", "detail": ...}``
``article``    409 ``{"error": "operation_in_           409 ``{"error": "payload_conflict"}``
               progress"}``
``stripe-      409 ``{"error": {"type": "idempotency_   400 ``{"error": {"type":
like``         error", "code": "idempotency_key_in_     "idempotency_error", "message":
               use", "message": ...}}``                 ...}}``
``detail``     409 ``{"detail": "... currently in       422 ``{"detail": "... a different
               progress."}``                            request payload."}``
``replay-409`` as ``ietf``                              as ``ietf``; and a replay is
                                                        answered 409 with the original
                                                        body (declare
                                                        ``Endpoint(replay_status=409)``)
=============  =======================================  ==================================

``ietf`` (the IETF ``Idempotency-Key`` draft) is the default. ``article`` is the
receiver of the background article; ``stripe-like`` follows Stripe's documented
answers; ``detail`` is how FastAPI middlewares (fastapi-idempotency-key,
fastapi-idempotency) answer; ``replay-409`` is django-idempotency-key's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DIALECTS", "Dialect", "dialect_named", "endpoint_options"]


@dataclass(frozen=True, slots=True)
class Dialect:
    """The wording of one family of receivers."""

    name: str
    #: Status and JSON body of "this key is still being processed".
    in_progress_status: int
    in_progress_body: Any
    #: Status and JSON body of "this key was used with another payload".
    conflict_status: int
    conflict_body: Any
    #: The status a replay is answered with; None: the stored response's own status.
    replay_status: int | None = None


_IETF_IN_PROGRESS = {"error": "idempotency_key_in_use"}
_IETF_CONFLICT = {
    "error": "idempotency_key_reused",
    "detail": "this Idempotency-Key was first used with a different request "
    "(method, path or body); the first result is kept",
}

DIALECTS: dict[str, Dialect] = {
    d.name: d
    for d in (
        Dialect("ietf", 409, _IETF_IN_PROGRESS, 422, _IETF_CONFLICT),
        Dialect(
            "article",
            409,
            {"error": "operation_in_progress"},
            409,
            {"error": "payload_conflict"},
        ),
        Dialect(
            "stripe-like",
            409,
            {
                "error": {
                    "type": "idempotency_error",
                    "code": "idempotency_key_in_use",
                    "message": "There is currently another in-progress request using "
                    "this Idempotency-Key. Try again later.",
                }
            },
            400,
            {
                "error": {
                    "type": "idempotency_error",
                    "message": "Keys for idempotent requests can only be used with the "
                    "same parameters they were first used with.",
                }
            },
        ),
        Dialect(
            "detail",
            409,
            {"detail": "A request with this idempotency key is currently in progress."},
            422,
            {"detail": "Idempotency key was previously used with a different request payload."},
        ),
        Dialect("replay-409", 409, _IETF_IN_PROGRESS, 422, _IETF_CONFLICT, replay_status=409),
    )
}


def dialect_named(name: str) -> Dialect:
    """The dialect called ``name``; ValueError names the known ones."""
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError(f"dialect must be one of {sorted(DIALECTS)}, got {name!r}") from None


def endpoint_options(name: str) -> dict[str, Any]:
    """What an ``outbox.Endpoint`` must declare to talk to a receiver of this dialect."""
    dialect = dialect_named(name)
    return {} if dialect.replay_status is None else {"replay_status": dialect.replay_status}
