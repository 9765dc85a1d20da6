"""A small service on the kit for ``outbox demo --receiver kit``: ``POST /reservations``
with receipts (the plain function API, the standard library's threaded HTTP server) and
``GET /operations/{key}``, its effects counted in its own SQLite file.

``lose_answer(key, times)`` makes the next ``times`` requests with that key commit and then drop the
connection without answering: a lost response after the effect.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Connection, Integer, MetaData, String, Table, func, select

from outbox.receiver.answers import Reply
from outbox.receiver.kit import Receipts, Request
from outbox.receiver.store import Scope

_md = MetaData()
reservations = Table(
    "reservations",
    _md,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key", String(255), nullable=False),
    Column("body", String(2000), nullable=False),
)


class KitService:
    """The kit behind a real local HTTP server (127.0.0.1, a free port)."""

    def __init__(self, db_path: Path) -> None:
        from outbox.store.engine import create_engine

        self.engine = create_engine(f"sqlite:///{db_path}")
        self.receipts = Receipts(self.engine)
        self.receipts.migrate()
        _md.create_all(self.engine)
        self._lose: dict[str, int] = {}
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> KitService:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.engine.dispose()

    def lose_answer(self, key: str, times: int = 1) -> None:
        with self._lock:
            self._lose[key] = times

    def _take_loss(self, key: str | None) -> bool:
        with self._lock:
            left = self._lose.get(key or "", 0)
            if left <= 0:
                return False
            self._lose[key or ""] = left - 1
            return True

    def effect_count(self, key: str) -> int:
        with self.engine.connect() as conn:
            stmt = select(func.count()).where(reservations.c.key == key)
            return int(conn.execute(stmt).scalar_one())

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, reply: Reply) -> None:
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def do_GET(self) -> None:
                prefix = "/operations/"
                if not self.path.startswith(prefix):
                    self._send(Reply(404))
                    return
                from urllib.parse import unquote

                key = unquote(self.path[len(prefix) :])
                self._send(service.receipts.status("", "demo", key))

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path != "/reservations":
                    self._send(Reply(404))
                    return
                key = self.headers.get(service.receipts.key_header)

                def reserve(conn: Connection) -> Reply:
                    conn.execute(reservations.insert().values(key=key or "", body=body.decode()))
                    n = conn.execute(select(func.count()).select_from(reservations)).scalar_one()
                    out = json.dumps({"reservation_id": n}).encode()
                    return Reply(201, {"content-type": "application/json"}, out)

                request = Request("POST", "/reservations", body, self.headers.get("content-type"))
                reply = service.receipts.handle(
                    Scope("", "demo", "POST", "/reservations"),
                    key,
                    request,
                    reserve,
                    request_id=self.headers.get(service.receipts.request_id_header),
                )
                if service._take_loss(key):  # committed; the answer never leaves
                    self.close_connection = True
                    self.connection.close()
                    return
                self._send(reply)

        return Handler


__all__ = ["KitService", "reservations"]
