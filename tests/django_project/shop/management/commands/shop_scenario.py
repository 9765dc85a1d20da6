"""Scenarios around the outbox on Django's connection; prints what happened."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction

from outbox import OperationConflict, ValidationError
from outbox.contrib.django import get_outbox
from shop.models import Order

RESERVE: dict[str, Any] = {"endpoint": "inventory", "method": "POST", "path": "/reservations"}


class Command(BaseCommand):
    help = "autocommit: enqueue outside atomic(); conflict: a conflict inside atomic()."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("scenario", choices=["autocommit", "conflict", "scheduled"])

    def handle(self, *args: Any, **options: Any) -> None:
        ob = get_outbox()
        if options["scenario"] == "scheduled":
            self._scheduled(ob)
            return
        if options["scenario"] == "autocommit":
            # No atomic(): like save(), each statement commits by itself.
            Order.objects.create(id=20, sku="TEST-BOLT", quantity=1)
            ob.enqueue(**RESERVE, json={"order_id": 20}, operation_id="order-20-reserve")
            self.stdout.write("autocommit done")
            return
        raw = None
        with transaction.atomic():
            Order.objects.create(id=30, sku="TEST-BOLT", quantity=1)
            raw = connection.connection
            try:  # order-17-reserve exists with other arguments
                ob.enqueue(**RESERVE, json={"order_id": 999}, operation_id="order-17-reserve")
            except OperationConflict:
                self.stdout.write("conflict refused")
            else:
                raise CommandError("no OperationConflict")
            # The same DB-API connection, still open, still in Django's transaction:
            # on PostgreSQL a failed statement would have aborted it; this update runs.
            if connection.connection is not raw or not connection.in_atomic_block:
                raise CommandError("Django's connection was replaced or its atomic() ended")
            Order.objects.filter(pk=30).update(status="kept")
        self.stdout.write("conflict done")

    def _scheduled(self, ob: Any) -> None:
        # priority, not_before and deliver_within on Django's connection, inside
        # atomic(); a naive datetime or a deadline that is not positive is refused
        # before anything is written.
        with transaction.atomic():
            Order.objects.create(id=40, sku="TEST-BOLT", quantity=1)
            at = datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)
            ob.enqueue(**RESERVE, json={"order_id": 40}, operation_id="order-40-reserve",
                       priority=5, not_before=at)  # fmt: skip
            try:
                ob.enqueue(**RESERVE, json={"order_id": 41}, operation_id="order-41-reserve",
                           not_before=datetime(2031, 1, 2))  # noqa: DTZ001  # fmt: skip
            except ValidationError:
                self.stdout.write("naive refused")
            ob.enqueue(
                **RESERVE,
                json={"order_id": 42},
                operation_id="order-42-reserve",
                deliver_within=timedelta(hours=2),
            )
            try:
                ob.enqueue(
                    **RESERVE,
                    json={"order_id": 43},
                    operation_id="order-43-reserve",
                    deliver_within=timedelta(0),
                )
            except ValidationError:
                self.stdout.write("no deadline refused")
        self.stdout.write("scheduled done")
