"""The public surface: a sorted ``__all__`` that names exactly what users may import.

``outbox.__all__`` is the one list; these tests check it against the package itself
(what a star import gives, what the package defines), never against a second copy.
"""

from __future__ import annotations

import inspect
import types

import outbox


def test_all_is_sorted_without_duplicates() -> None:
    assert outbox.__all__ == sorted(set(outbox.__all__))


def test_a_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from outbox import *", namespace)  # noqa: S102 - the star import users may write
    namespace.pop("__builtins__")
    assert sorted(namespace) == outbox.__all__


def test_nothing_public_is_left_out_of_all() -> None:
    # Every public attribute of the package that is not a submodule must be exported.
    public = {
        name
        for name, value in vars(outbox).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public | {"__version__"} == set(outbox.__all__)


def test_every_exported_class_and_function_is_ours_and_documented() -> None:
    for name in outbox.__all__:
        value = getattr(outbox, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__.startswith("outbox."), (name, value.__module__)
            assert inspect.getdoc(value), f"{name} has no docstring"


def test_errors_form_one_tree() -> None:
    for name in outbox.__all__:
        value = getattr(outbox, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, outbox.OutboxError), name
    assert issubclass(outbox.ValidationError, ValueError)
    assert issubclass(outbox.SchemaError, outbox.StoreError)
    assert issubclass(outbox.NotStoredError, outbox.StoreError)
    # "Unknown" must never be mistaken for "not stored" by an except NotStoredError.
    assert issubclass(outbox.StoreOutcomeUnknown, outbox.StoreError)
    assert not issubclass(outbox.StoreOutcomeUnknown, outbox.NotStoredError)
