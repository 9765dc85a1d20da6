"""Hostile peers for the security tests: a receiver that echoes what it was sent, and a
listener that only counts connections (the "other host" a row must never reach)."""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog

from outbox.base import logs

#: (status, body bytes) for a request: method, path, headers.
Responder = Callable[[str, str, dict[str, str]], tuple[int, bytes]]


def echo_headers(status: int) -> Responder:
    """Answer ``status`` with a JSON body echoing every request header (httpbin-style)."""

    def respond(method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        return status, json.dumps({"you_sent": headers, "path": path}).encode()

    return respond


class EchoServer:
    """A tiny HTTP server answering by ``responder``; it records what it received."""

    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        self.received: list[tuple[str, str, dict[str, str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                outer.received.append((self.command, self.path, headers))
                status, body = outer.responder(self.command, self.path, headers)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> EchoServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


class ConnectionCounter:
    """Accepts TCP connections, counts them, closes them: any contact at all shows."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.accepted = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def __enter__(self) -> ConnectionCounter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()


@contextmanager
def rendered_logs(monkeypatch: Any, level: str = "debug") -> Iterator[io.StringIO]:
    """The CLI's real structlog processor chain (JSON lines), rendered into a buffer
    that stands in for stderr. ``capture_logs()`` would skip the renderer: no proof."""
    buffer = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buffer)
    logs.configure(level, "json")
    try:
        yield buffer
    finally:
        structlog.reset_defaults()
