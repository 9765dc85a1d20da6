"""The observability benchmark (``python -m benchmarks.observability``) runs end to end at
tiny sizes: every variant drains its operations. It says nothing about speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_observability_benchmark_smoke() -> None:
    pytest.importorskip("aiohttp")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.observability", "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=220, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["median_ops_per_s"]) == {
        "baseline", "logging_info", "metrics", "tracing", "metrics_tracing",
    }  # fmt: skip
    assert all(v > 0 for v in result["median_ops_per_s"].values())
