"""``python -m outbox.testing.receiver``: serve a receiver until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence
from dataclasses import fields
from types import FrameType
from typing import cast

from outbox.testing.receiver.dialects import DIALECTS
from outbox.testing.receiver.faults import RandomFaults
from outbox.testing.receiver.inprocess import Receiver
from outbox.testing.receiver.ratelimit import HEADER_STYLES, REFUSAL_STATUSES, RateLimitSpec
from outbox.testing.receiver.remote import SpawnOptions
from outbox.testing.receiver.service import FLAWS, SYNC_LEVELS


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m outbox.testing.receiver``: serve until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m outbox.testing.receiver",
        description="A local HTTP receiver with idempotency receipts and fault injection.",
    )
    parser.add_argument("--db", required=True, help="SQLite file (created if missing)")
    # The SpawnOptions flags: left out, Receiver's own default holds (one place for it).
    unset = argparse.SUPPRESS
    parser.add_argument("--host", default=unset, help="default 127.0.0.1")
    parser.add_argument("--port", type=int, default=unset, help="default 0: a free port")
    parser.add_argument(
        "--key-ttl-seconds", "--key-ttl", type=float, default=unset, help="forget keys after S s"
    )
    parser.add_argument("--tenant-header", default=unset, help="default X-Tenant")
    parser.add_argument("--synchronous", default=unset, choices=SYNC_LEVELS, help="default FULL")
    parser.add_argument("--flaw", default=unset, choices=FLAWS, help="be wrong in this way")
    parser.add_argument("--dialect", default=unset, choices=sorted(DIALECTS), help="default ietf")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random faults")
    # Every probability of RandomFaults, flagged as its to_argv() writes it.
    for f in fields(RandomFaults):
        if f.name.startswith("p_"):
            parser.add_argument(
                "--" + f.name.replace("_", "-"), type=float, default=0.0, metavar="P"
            )
    parser.add_argument("--delay-seconds", type=float, default=2.0)
    parser.add_argument("--retry-after", default="1", help="Retry-After of random 503s")
    parser.add_argument(
        "--rate-limit",
        type=float,
        default=None,
        metavar="R",
        help="admit R requests/s in all, answer the rest 429",
    )
    parser.add_argument(
        "--rate-limit-burst",
        type=float,
        default=None,
        metavar="B",
        help="tokens banked at most (default: one second's worth)",
    )
    parser.add_argument(
        "--rate-limit-headers",
        default="none",
        choices=HEADER_STYLES,
        help="rate-limit fields a 429 carries besides Retry-After",
    )
    parser.add_argument(
        "--rate-limit-retry-after", default="1", help="Retry-After of a 429 ('' sends none)"
    )
    parser.add_argument(
        "--rate-limit-status",
        type=int,
        default=429,
        choices=REFUSAL_STATUSES,
        help="the status of a refusal beyond the rate (429, 503, or 403 as GitHub's)",
    )
    args = parser.parse_args(argv)
    limit = None
    if args.rate_limit is not None:
        try:
            limit = RateLimitSpec(
                args.rate_limit,
                args.rate_limit_burst,
                args.rate_limit_retry_after or None,
                args.rate_limit_headers,
                args.rate_limit_status,
            )
        except ValueError as exc:
            parser.error(str(exc))

    # Each RandomFaults field has a flag of its name; an empty --retry-after sends none.
    settings = {f.name: getattr(args, f.name) for f in fields(RandomFaults)}
    random_faults = RandomFaults(**{**settings, "retry_after": args.retry_after or None})
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Every SpawnOptions name is a flag of its name (spawn_argv writes them).
    values = {**vars(args), "random_faults": random_faults}
    options = {name: values[name] for name in SpawnOptions.__optional_keys__ if name in values}
    try:
        receiver = Receiver(args.db, **cast(SpawnOptions, options))
    except ValueError as exc:
        print(f"refused: {exc}", flush=True)  # the first line RemoteReceiver.spawn reads
        return 2
    with receiver as rx:
        if limit is not None:
            rx.faults.rate_limit(limit.rate, burst=limit.burst, retry_after=limit.retry_after,
                                 headers=limit.headers)  # fmt: skip
        print(f"listening {rx.url}", flush=True)
        while not stop.wait(0.2):
            pass
    return 0
