"""The benchmark harness runs end to end at tiny sizes (it must not rot).

This checks that ``python -m benchmarks run --smoke`` works and writes its JSON report;
it says nothing about speed. PostgreSQL and DBOS parts are skipped by the harness itself,
with the reason in the report, when the server is unreachable or dbos is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(400)
def test_benchmark_smoke_run_writes_a_report(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    out = tmp_path / "smoke.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--smoke", "--output", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "targets:" in proc.stdout
    report = json.loads(out.read_text())

    # A part skipped for want of a server or a package is fine; one that raised is not.
    broken = {k: v for k, v in report["skipped"].items() if str(v).startswith("failed")}
    assert not broken, broken
    measured = report["measurements"]
    for key in (
        "raw_aiohttp",
        "raw_httpx_default",
        "raw_httpx_aiohttp_outbox",
        "dispatch_sqlite",
        "e2e_sqlite",
        "e2e_live_sqlite",
        "e2e_process_sqlite",
        "enqueue_own_sqlite",
        "enqueue_caller_tx_sqlite",
        "bare_insert_tx_sqlite",
        "enqueue_many_sqlite",
    ):
        assert measured[key]["median"] and measured[key]["median"] > 0, key
    if "postgres" not in report["skipped"]:
        assert measured["dispatch_postgres"]["median"] > 0
        assert report["phases"]["multi"]
    assert measured["dbos_sqlite"]["median"] or measured["dbos_sqlite"]["skipped"]

    claim = report["phases"]["claim"]["sqlite"]
    assert {r["mode"] for r in claim} == {"no_stats", "analyzed"}
    assert all(r["ms_per_claim_100"] > 0 and r["plan"] for r in claim)
    rss = report["phases"]["rss"]
    assert rss["drained"] == rss["backlog"] and rss["peak_rss_mb"] > 0

    latency = {r["key"]: r for r in report["phases"]["latency"]}
    expected = {"latency_sqlite", "latency_sqlite_process", "latency_sqlite_poll"}
    if "postgres" not in report["skipped"]:
        expected |= {"latency_postgres", "latency_postgres_poll"}
        assert latency["latency_postgres"]["idle_claims_per_s"] >= 0
        ceiling = report["phases"]["ceiling"]
        assert [r["processes"] for r in ceiling] == [1, 2]
        assert all(r["ops"] == sum(r["per_process_ops"]) > 0 for r in ceiling)
    assert set(latency) == expected
    for row in latency.values():
        assert row["n"] == len(row["values_ms"]) > 0 and row["p50_ms"] <= row["p99_ms"]
    targets = {t["target"] for t in report["targets"]}
    assert any(t.startswith("enqueue -> receiver p50") for t in targets)
