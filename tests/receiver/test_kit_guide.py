"""The guide's pair (docs/guide/owning-both-sides.md) runs as pasted: the service block
under its own interpreter, the app block against it; one reservation, then a replay."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.receiver.support import ROOT, free_port

GUIDE = ROOT / "docs" / "guide" / "owning-both-sides.md"


def _blocks() -> dict[str, str]:
    found = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    return {re.search(r"^# (\S+\.py):", b, re.M).group(1): b for b in found}  # type: ignore[union-attr]


def test_the_guide_pair_runs_as_pasted(tmp_path: Path) -> None:
    blocks = _blocks()
    assert set(blocks) == {"service.py", "app.py"}
    for name, code in blocks.items():
        (tmp_path / name).write_text(code)
    port = free_port()
    env = {**os.environ, "PORT": str(port), "PYTHONPATH": str(ROOT)}
    with (tmp_path / "service.log").open("wb") as log:
        service = subprocess.Popen([sys.executable, "service.py"], cwd=tmp_path, env=env,
                                   stdout=log, stderr=log)  # fmt: skip
    try:
        for _ in range(300):
            try:
                httpx.get(f"http://127.0.0.1:{port}/operations/x", timeout=0.5)
                break
            except httpx.HTTPError:
                assert service.poll() is None, (tmp_path / "service.log").read_text()
                time.sleep(0.1)
        done = subprocess.run([sys.executable, "app.py"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("succeeded"), done.stdout
        again = httpx.post(
            f"http://127.0.0.1:{port}/reservations",
            json={"quantity": 2, "sku": "TEST-BOLT"},
            headers={"Authorization": "Bearer secret-token", "X-Tenant": "acme",
                     "Idempotency-Key": "order-17-reserve"},
        )  # fmt: skip
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        with sqlite3.connect(tmp_path / "service.db") as db:
            assert db.execute("SELECT count(*) FROM reservations").fetchone() == (1,)
    finally:
        service.terminate()
        service.wait(10)
