"""The Django app: add ``"outbox.contrib.django"`` to ``INSTALLED_APPS``."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    name = "outbox.contrib.django"
    label = "outbox"
    verbose_name = "Operation outbox"
