"""Running the console: bind checks, credentials, and uvicorn."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from outbox.console.auth import TOKEN_ENV, Credentials
from outbox.console.routes import create_app
from outbox.errors import ConfigurationError

if TYPE_CHECKING:
    from outbox.client import Outbox

LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1", "[::1]"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, allow_remote: bool, credentials: Credentials | None) -> None:
    """Refuse a bind other machines can reach unless asked for and authenticated by a
    configured (not generated) credential."""
    if is_loopback(host):
        return
    if not allow_remote:
        raise ConfigurationError(
            f"refusing to listen on {host}: other machines could reach the console; "
            "pass --allow-remote (with --token-file or " + TOKEN_ENV + ") to mean it"
        )
    if credentials is None:
        raise ConfigurationError(
            f"refusing to listen on {host} without a configured credential: "
            f"pass --token-file or set {TOKEN_ENV}"
        )


def open_existing(db: str) -> Outbox:
    """An Outbox on a database that already holds the schema (never creates one)."""
    from pathlib import Path

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from outbox.client import Outbox

    try:
        url = make_url(db)
    except ArgumentError as exc:
        raise ConfigurationError(f"--db is not a database URL: {exc}") from None
    database = url.database
    is_file_db = url.get_backend_name() == "sqlite" and database not in (None, "", ":memory:")
    if is_file_db and not Path(str(database)).is_file():
        raise ConfigurationError(f"no SQLite database at {database}")
    return Outbox(db, auto_migrate=False)


def serve(
    outbox: Outbox,
    *,
    host: str,
    port: int,
    credentials: Credentials,
    read_only: bool,
    echo: Callable[[str], None],
    allowed_hosts: list[str] | None = None,
) -> None:
    import uvicorn

    if allowed_hosts is None and is_loopback(host):
        allowed_hosts = LOOPBACK_HOSTS
    app = create_app(outbox, credentials, read_only=read_only, allowed_hosts=allowed_hosts)
    shown = f"[{host}]" if ":" in host else host
    # Bound here, before anything is printed: a port in use is one line and exit 2, not
    # an address and a token for a server that never started.
    sock = _listening_socket(host, port, shown)
    port = sock.getsockname()[1]
    echo(f"outbox console on http://{shown}:{port}/ ({'read-only' if read_only else 'read-write'})")
    if credentials.generated:
        entry = credentials.entries[0]
        echo(f"sign-in token for {entry.name} (shown once, valid until this process exits):")
        echo(f"  {entry.token}")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        server_header=False,
        proxy_headers=True,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


def _listening_socket(host: str, port: int, shown: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = exc.strerror or type(exc).__name__
        raise ConfigurationError(f"the console cannot listen on {shown}:{port}: {why}") from None
    return sock
