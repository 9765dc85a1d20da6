"""The hand-written HTTP/1.1 server in front of the service: it owns the sockets, so a
fault can drop a connection after the commit without a byte, or hold it open."""

from __future__ import annotations

import contextlib
import http.client
import socket
import socketserver
import struct
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from outbox.testing.receiver.records import json_bytes
from outbox.testing.receiver.service import Reply, Service
from outbox.testing.receiver.writer import Stopped

_MAX_BODY_BYTES = 16 * 1024 * 1024


class _BadBody(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "outbox-receiver/1"
    server: Server

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.untrack(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the request log lives in SQLite."""

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks: list[bytes] = []
            total = 0
            while True:
                line = self.rfile.readline(65537)
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError as exc:
                    raise _BadBody("bad chunk size") from exc
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                total += size
                if total > _MAX_BODY_BYTES:
                    raise _BadBody("body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline(3)
        length = self.headers.get("Content-Length")
        if not length:
            return b""
        try:
            n = int(length)
        except ValueError as exc:
            raise _BadBody("bad Content-Length") from exc
        if n < 0 or n > _MAX_BODY_BYTES:
            raise _BadBody("bad Content-Length")
        data = self.rfile.read(n)
        if len(data) != n:
            raise ConnectionResetError("client closed mid-body")
        return data

    def _dispatch(self) -> None:
        service = self.server.service
        try:
            try:
                body = self._read_body()
            except _BadBody as exc:
                self.close_connection = True
                reply = service.bad_request(self.command, self.path, self.headers, str(exc))
            else:
                reply = service.handle(self.command, self.path, self.headers, body)
        except Stopped:
            self._abort()
            return
        except Exception as exc:  # answer rather than drop the socket
            detail = {"error": "internal_error", "detail": repr(exc)}
            reply = Reply(500, json_bytes(detail))
        if reply.action == "drop":
            self._abort()
        elif reply.action == "hang":
            self.server.stopping.wait()
            self._abort()
        elif reply.action == "delay" and self.server.stopping.wait(reply.delay_seconds):
            self._abort()
        else:
            self._send(reply)

    def _abort(self) -> None:
        """Close without sending a byte, with a reset rather than a graceful FIN."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def _send(self, reply: Reply) -> None:
        reason = http.client.responses.get(reply.status, "")
        lines = [
            f"HTTP/1.1 {reply.status} {reason}",
            "Content-Type: application/json",
            f"Content-Length: {len(reply.body)}",
        ]
        # Echoed values (X-Request-ID) must not smuggle in header lines.
        lines += [f"{name}: {' '.join(value.splitlines())}" for name, value in reply.headers]
        if self.close_connection:
            lines.append("Connection: close")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", errors="replace")
        self.wfile.write(head if self.command == "HEAD" else head + reply.body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _dispatch


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # 64+ clients connect at once; a backlog of 5 drops SYNs

    def __init__(self, address: tuple[str, int], service: Service) -> None:
        self.service = service
        self.stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the FQDN, which can stall on a slow resolver.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def track(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.add(sock)
            if self.stopping.is_set():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def untrack(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.discard(sock)

    def close_connections(self) -> None:
        with self._conns_lock:
            for sock in self._conns:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client went away or the receiver is stopping
        super().handle_error(request, client_address)
