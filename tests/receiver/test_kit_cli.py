"""``outbox check-receiver --strict`` (the installed CLI, in a subprocess) against both
examples, tenants included; and the declared retention it reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from outbox import Outbox
from outbox.checker import CHECKS, check_receiver
from tests.receiver.support import ROOT, endpoint, running

BODY = {"sku": "TEST-BOLT", "quantity": 2}


@pytest.mark.parametrize("kind", ["fastapi", "django"])
def test_cli_check_receiver_strict_passes_every_property(kind: str, tmp_path: Path) -> None:
    with running(kind, f"sqlite:///{tmp_path / 'svc.sqlite3'}", tmp_path / "svc.log") as svc:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RECEIVER_KIT_URL": svc.url,
            "RECEIVER_KIT_OUTBOX_DB": f"sqlite:///{tmp_path / 'app.sqlite3'}",
        }
        done = subprocess.run(
            [sys.executable, "-m", "outbox", "check-receiver", "--app",
             "tests.receiver.kit_app:build", "--endpoint", "kit", "--path", "/reservations",
             "--json-body", json.dumps(BODY), "--retention-delay", "0.5", "--strict", "--json"],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, (done.stdout, done.stderr)
        report = json.loads(done.stdout)
        assert [v["name"] for v in report["verdicts"]] == list(CHECKS)
        assert all(v["passed"] is True for v in report["verdicts"]), report
        assert "tenants_kept_apart" in CHECKS


def test_check_receiver_reads_the_declared_retention(tmp_path: Path) -> None:
    with running("fastapi", f"sqlite:///{tmp_path / 'svc.sqlite3'}", tmp_path / "svc.log") as svc:
        longer = replace(endpoint(svc.url), key_retention=timedelta(hours=48))
        ob = Outbox(f"sqlite:///{tmp_path / 'app.sqlite3'}", endpoints=[longer])
        try:
            report = check_receiver(ob, endpoint="kit", method="POST", path="/reservations",
                                    json_body=BODY, retention_delay=0.1)  # fmt: skip
        finally:
            ob.close()
        verdict = next(v for v in report.verdicts if v.name == "key_retained")
        assert verdict.passed is False
        assert "Idempotency-Key-Retention" in verdict.summary
        assert verdict.evidence["declared_retention_seconds"] == 86400
