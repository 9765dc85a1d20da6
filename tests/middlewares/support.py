"""Serve a middleware receiver with uvicorn in its own process, behind a TCP proxy that
can lose one response after the receiver has answered (so after it committed)."""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


class DroppingProxy:
    """Forwards TCP to ``upstream``. ``drop_next_response()`` makes the next response
    that comes back be read whole from the receiver and then thrown away, both
    connections closed: the receiver did the work, the client never hears of it."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._armed = threading.Event()
        self._closing = False
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._start(self._accept)

    def drop_next_response(self) -> None:
        self._armed.set()

    def _start(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._upstream)
            self._track(client)
            self._track(upstream)
            self._start(self._pump, client, upstream, False)
            self._start(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, responses: bool) -> None:
        buffered = b""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if responses and (buffered or self._armed.is_set()):
                    self._armed.clear()
                    buffered += data
                    if _complete(buffered):
                        break  # read whole, never forwarded
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def close(self) -> None:
        self._closing = True
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        for thread in self._threads:
            thread.join(timeout=5)


def _complete(response: bytes) -> bool:
    head, sep, body = response.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
        if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
            return body.endswith(b"0\r\n\r\n")
    return False


@dataclass
class Served:
    """A middleware receiver: its URL (through the proxy), the proxy and its effects."""

    url: str
    proxy: DroppingProxy
    effects_path: Path

    def effects(self) -> list[tuple[str, str]]:
        """(key, body) of every effect, read from the handler's own store."""
        if not self.effects_path.exists():
            return []
        conn = sqlite3.connect(self.effects_path, timeout=10)
        try:
            return [(k, b) for k, b in conn.execute("SELECT key, body FROM effects ORDER BY id")]
        except sqlite3.OperationalError:
            return []
        finally:
            conn.close()


@contextlib.contextmanager
def serve(factory: str, tmp_path: Path) -> Iterator[Served]:
    """Run ``uvicorn --factory tests.middlewares.apps:<factory>`` on a socket we bound."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    effects = tmp_path / f"effects-{factory}.sqlite3"
    log = (tmp_path / f"uvicorn-{factory}.log").open("wb")
    env = {**os.environ, "OUTBOX_MW_EFFECTS": str(effects), "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", f"tests.middlewares.apps:{factory}",
         "--fd", str(listener.fileno()), "--log-level", "warning", "--no-access-log"],
        cwd=ROOT, env=env, pass_fds=(listener.fileno(),), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    listener.close()
    proxy = DroppingProxy(port)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{factory} did not start: "
                        + (tmp_path / f"uvicorn-{factory}.log").read_text()
                    ) from None
                time.sleep(0.1)
        yield Served(f"http://127.0.0.1:{proxy.port}", proxy, effects)
    finally:
        proxy.close()
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
