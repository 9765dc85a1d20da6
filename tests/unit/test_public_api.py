"""The public surface: a sorted ``__all__`` that names exactly what users may import."""

from __future__ import annotations

import importlib
import types

import outbox

PUBLIC_NAMES = [
    "Attempt",
    "Clock",
    "ConcurrentModification",
    "ConfigurationError",
    "Delivery",
    "DispatchSummary",
    "DispatcherSettings",
    "Endpoint",
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
    "StoreError",
    "SystemClock",
    "ValidationError",
    "Verdict",
    "WaitTimeout",
    "__version__",
    "create_engine",
]


def test_all_is_sorted() -> None:
    assert outbox.__all__ == sorted(outbox.__all__)


def test_all_lists_exactly_the_public_names() -> None:
    assert outbox.__all__ == PUBLIC_NAMES


def test_every_exported_name_is_importable() -> None:
    module = importlib.import_module("outbox")
    for name in outbox.__all__:
        assert getattr(module, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from outbox import *", namespace)  # noqa: S102 - the star import users may write
    assert set(PUBLIC_NAMES) <= set(namespace)


def test_nothing_public_is_left_out_of_all() -> None:
    # Every public attribute of the package that is not a submodule must be exported.
    public = {
        name
        for name, value in vars(outbox).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public | {"__version__"} == set(outbox.__all__)


def test_errors_form_one_tree() -> None:
    for name in outbox.__all__:
        value = getattr(outbox, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, outbox.OutboxError), name
    assert issubclass(outbox.ValidationError, ValueError)
    assert issubclass(outbox.SchemaError, outbox.StoreError)
    assert issubclass(outbox.NotStoredError, outbox.StoreError)
