"""``manage.py outbox_dispatch``: the outbox dispatcher on the project's database."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand

from outbox.contrib.django import get_outbox


class Command(BaseCommand):
    help = (
        "Send the outbox's due operations. SIGTERM or Ctrl-C: stop claiming, finish "
        "the requests in flight, exit 0."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--once", action="store_true", help="Claim and send one batch.")
        parser.add_argument("--concurrency", type=int, default=None)
        parser.add_argument("--database", default=None, help="The DATABASES alias.")

    def handle(self, *args: Any, **options: Any) -> None:
        ob = get_outbox(options["database"])
        if not ob.endpoints:
            self.stderr.write("settings.OUTBOX['ENDPOINTS'] names no endpoint: nothing to send")
            raise SystemExit(2)
        if options["once"]:
            summary = ob.dispatch_once()
        else:
            summary = ob.run_dispatcher(concurrency=options["concurrency"])
        self.stdout.write(json.dumps(summary.as_dict(), sort_keys=True))
