from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from shop.services import PaymentDeclined, place_order


class Command(BaseCommand):
    help = "Place an order (and enqueue its reservation); --fail declines it after enqueue."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("order_id", type=int)
        parser.add_argument("--fail", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            place_order(options["order_id"], fail=options["fail"])
        except PaymentDeclined as exc:
            self.stdout.write(f"declined: {exc}")
            return
        self.stdout.write(f"placed {options['order_id']}")
