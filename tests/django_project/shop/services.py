"""The shop's use case: an order row and its reservation intent, in one transaction."""

from __future__ import annotations

from django.db import connection, transaction

from outbox.contrib.django import get_outbox
from shop.models import Order


class PaymentDeclined(Exception):
    pass


def place_order(order_id: int, *, fail: bool = False) -> None:
    with transaction.atomic():
        order = Order.objects.create(id=order_id, sku="TEST-BOLT", quantity=2)
        get_outbox().enqueue(
            endpoint="inventory",
            method="POST",
            path="/reservations",
            json={"order_id": order.pk, "sku": order.sku, "quantity": order.quantity},
            operation_id=f"order-{order.pk}-reserve",
        )
        # Django's connection is still Django's, in the same atomic block.
        assert connection.in_atomic_block
        Order.objects.filter(pk=order.pk).update(status="reserving")
        if fail:
            raise PaymentDeclined(f"order {order_id}: card declined")
