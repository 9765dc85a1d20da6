"""The test receiver's rate-limited mode: in process, through the admin routes of a
spawned receiver, and from its command line."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from outbox.testing.receiver import Receiver, RemoteReceiver


def _post(client: httpx.Client, n: int) -> list[httpx.Response]:
    return [
        client.post("/orders", json={"n": i}, headers={"Idempotency-Key": f"k-{i}"})
        for i in range(n)
    ]


def test_past_its_rate_it_answers_429_before_any_work_and_logs_it() -> None:
    with Receiver() as rx, httpx.Client(base_url=rx.url, timeout=5) as client:
        rx.faults.rate_limit(5, burst=5, headers="ietf")
        answers = _post(client, 12)
        codes = Counter(a.status_code for a in answers)
        assert codes[201] >= 5 and codes[429] >= 1  # the burst, then refusals
        refused = next(a for a in answers if a.status_code == 429)
        assert refused.headers["Retry-After"] == "1"
        assert refused.headers["RateLimit-Policy"] == '"default";q=5;w=1'
        assert refused.headers["RateLimit"].startswith('"default";r=0;t=')
        assert rx.effect_count() == codes[201]  # a refusal applied nothing
        outcomes = Counter(r.outcome for r in rx.requests())
        assert outcomes["rate_limited"] == codes[429]
        rx.faults.clear()  # no limit any more
        assert all(a.status_code == 201 for a in _post(client, 20)[12:])


def test_the_x_ratelimit_fields_and_bad_settings() -> None:
    with Receiver() as rx, httpx.Client(base_url=rx.url, timeout=5) as client:
        rx.faults.rate_limit(2, burst=1, headers="x-ratelimit", retry_after=None)
        first, second = _post(client, 2)
        assert first.status_code == 201 and second.status_code == 429
        assert "Retry-After" not in second.headers
        assert second.headers["X-RateLimit-Limit"] == "2"
        assert second.headers["X-RateLimit-Remaining"] == "0"
        for bad in ({"rate": 0}, {"rate": 1, "burst": 0.5}, {"rate": 1, "headers": "odd"}):
            with pytest.raises(ValueError):
                rx.faults.rate_limit(**bad)  # type: ignore[arg-type]


def test_the_github_fields_carry_an_epoch_reset_on_a_403() -> None:
    with Receiver() as rx, httpx.Client(base_url=rx.url, timeout=5) as client:
        rx.faults.rate_limit(2, burst=1, headers="github", retry_after=None, status=403)
        before = time.time()
        first, second = _post(client, 2)
        assert first.status_code == 201 and second.status_code == 403
        assert "Retry-After" not in second.headers
        assert second.headers["X-RateLimit-Remaining"] == "0"
        assert second.headers["X-RateLimit-Resource"] == "core"
        # The epoch second the budget is back: 1/rate away, rounded up to whole seconds.
        assert before < int(second.headers["X-RateLimit-Reset"]) <= time.time() + 2
        assert rx.effect_count() == 1


def test_it_may_refuse_with_503_as_some_load_balancers_do(tmp_path: Path) -> None:
    with RemoteReceiver.spawn(tmp_path / "rx.sqlite3") as rx:
        rx.faults.rate_limit(3, burst=3, status=503, headers="x-ratelimit")
        with httpx.Client(base_url=rx.url, timeout=5) as client:
            answers = _post(client, 8)
        codes = Counter(a.status_code for a in answers)
        assert codes[201] >= 3 and codes[503] >= 1 and set(codes) == {201, 503}
        refused = next(a for a in answers if a.status_code == 503)
        assert refused.headers["Retry-After"] == "1"
        assert refused.headers["X-RateLimit-Limit"] == "3"
        assert rx.effect_count() == codes[201]
        assert Counter(r.outcome for r in rx.requests())["rate_limited"] == codes[503]
        with pytest.raises(ValueError):
            rx.faults.rate_limit(3, status=500)


def test_a_spawned_receiver_takes_it_through_its_admin_routes(tmp_path: Path) -> None:
    with RemoteReceiver.spawn(tmp_path / "rx.sqlite3") as rx:
        rx.faults.rate_limit(3, burst=3)
        with httpx.Client(base_url=rx.url, timeout=5) as client:
            codes = Counter(a.status_code for a in _post(client, 8))
        assert codes[429] >= 1
        assert Counter(r.outcome for r in rx.requests())["rate_limited"] == codes[429]


def test_the_command_line_starts_it_rate_limited(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "outbox.testing.receiver", "--db", str(tmp_path / "r.db"),
            "--rate-limit", "2", "--rate-limit-burst", "2"]  # fmt: skip
    with subprocess.Popen(argv, stdout=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().decode()
            assert line.startswith("listening ")
            with httpx.Client(base_url=line.split()[1], timeout=5) as client:
                codes = Counter(a.status_code for a in _post(client, 6))
            assert codes[429] >= 1
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    bad = subprocess.run([*argv[:5], "--rate-limit", "-1"], check=False, capture_output=True,
                         text=True)  # fmt: skip
    assert bad.returncode == 2 and "rate must be a positive" in bad.stderr
