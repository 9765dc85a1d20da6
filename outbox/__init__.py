"""outbox: a durable, client-side operation outbox for HTTP integrations.

Record the intent to call a remote API in your own database, in the same transaction
as your own change; a dispatcher sends it with a fixed ``Idempotency-Key`` and a fresh
request ID per attempt, retries within a bounded window, and moves what stays unknown
to a reconciliation queue for an operator.
"""

from outbox.classify import Classification
from outbox.client import Intent, Outbox
from outbox.clock import Clock, FakeClock, SystemClock
from outbox.config import DispatcherSettings, Endpoint, RetryPolicy, TenantScope
from outbox.dispatch import DispatchSummary
from outbox.errors import (
    ConcurrentModification,
    ConfigurationError,
    NotStoredError,
    OperationConflict,
    OperationNotFound,
    OperatorActionRefused,
    OutboxError,
    SchemaError,
    StoreError,
    ValidationError,
    WaitTimeout,
)
from outbox.lookup import StatusLookup
from outbox.model import (
    Attempt,
    Delivery,
    ErrorClass,
    Operation,
    Reason,
    Result,
    State,
    Verdict,
)
from outbox.store.engine import create_async_engine, create_engine

__version__ = "0.1.0"

__all__ = [
    "Attempt",
    "Classification",
    "Clock",
    "ConcurrentModification",
    "ConfigurationError",
    "Delivery",
    "DispatchSummary",
    "DispatcherSettings",
    "Endpoint",
    "ErrorClass",
    "FakeClock",
    "Intent",
    "NotStoredError",
    "Operation",
    "OperationConflict",
    "OperationNotFound",
    "OperatorActionRefused",
    "Outbox",
    "OutboxError",
    "Reason",
    "Result",
    "RetryPolicy",
    "SchemaError",
    "State",
    "StatusLookup",
    "StoreError",
    "SystemClock",
    "TenantScope",
    "ValidationError",
    "Verdict",
    "WaitTimeout",
    "__version__",
    "create_async_engine",
    "create_engine",
]
