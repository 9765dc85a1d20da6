"""The receiver kit's examples as real services: a subprocess on a free port, its
database read directly for the effect count (the oracle), a TCP proxy that loses one
response after the service answered, and the outbox Endpoint pointed at it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text
from tenacity import wait_random_exponential

from outbox import Endpoint, RetryPolicy
from outbox.config import StatusLookup

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "orders-app-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """One example receiver process over ``db_url``."""

    def __init__(self, kind: str, db_url: str, log: Path, *, lease_seconds: float = 30.0) -> None:
        self.kind, self.db_url, self.log, self.lease = kind, db_url, log, lease_seconds
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.engine = create_engine(db_url)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        if self.kind == "fastapi":
            script = str(ROOT / "examples" / "receiver_fastapi.py")
        else:
            script = str(ROOT / "examples" / "receiver_django" / "serve.py")
        return [sys.executable, script, "--db", self.db_url, "--port", str(self.port),
                "--lease-seconds", str(self.lease)]  # fmt: skip

    def start(self) -> Service:
        env = {**os.environ, "RECEIVER_EXAMPLE_FAULTS": "1", "PYTHONPATH": str(ROOT)}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=out, cwd=ROOT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"service exited: {self.log.read_text()[-2000:]}")
            with suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            time.sleep(0.05)
        raise AssertionError("service did not listen within 30s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.engine.dispose()

    def effects(self, tenant: str | None = None) -> int:
        """Reservation rows, read from the service's database: the oracle."""
        sql = "SELECT count(*) FROM reservations"
        params: dict[str, str] = {}
        if tenant is not None:
            sql += " WHERE tenant = :t"
            params["t"] = tenant
        with self.engine.connect() as conn:
            return int(conn.execute(text(sql), params).scalar_one())

    def receipt_states(self) -> list[str]:
        with self.engine.connect() as conn:
            rows = conn.execute(text("SELECT state FROM outbox_receipts")).all()
        return [r[0] for r in rows]

    def lease_until_ms(self, key: str) -> int:
        with self.engine.connect() as conn:
            sql = text("SELECT lease_until_ms FROM outbox_receipts WHERE key = :k")
            return int(conn.execute(sql, {"k": key}).scalar_one())

    def post(self, key: str | None, body: object, **headers: str) -> httpx.Response:
        h = dict(HEADERS)
        if key is not None:
            h["Idempotency-Key"] = key
        h.update({k.replace("_", "-"): v for k, v in headers.items()})
        return httpx.post(f"{self.url}/reservations", json=body, headers=h, timeout=30)


def endpoint(base_url: str, *, name: str = "kit", max_attempts: int = 5, timeout: float = 5.0,
             window: float = 30.0) -> Endpoint:  # fmt: skip
    """The outbox's side: the defaults the kit is built to (status lookup included)."""
    return Endpoint(
        name=name,
        base_url=base_url,
        timeout=timeout,
        retry=RetryPolicy(
            max_attempts=max_attempts,
            window=timedelta(seconds=window),
            wait=wait_random_exponential(multiplier=0.05, max=0.2),
        ),
        key_retention=timedelta(hours=24),
        tenant_header="X-Tenant",
        auth=lambda: {"Authorization": f"Bearer {TOKEN}"},
        status_lookup=StatusLookup(),
        probe_safe=True,
    )


class LosingProxy:
    """A TCP proxy to the service; ``lose(n)``: for the next n connections, forward the
    request, read the whole answer, and close the client's socket instead of passing it."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._lose = 0
        self.lost = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lose(self, n: int = 1) -> None:
        with self._lock:
            self._lose = n

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                losing = self._lose > 0
                if losing:
                    self._lose -= 1
            threading.Thread(target=self._serve, args=(client, losing), daemon=True).start()

    def _serve(self, client: socket.socket, losing: bool) -> None:
        server = socket.create_connection(("127.0.0.1", self.upstream))

        def pump(a: socket.socket, b: socket.socket | None) -> None:
            with suppress(OSError):
                while data := a.recv(65536):
                    if b is not None:
                        b.sendall(data)
                    elif losing:
                        # The service answered (it committed): the client never hears it.
                        with self._lock:
                            self.lost += 1
                        client.close()
                        return
            with suppress(OSError):
                (b or client).shutdown(socket.SHUT_WR)

        threading.Thread(target=pump, args=(client, server), daemon=True).start()
        pump(server, None if losing else client)
        with suppress(OSError):
            server.close()
            client.close()

    def close(self) -> None:
        self.sock.close()


@contextmanager
def running(kind: str, db_url: str, log: Path, **kw: float) -> Iterator[Service]:
    svc = Service(kind, db_url, log, **kw).start()
    try:
        yield svc
    finally:
        svc.stop()
