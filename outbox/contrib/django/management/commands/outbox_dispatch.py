"""``manage.py outbox_dispatch``: the outbox dispatcher on the project's database."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from outbox.contrib.django import get_outbox
from outbox.errors import ConfigurationError, OutboxError, StoreError


class Command(BaseCommand):
    help = (
        "Send the outbox's due operations. SIGTERM or Ctrl-C: stop claiming, finish "
        "the requests in flight, exit 0."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--once", action="store_true", help="Claim and send one batch.")
        parser.add_argument("--concurrency", type=int, default=None)
        parser.add_argument("--database", default=None, help="The DATABASES alias.")
        parser.add_argument(
            "--json", action="store_true", help="The summary as JSON (as `outbox dispatch`)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            ob = get_outbox(options["database"])
            if not ob.endpoints:
                raise ConfigurationError(
                    "settings.OUTBOX['ENDPOINTS'] names no endpoint: nothing could be sent"
                )
            if options["once"]:
                summary = ob.dispatch_once()
            else:
                summary = ob.run_dispatcher(concurrency=options["concurrency"])
        except OutboxError as exc:
            # One line and the outbox command line's exit codes: 3 the database, 2 usage.
            code = 3 if isinstance(exc, StoreError) else 2
            raise CommandError(str(exc), returncode=code) from exc
        # The summary in the words of `outbox dispatch`: key=value, or JSON with --json.
        data = summary.as_dict()
        if options["json"]:
            self.stdout.write(json.dumps(data, sort_keys=True))
        else:
            self.stdout.write(" ".join(f"{k}={v}" for k, v in data.items()))
