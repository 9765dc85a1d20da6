"""The outbox application ``outbox check-receiver --app`` loads for the kit's examples:
its endpoint points at ``RECEIVER_KIT_URL``."""

from __future__ import annotations

import os

from outbox import Outbox
from tests.receiver.support import endpoint


def build() -> Outbox:
    return Outbox(
        os.environ["RECEIVER_KIT_OUTBOX_DB"], endpoints=[endpoint(os.environ["RECEIVER_KIT_URL"])]
    )
