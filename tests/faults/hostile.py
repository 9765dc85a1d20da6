"""A receiver that answers every request with hostile bytes, chosen by the path.

* ``/bomb``: 200, ``Content-Encoding: gzip``, a small body that inflates to
  ``BOMB_BYTES`` of zeros.
* ``/bomb2``: 200, ``Content-Encoding: gzip, gzip``: the bomb compressed once more
  (a few hundred bytes on the wire).
* ``/huge``: 200, ``Content-Length`` of ``HUGE_BYTES``, sent in full.
* ``/endless``: 200, chunked, chunks until the client goes away.
* ``/drip``: 200, chunked, one byte every 0.2 s forever.
* ``/gzip-json``: 200, a small gzip JSON body (the ordinary case).
* ``/corrupt``: 200, ``Content-Encoding: gzip`` over bytes that are not gzip.
* ``/echo``: 200, a JSON body echoing every request header (also as response headers
  ``X-Echo-<name>`` and as ``X-Request-ID`` the Authorization value), in plain and
  JSON-escaped spellings.

Threaded; every request is counted in ``hits``.
"""

from __future__ import annotations

import gzip
import json
import socket
import socketserver
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import cache

BOMB_BYTES = 256 * 1024 * 1024
HUGE_BYTES = 70 * 1024 * 1024


@cache
def bomb(size: int = BOMB_BYTES) -> bytes:
    """gzip of ``size`` zero bytes, built without holding them."""
    c = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    block = bytes(1024 * 1024)
    parts = [c.compress(block) for _ in range(size // len(block))]
    parts.append(c.flush())
    return b"".join(parts)


@cache
def bomb2() -> bytes:
    """The bomb, gzipped again: ``Content-Encoding: gzip, gzip``."""
    return gzip.compress(bomb(), 9)


def _escaped(value: str) -> str:
    """``value`` as a JSON string body with every character \\u-escaped, '/' as \\/."""
    return "".join("\\/" if ch == "/" else f"\\u{ord(ch):04x}" for ch in value)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        path = lines[0].split(" ")[1].split("?")[0]
        pairs = [line.split(":", 1) for line in lines[1:] if ":" in line]
        headers = [(k.strip(), v.strip()) for k, v in pairs]
        length = int({k.lower(): v for k, v in headers}.get("content-length", "0"))
        while len(rest) < length:
            rest += sock.recv(65536)
        with self.server.lock:
            self.server.hits[path] = self.server.hits.get(path, 0) + 1
        with suppress(OSError):
            self.respond(sock, path, headers)

    def respond(self, sock: socket.socket, path: str, headers: list[tuple[str, str]]) -> None:
        def send(extra: str, body: bytes) -> None:
            sock.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}"
                         "Connection: close\r\n\r\n".encode() + body)  # fmt: skip

        if path == "/bomb":
            send("Content-Encoding: gzip\r\n", bomb())
        elif path == "/bomb2":
            send("Content-Encoding: gzip, gzip\r\n", bomb2())
        elif path == "/gzip-json":
            send("Content-Encoding: gzip\r\nContent-Type: application/json\r\n",
                 gzip.compress(b'{"ok": true, "n": 1}'))  # fmt: skip
        elif path == "/corrupt":
            send("Content-Encoding: gzip\r\n", b"this is not gzip at all" * 10)
        elif path == "/huge":
            sock.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {HUGE_BYTES}\r\n"
                         "Connection: close\r\n\r\n".encode())  # fmt: skip
            block = b"x" * 65536
            for _ in range(HUGE_BYTES // len(block)):
                sock.sendall(block)
        elif path in ("/endless", "/drip"):
            sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                         b"Connection: close\r\n\r\n")  # fmt: skip
            block = b"y" * 65536 if path == "/endless" else b"y"
            frame = f"{len(block):x}\r\n".encode() + block + b"\r\n"
            while not self.server.closing:
                sock.sendall(frame)
                if path == "/drip":
                    time.sleep(0.2)
        elif path == "/echo":
            sent = {k: v for k, v in headers}
            body = {
                "headers": sent,
                "escaped": {k: _escaped(v) for k, v in sent.items()},
            }
            raw = json.dumps(body).encode()
            # Add the \\u-escaped spellings verbatim (json.dumps would re-escape them).
            raw = raw[:-1] + b', "raw_escaped": "' + "|".join(
                _escaped(v) for v in sent.values()).encode() + b'"}'  # fmt: skip
            auth = sent.get("Authorization") or sent.get("authorization") or ""
            extra = "".join(f"X-Echo-{k}: {v}\r\n" for k, v in sent.items())
            send(f"Content-Type: application/json\r\nX-Request-ID: {auth}\r\n{extra}", raw)
        else:
            send("", b"{}")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hits: dict[str, int] = {}
        self.lock = threading.Lock()
        self.closing = False


@contextmanager
def hostile_receiver() -> Iterator[tuple[str, _Server]]:
    bomb2()  # built before the first request, not within its deadline
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.closing = True
        server.shutdown()
        server.server_close()
