"""Helpers for the fault catalogue: dispatcher subprocesses and bounded polling."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from tenacity import wait_random_exponential

from outbox import Endpoint, Outbox, RetryPolicy
from outbox.dispatch import failpoints

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class Events(logging.Handler):
    """The outbox library's log events (stdlib records under ``outbox``) as dicts with
    their ``level``, collected from every thread while the block runs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[dict[str, Any]] = []
        self._lock2 = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(getattr(record, "outbox", None) or {"event": record.getMessage()})
        fields["level"] = record.levelname.lower()
        with self._lock2:
            self.records.append(fields)

    def named(self, event: str) -> list[dict[str, Any]]:
        with self._lock2:
            return [r for r in self.records if r.get("event") == event]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with self._lock2:
            return iter(list(self.records))


@contextmanager
def outbox_events() -> Iterator[Events]:
    root = logging.getLogger("outbox")
    handler = Events()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)


def until(predicate: Callable[[], T], timeout: float, what: str, poll: float = 0.05) -> T:
    """Poll until ``predicate()`` is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def app_endpoint(receiver_url: str, *, timeout: float = 2.0, window: float = 60.0) -> Endpoint:
    """The endpoint ``tests.support.dispatch_app`` registers, for the test's own Outbox."""
    return Endpoint(
        name="receiver",
        base_url=receiver_url,
        timeout=timeout,
        retry=RetryPolicy(
            max_attempts=5,
            window=timedelta(seconds=window),
            wait=wait_random_exponential(multiplier=0.1, max=0.5),
        ),
        key_retention=timedelta(hours=1),
        tenant_header="X-Tenant",
    )


class DispatcherProcess:
    """``outbox --app tests.support.dispatch_app:outbox dispatch`` in a subprocess."""

    def __init__(
        self,
        db_url: str,
        receiver_url: str,
        log_dir: Path,
        *,
        name: str,
        failpoint_spec: str = "",
        lease: float = 3.0,
        timeout: float = 2.0,
        window: float = 60.0,
        concurrency: int = 16,
        failpoints_enabled: bool = True,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.out = log_dir / f"{name}.out"
        env = dict(os.environ)
        env.update(
            {
                "OUTBOX_TEST_DB": db_url,
                "OUTBOX_TEST_RECEIVER_URL": receiver_url,
                "OUTBOX_TEST_LEASE": str(lease),
                "OUTBOX_TEST_TIMEOUT": str(timeout),
                "OUTBOX_TEST_WINDOW": str(window),
                "OUTBOX_TEST_CONCURRENCY": str(concurrency),
                failpoints.ENV: failpoint_spec,
                failpoints.ENABLE_ENV: failpoints.ENABLE_VALUE if failpoints_enabled else "",
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
            }
        )
        env.update(extra_env or {})
        argv = [sys.executable, "-m", "outbox.cli", "--app", "tests.support.dispatch_app:outbox",
                "--log-format", "json", "dispatch", "--json"]  # fmt: skip
        self._stderr = self.log.open("wb")
        self._stdout = self.out.open("wb")
        self.process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=self._stdout, stderr=self._stderr,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def events(self) -> list[dict[str, Any]]:
        records = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def saw(self, event: str) -> bool:
        return any(r.get("event") == event for r in self.events())

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 20.0) -> dict[str, Any] | None:
        """SIGTERM (graceful drain), then the summary it printed, if any."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close()
        text = self.out.read_text(errors="replace").strip()
        try:
            summary = json.loads(text) if text else None
        except ValueError:
            return None
        return summary if isinstance(summary, dict) else None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._close()

    def _close(self) -> None:
        self._stderr.close()
        self._stdout.close()


@contextmanager
def dispatchers(log_dir: Path) -> Iterator[Callable[..., DispatcherProcess]]:
    """Start dispatcher subprocesses; every one is killed when the block ends."""
    started: list[DispatcherProcess] = []

    def start(db_url: str, receiver_url: str, **kwargs: Any) -> DispatcherProcess:
        d = DispatcherProcess(db_url, receiver_url, log_dir, **kwargs)
        started.append(d)
        return d

    try:
        yield start
    finally:
        for d in started:
            d.kill()


def open_outbox(db_url: str, receiver_url: str, **endpoint: Any) -> Outbox:
    return Outbox(db_url, endpoints=[app_endpoint(receiver_url, **endpoint)])


class Hold:
    """Holds the dispatcher running in thread ``name`` at a failpoint until released."""

    def __init__(self, point: str, thread_name: str = "dispatcher-A") -> None:
        self.point, self.thread_name = point, thread_name
        self.reached = threading.Event()
        self.release = threading.Event()
        self.hook: Callable[[], None] | None = None

    async def __call__(self, name: str) -> None:
        if threading.current_thread().name != self.thread_name:
            return
        if self.hook is not None:
            self.hook()
        self.reached.set()
        await asyncio.to_thread(self.release.wait, 30)

    def __enter__(self) -> Hold:
        failpoints.register(self.point, self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        failpoints.clear(self.point)


def terminate_backends(admin_url: str, application_name: str) -> int:
    """pg_terminate_backend on the connections opened under ``application_name`` (this
    test's own: the server is shared), from a separate admin connection; how many."""
    from sqlalchemy import create_engine, text

    engine = create_engine(admin_url)
    try:
        with engine.begin() as conn:
            return len(conn.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = :name AND pid <> pg_backend_pid()"),
                {"name": application_name}).all())  # fmt: skip
    finally:
        engine.dispose()
