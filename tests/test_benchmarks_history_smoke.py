"""The history benchmarks (``benchmarks.history_dispatch``, ``benchmarks.sustained``) run
end to end at tiny sizes: every variant and interval drains its operations, purge
deletes. They say nothing about speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", *args, "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=220, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(240)
def test_history_dispatch_benchmark_smoke() -> None:
    pytest.importorskip("prometheus_client")
    result = _run("benchmarks.history_dispatch")
    medians = result["median_steady_ops_per_s"]
    assert isinstance(medians, dict)
    assert set(medians) == {
        "empty", "history", "history_metrics", "history_scrape", "history_scrape_cached",
    }  # fmt: skip
    assert all(v > 0 for v in medians.values())


@pytest.mark.timeout(240)
@pytest.mark.postgres
def test_sustained_benchmark_smoke() -> None:
    from tests.conftest import require_postgres

    require_postgres()
    result = _run("benchmarks.sustained", "--vacuum")
    intervals = result["intervals"]
    assert isinstance(intervals, list) and len(intervals) == 3
    assert all(r["ops_per_s"] > 0 and r["claim_ms"]["n"] > 0 for r in intervals)
