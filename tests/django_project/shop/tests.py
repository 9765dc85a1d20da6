"""The shop's own tests, under Django's test runner (manage.py test shop)."""

from __future__ import annotations

from django.test import TransactionTestCase

from outbox.contrib.django import get_outbox
from shop.models import Order
from shop.services import PaymentDeclined, place_order


class PlaceOrderTests(TransactionTestCase):
    # TransactionTestCase: the outbox reads (find, get, the dispatcher) use a connection
    # of their own, which cannot see rows inside TestCase's never-committed transaction.

    def test_order_and_reservation_commit_together(self) -> None:
        place_order(17)
        self.assertEqual(list(Order.objects.values_list("id", flat=True)), [17])
        op = get_outbox().get("order-17-reserve")
        self.assertEqual(op.state, "pending")
        self.assertEqual(op.body, {"order_id": 17, "sku": "TEST-BOLT", "quantity": 2})

    def test_a_declined_order_leaves_neither(self) -> None:
        with self.assertRaises(PaymentDeclined):
            place_order(18, fail=True)
        self.assertFalse(Order.objects.exists())
        self.assertIsNone(get_outbox().find("order-18-reserve"))
