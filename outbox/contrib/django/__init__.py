"""Django: enqueue on Django's own connection, atomic with your model writes.

Settings::

    INSTALLED_APPS = [..., "outbox.contrib.django"]
    OUTBOX = {
        "ENDPOINTS": "shop.integrations.endpoints",  # an iterable of Endpoint, or a
                                                     # callable returning one
        "DATABASE": "default",                       # optional: the DATABASES alias
    }

Code::

    from django.db import transaction
    from outbox.contrib.django import get_outbox

    with transaction.atomic():
        order = Order.objects.create(sku="TEST-BOLT")
        get_outbox().enqueue(endpoint="inventory", method="POST", path="/reservations",
                             json={"sku": order.sku}, operation_id=f"order-{order.pk}")

``enqueue`` without ``connection=`` writes on Django's connection of the calling
thread: inside ``atomic()`` it commits or rolls back with it (no ``on_commit`` needed);
outside, it commits at once, like a model's ``save()``. The outbox never commits, rolls
back or closes Django's connection. Reads and the dispatcher use a connection of their
own to the same database.

Schema: ``manage.py migrate`` (this app's migration runs the outbox's own migrations);
``outbox migrate`` against the same database is the same thing. Dispatcher:
``manage.py outbox_dispatch``, or ``outbox --app outbox.contrib.django:outbox_from_settings
dispatch`` with ``DJANGO_SETTINGS_MODULE`` set.
"""

from __future__ import annotations

import threading
from typing import Any

from outbox.client import Outbox
from outbox.config import Endpoint
from outbox.contrib.django.connection import borrowed_engine, database_url
from outbox.errors import ConfigurationError, SchemaError
from outbox.store.commit import BorrowedWrites

__all__ = ["DjangoOutbox", "get_outbox", "outbox_from_settings"]


class DjangoOutbox(Outbox):
    """An :class:`~outbox.Outbox` on a Django database whose own-transaction writes go
    through Django's connection (see the module docstring)."""

    def __init__(self, *, using: str = "default", **kwargs: Any) -> None:
        self.using = using
        kwargs.setdefault("auto_migrate", False)  # the schema is manage.py migrate's
        try:
            super().__init__(database_url(using), **kwargs)
        except SchemaError as exc:
            raise SchemaError(f"{exc} (or manage.py migrate)") from exc
        self.own_writes = BorrowedWrites(lambda: borrowed_engine(using).connect())


_lock = threading.Lock()
_outboxes: dict[tuple[str, str], DjangoOutbox] = {}


def _setting() -> dict[str, Any]:
    from django.conf import settings

    value = getattr(settings, "OUTBOX", {})
    if not isinstance(value, dict):
        raise ConfigurationError("settings.OUTBOX must be a dict")
    return value


def _endpoints(spec: Any) -> list[Endpoint]:
    if isinstance(spec, str):
        from django.utils.module_loading import import_string

        spec = import_string(spec)
    if callable(spec):
        spec = spec()
    endpoints = list(spec or ())
    for endpoint in endpoints:
        if not isinstance(endpoint, Endpoint):
            raise ConfigurationError(f"settings.OUTBOX['ENDPOINTS'] gave {endpoint!r}")
    return endpoints


def get_outbox(using: str | None = None) -> DjangoOutbox:
    """The project's outbox on the ``DATABASES`` alias ``using`` (default: the
    ``OUTBOX['DATABASE']`` setting, else ``"default"``), made on first use."""
    from django.db import connections

    config = _setting()
    alias = using or config.get("DATABASE", "default")
    key = (alias, str(connections[alias].settings_dict["NAME"]))  # test databases differ
    with _lock:
        ob = _outboxes.get(key)
        if ob is None:
            ob = DjangoOutbox(using=alias, endpoints=_endpoints(config.get("ENDPOINTS")))
            _outboxes[key] = ob
    return ob


def outbox_from_settings() -> DjangoOutbox:
    """For the ``outbox`` command line: ``outbox --app
    outbox.contrib.django:outbox_from_settings dispatch`` (``DJANGO_SETTINGS_MODULE``
    set): sets Django up and returns :func:`get_outbox`."""
    import django

    django.setup()
    return get_outbox()
