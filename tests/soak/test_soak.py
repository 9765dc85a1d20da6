"""The seeded randomized soak, on SQLite and on PostgreSQL (about two minutes each).

``OUTBOX_SOAK_SEED=N`` replays a run; without it every run draws a new seed and prints
it in its JSON line (``pytest -s`` shows the line; a failure shows it too). The long
soak is the same code: ``python -m benchmarks.soak --operations 20000 --kills 200``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tests.soak.engine import SoakSettings, run_soak


def soak_seed() -> int:
    value = os.environ.get("OUTBOX_SOAK_SEED")
    return int(value) if value else random.SystemRandom().randrange(1, 2**31)


@pytest.mark.soak
@pytest.mark.timeout(400)
@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_soak_holds_every_check(db: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = None if db == "sqlite" else request.getfixturevalue("pg_url")
    settings = SoakSettings(db=db, seed=soak_seed(), operations=1500, min_kills=20)
    result = run_soak(settings, tmp_path / "soak", url)
    line = json.dumps(result.line, sort_keys=True, default=str)
    (tmp_path / "soak.json").write_text(line + "\n")
    assert result.line["acknowledged"] >= 1350, line
    assert result.line["random_kills"] >= 20, line
    assert result.verdict.ok, f"failed checks {result.line['failed_checks']}: {line}"
    assert result.extras_ok, f"extras: {result.line['extras']}: {line}"
