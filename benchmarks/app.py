"""The benchmarks' application module for ``outbox dispatch --app benchmarks.app:build``.

Configured from the environment (``OUTBOX_BENCH_DB``, ``OUTBOX_BENCH_RX``,
``OUTBOX_BENCH_CONCURRENCY``, ``OUTBOX_BENCH_TRANSPORT``): the same endpoint and transport
the in-process runs use (:func:`benchmarks.dispatch.make_outbox`).
"""

from __future__ import annotations

import os
from typing import Any


def build() -> Any:
    from benchmarks import transports
    from benchmarks.dispatch import make_outbox

    return make_outbox(
        os.environ["OUTBOX_BENCH_DB"],
        os.environ["OUTBOX_BENCH_RX"],
        int(os.environ.get("OUTBOX_BENCH_CONCURRENCY", "64")),
        transports.CANDIDATES[os.environ["OUTBOX_BENCH_TRANSPORT"]],
    )
