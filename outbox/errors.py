"""The exceptions outbox raises.

Every exception derives from :class:`OutboxError`::

    OutboxError
    ├── ConfigurationError      an Endpoint, RetryPolicy or Outbox set up wrongly
    ├── ValidationError         (also a ValueError) bad enqueue input; nothing was written
    ├── OperationConflict       the (tenant, operation ID) exists with other arguments
    ├── OperationNotFound       no operation with that (tenant, operation ID)
    ├── WaitTimeout             (also a TimeoutError) wait() gave up before a settled state
    ├── KeyUnavailableError     an encrypted value's key is missing, wrong, or does not
    │                           open it (encryption at rest: outbox.base.keys)
    ├── OperatorActionRefused   an operator command does not apply in the current state
    │   └── ConcurrentModification  someone else changed the operation first
    └── StoreError              the database failed or refused; the write did not happen
        │                       (except StoreOutcomeUnknown, below)
        ├── NotStoredError      enqueue was provably not stored (e.g. the database is
        │                       locked, or the transaction failed before COMMIT)
        ├── StoreOutcomeUnknown enqueue's COMMIT failed and whether it took effect could
        │                       not be established: re-enqueue with the *same* operation
        │                       ID (idempotent), never with a new one
        └── SchemaError         the schema is missing or older than this code

``StoreOutcomeUnknown`` is deliberately not a ``NotStoredError``: a caller that treats
"not stored" as "enqueue a new operation" must not do so when the row may exist.

Delivery failures (timeouts, 5xx, refused connections) are never raised out of the
dispatcher: they are recorded as attempt outcomes.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error raised by outbox."""


class ConfigurationError(OutboxError):
    """An endpoint, retry policy or outbox was configured inconsistently."""


class ValidationError(OutboxError, ValueError):
    """Enqueue input was refused before anything was written."""


class OperationConflict(OutboxError):
    """The operation ID is already bound to different arguments in this tenant."""

    def __init__(self, message: str, *, tenant: str, operation_id: str) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.operation_id = operation_id


class OperationNotFound(OutboxError, LookupError):
    """No operation exists with that tenant and operation ID."""


class WaitTimeout(OutboxError, TimeoutError):
    """``Outbox.wait`` timed out before the operation settled."""


class KeyUnavailableError(OutboxError):
    """An encrypted value names a key the key ring does not have, or cannot open it."""

    def __init__(self, message: str, *, key_id: str) -> None:
        super().__init__(message)
        self.key_id = key_id


class OperatorActionRefused(OutboxError):
    """An operator action does not apply to the operation in its current state."""


class ConcurrentModification(OperatorActionRefused):
    """The operation changed between reading it and acting on it; nothing was written."""

    def __init__(self, message: str, *, tenant: str = "", operation_id: str = "") -> None:
        super().__init__(message)
        self.tenant = tenant
        self.operation_id = operation_id


class StoreError(OutboxError):
    """The database failed; the write in progress did not happen."""


class NotStoredError(StoreError):
    """An operation could not be stored; the caller must treat it as not enqueued."""

    @classmethod
    def because(cls, detail: object) -> NotStoredError:
        """The one wording of "not stored", with what failed."""
        return cls(f"the operation was not stored: {detail}")


class StoreOutcomeUnknown(StoreError):
    """enqueue's own COMMIT failed, and the database could not say whether it applied.

    The operation may be stored (and will then be sent). Retry ``enqueue`` with the same
    operation ID(s): that returns the stored operation if it exists and stores it if not.
    Never mint a new operation ID for it, and never compensate as if it did not happen.
    """

    def __init__(self, message: str, *, keys: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        #: (tenant, operation ID) of each operation whose fate is unknown.
        self.keys = keys


class SchemaError(StoreError):
    """The database schema is missing or not at the version this code expects.

    ``missing`` is true when there is no outbox schema at all (or, on SQLite, no file);
    ``outbox migrate`` creates it.
    """

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing
