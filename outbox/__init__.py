"""outbox: a durable, client-side operation outbox for HTTP integrations.

Record the intent to call a remote API in your own database, in the same transaction
as your own change; a dispatcher sends it with a fixed ``Idempotency-Key`` and a fresh
request ID per attempt, retries within a bounded window, and moves what stays unknown
to a reconciliation queue for an operator.
"""

import importlib as _importlib
import typing as _typing

from outbox.base.version import __version__  # the one place the version is written
from outbox.clock import Clock, FakeClock, SystemClock
from outbox.errors import (
    ConcurrentModification,
    ConfigurationError,
    KeyUnavailableError,
    NotStoredError,
    OperationConflict,
    OperationNotFound,
    OperatorActionRefused,
    OutboxError,
    SchemaError,
    StoreError,
    StoreOutcomeUnknown,
    ValidationError,
    WaitTimeout,
)
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

if _typing.TYPE_CHECKING:
    from outbox.base.keys import KeyRing
    from outbox.canonical import Intent
    from outbox.classify import Classification
    from outbox.client import Outbox
    from outbox.config import (
        DispatcherSettings,
        Endpoint,
        RetryPolicy,
        StatusLookup,
        TenantScope,
    )
    from outbox.dispatch.dispatcher import DispatchSummary
    from outbox.store.engine import create_async_engine, create_engine

#: Imported on first use: the dispatcher brings httpx, aiohttp and tenacity with it, and
#: SQLAlchemy's engine machinery is not needed to name an exception. A read-only command
#: line stays fast this way (tests/acceptance/test_cli_startup.py pins what it imports).
_LAZY = {
    "Classification": "outbox.classify",
    "DispatchSummary": "outbox.dispatch.dispatcher",
    "DispatcherSettings": "outbox.config",
    "Endpoint": "outbox.config",
    "Intent": "outbox.canonical",
    "KeyRing": "outbox.base.keys",
    "Outbox": "outbox.client",
    "RetryPolicy": "outbox.config",
    "StatusLookup": "outbox.config",
    "TenantScope": "outbox.config",
    "create_async_engine": "outbox.store.engine",
    "create_engine": "outbox.store.engine",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'outbox' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "KeyRing",
    "KeyUnavailableError",
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
    "StoreOutcomeUnknown",
    "SystemClock",
    "TenantScope",
    "ValidationError",
    "Verdict",
    "WaitTimeout",
    "__version__",
    "create_async_engine",
    "create_engine",
]
