"""The long soak: the CI soak's engine with larger numbers, from one command.

    python -m benchmarks.soak --operations 20000 --kills 200 [--db sqlite|postgres] [--seed N]

Prints the same JSON line as ``tests/soak`` (seed, figures, each check's count) and
exits 0 when every check is zero, 1 otherwise (the work directory is then kept and
printed on stderr). Run from the repository root; PostgreSQL comes from
``--postgres-url`` or ``OUTBOX_TEST_POSTGRES_URL`` (a fresh schema, dropped afterwards).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

from tests.soak.engine import SoakSettings, postgres_schema, run_soak

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--operations", type=int, default=20_000)
    parser.add_argument("--kills", type=int, default=200, help="random SIGKILLs at least")
    parser.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--rate", type=float, default=40.0, help="operations enqueued per second")
    parser.add_argument("--window", type=float, default=15.0, help="retry window, seconds")
    parser.add_argument("--plant", default=None, help="a bug from tests.soak.planted")
    parser.add_argument("--postgres-url", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    produce_seconds = args.operations / args.rate
    settings = SoakSettings(
        db=args.db,
        seed=seed,
        operations=args.operations,
        min_kills=args.kills,
        enqueue_rate=args.rate,
        window_seconds=args.window,
        # Long enough for the kills at ~1 per 2 s, bounded all the same.
        max_chaos_seconds=max(150.0, produce_seconds * 1.5, args.kills * 4.0),
        drain_seconds=max(60.0, args.window * 6),
        plant=args.plant,
    )
    workdir = Path(tempfile.mkdtemp(prefix="outbox-soak-"))
    if args.db == "postgres":
        base = args.postgres_url or os.environ.get("OUTBOX_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
        with postgres_schema(base) as url:
            result = run_soak(settings, workdir, url)
    else:
        result = run_soak(settings, workdir)
    if result.ok and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"work directory: {workdir}", file=sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
