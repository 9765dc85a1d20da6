"""A TCP proxy between the client and PostgreSQL that breaks connections on cue.

It reads the frontend side of the PostgreSQL wire protocol (startup packets, then
typed messages: one type byte and a length), so it can act at a chosen message rather
than at a chosen moment: deterministic, no sleeps.

* ``arm_commit("forward")``: pass the next ``COMMIT`` to the server, cut the client off
  before the answer reaches it, wait for the server's answer (the COMMIT is applied),
  then close the server side. The client sees a failed COMMIT that took effect.
* ``arm_commit("drop")``: cut both sides instead of passing the ``COMMIT`` on: the
  server sees the client vanish and rolls the transaction back.
* ``cut_on(marker)``: cut the connection whose next message carries ``marker``,
  without passing that message on (a statement that fails mid-flight).
* ``refuse = True``: accept new connections and close them at once.
* ``arm_commit(..., then_isolate=True)``: as above, and from the COMMIT on every other
  connection is cut and new ones refused (the database becomes unreachable).
* ``freeze()`` / ``thaw()``: stop (and resume) forwarding in both directions, sockets
  left open: to the client, a server that stopped answering.
* ``cut_all()``: close every connection now.

Only connections this test opened pass through it; the shared server is never touched.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from sqlalchemy.engine import make_url

_SSL_REQUEST = 80877103
_GSS_REQUEST = 80877104
_CANCEL_REQUEST = 80877102


class _Conn:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.closed = threading.Event()
        #: This transaction sent the COMMIT trigger's statement (``arm_commit(after=)``).
        self.saw_trigger = False

    def close(self) -> None:
        self.closed.set()
        for sock in (self.client, self.server):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with suppress(OSError):
                sock.close()


class PgProxy:
    def __init__(self, upstream: str) -> None:
        url = make_url(upstream)
        self._upstream = (url.host or "127.0.0.1", url.port or 5432)
        self._url = url
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._commit_action: str | None = None
        self._commit_after: bytes | None = None
        self._isolate = False
        self._marker: bytes | None = None
        self._marker_every = False
        #: Set when a message was held back because the proxy is frozen.
        self.holding = threading.Event()
        self.refuse = False
        self._flowing = threading.Event()
        self._flowing.set()
        #: Set when an armed COMMIT was acted on (for "forward": passed on to the server,
        #: the client already cut off).
        self.commit_done = threading.Event()
        self.cut_done = threading.Event()
        self.connections = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._accept, name="pgproxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The upstream URL, aimed at the proxy."""
        return self._url.set(host="127.0.0.1", port=self.port).render_as_string(
            hide_password=False
        )

    # -- controls -------------------------------------------------------------------

    def arm_commit(
        self, action: str, *, then_isolate: bool = False, after: bytes | None = None
    ) -> None:
        """Act on the next COMMIT (with ``after``: of a transaction that sent a message
        containing those bytes); with ``then_isolate``, also cut every other connection
        and refuse new ones from that moment on (the database becomes unreachable)."""
        assert action in ("forward", "drop")
        self.commit_done.clear()
        with self._lock:
            self._commit_action = action
            self._commit_after = after
            self._isolate = then_isolate

    def cut_on(self, marker: bytes, *, every: bool = False) -> None:
        """Cut the connection whose next message carries ``marker`` (once, or every
        time with ``every``)."""
        self.cut_done.clear()
        with self._lock:
            self._marker = marker
            self._marker_every = every

    def freeze(self) -> None:
        self.holding.clear()
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def cut_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    def close(self) -> None:
        self._stopping = True
        self._flowing.set()
        with suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress
        with suppress(OSError):
            self._listener.close()
        self._thread.join(5)
        self.cut_all()

    # -- plumbing -------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refuse:
                client.close()
                continue
            try:
                server = socket.create_connection(self._upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            conn = _Conn(client, server)
            with self._lock:
                self._conns.append(conn)
                self.connections += 1
            threading.Thread(target=self._client_to_server, args=(conn,), daemon=True).start()
            threading.Thread(target=self._server_to_client, args=(conn,), daemon=True).start()

    def _server_to_client(self, conn: _Conn) -> None:
        try:
            while True:
                data = conn.server.recv(65536)
                if not data:
                    break
                if not self._flowing.is_set():
                    self.holding.set()
                self._flowing.wait()
                if conn.closed.is_set():
                    break
                conn.client.sendall(data)
        except OSError:
            pass
        conn.close()

    def _client_to_server(self, conn: _Conn) -> None:
        try:
            for kind, raw in _messages(conn.client):
                if not self._flowing.is_set():
                    self.holding.set()
                self._flowing.wait()
                if conn.closed.is_set():
                    break
                with self._lock:
                    marker, action = self._marker, self._commit_action
                    if marker is not None and marker in raw:
                        if not self._marker_every:
                            self._marker = None
                    else:
                        marker = None
                    is_commit = kind == b"Q" and raw[5:].rstrip(b"\0").strip().upper() == b"COMMIT"
                    after = self._commit_after
                    if after is not None and after in raw:
                        conn.saw_trigger = True
                    if is_commit and action is not None and (after is None or conn.saw_trigger):
                        self._commit_action = None
                    else:
                        action = None
                    if is_commit:
                        conn.saw_trigger = False
                if marker is not None:
                    self.cut_done.set()  # before the cut: the client may react at once
                    conn.close()
                    return
                if action is not None and self._isolate:
                    self.refuse = True
                    with self._lock:
                        others = [c for c in self._conns if c is not conn]
                    for other in others:
                        other.close()
                if action == "drop":
                    self.commit_done.set()
                    conn.close()
                    return
                if action == "forward":
                    self._forward_commit(conn, raw)
                    return
                conn.server.sendall(raw)
        except OSError:
            pass
        conn.close()

    def _forward_commit(self, conn: _Conn, raw: bytes) -> None:
        # The client loses the connection first, so the answer can never reach it.
        conn.closed.set()
        with suppress(OSError):
            conn.client.shutdown(socket.SHUT_RDWR)
        with suppress(OSError):
            conn.client.close()
        conn.server.sendall(raw)
        self.commit_done.set()
        # The server->client pump is still reading the server socket: wait for it to see
        # the answer (CommandComplete + ReadyForQuery) and give up on the gone client.
        conn.server.settimeout(10)
        with suppress(OSError):
            conn.server.shutdown(socket.SHUT_WR)  # then the server closes its side too
        # Wait (bounded) for the server to answer and close; the pump then exits.
        for _ in range(200):
            if conn.server.fileno() < 0 or _closed_by_peer(conn.server):
                break
            time.sleep(0.05)
        conn.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise OSError("closed")
        buf += chunk
    return bytes(buf)


def _messages(sock: socket.socket) -> Iterator[tuple[bytes, bytes]]:
    """(type, raw bytes) of each frontend message; startup packets have type b""."""
    while True:  # untyped start-up packets until the real StartupMessage
        head = _read_exact(sock, 8)
        length, code = struct.unpack("!ii", head)
        raw = head + _read_exact(sock, length - 8)
        yield b"", raw
        if code not in (_SSL_REQUEST, _GSS_REQUEST, _CANCEL_REQUEST):
            break
    while True:
        head = _read_exact(sock, 5)
        (length,) = struct.unpack("!i", head[1:])
        yield head[:1], head + _read_exact(sock, length - 4)


@contextmanager
def pg_proxy(upstream: str) -> Iterator[PgProxy]:
    proxy = PgProxy(upstream)
    try:
        yield proxy
    finally:
        proxy.close()
