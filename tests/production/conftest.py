"""A real pgbouncer (Debian's package) in front of the shared PostgreSQL server, started
once per test session; each test gets its own schema and a role whose ``search_path``
is that schema (pgbouncer refuses the ``options`` startup parameter the other tests use
for their schema, so the role carries it: it applies at every server login, whatever
the pool).

Databases: ``tx`` (transaction pooling) and ``session`` (session pooling); a second
pgbouncer with ``max_prepared_statements`` when the installed one has it (1.21+).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.conftest import POSTGRES_URL, require_postgres

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pgbouncer_version() -> tuple[int, int]:
    out = subprocess.run(
        [PGBOUNCER, "--version"], capture_output=True, text=True, check=False
    ).stdout
    m = re.search(r"PgBouncer (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@dataclass
class Bouncer:
    port: int
    directory: Path
    process: subprocess.Popen[bytes]

    target: str

    def url(self, database: str, user: str) -> str:
        return f"postgresql+psycopg://{user}@127.0.0.1:{self.port}/{database}"

    def add(self, name: str, user: str, pool_mode: str) -> None:
        """A database alias that logs in as ``user`` (auth_type any forces one), then a
        reload; returns once pgbouncer serves it."""
        ini = self.directory / "pgbouncer.ini"
        head, tail = ini.read_text().split("[pgbouncer]\n", 1)
        head += f"{name} = {self.target} user={user} pool_mode={pool_mode}\n"
        ini.write_text(head + "[pgbouncer]\n" + tail)
        self.process.send_signal(signal.SIGHUP)
        import psycopg

        deadline = time.monotonic() + 10
        while True:
            try:
                psycopg.connect(host="127.0.0.1", port=self.port, dbname=name, user=user).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def log(self) -> str:
        return (self.directory / "pgbouncer.log").read_text(errors="replace")


def _start(
    directory: Path, extra: str = "", ignore: str = "extra_float_digits,options"
) -> Bouncer:
    directory.mkdir(parents=True, exist_ok=True)
    server = make_url(POSTGRES_URL)
    port = free_port()
    host, pg_port = server.host or "127.0.0.1", server.port or 5432
    target = f"host={host} port={pg_port} dbname={server.database}"
    (directory / "pgbouncer.ini").write_text(
        "[databases]\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\n"
        f"unix_socket_dir = {directory}\n"
        "auth_type = any\n"
        f"logfile = {directory / 'pgbouncer.log'}\n"
        f"pidfile = {directory / 'pgbouncer.pid'}\n"
        "pool_mode = transaction\n"
        "default_pool_size = 10\nmax_client_conn = 200\n"
        # psycopg sends none of these; a driver that does must not be refused.
        f"ignore_startup_parameters = {ignore}\n"
        "server_reset_query = DISCARD ALL\n"
        f"{extra}"
    )
    if shutil.which("pgbouncer") is None and not Path(PGBOUNCER).exists():
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    command = [PGBOUNCER, str(directory / "pgbouncer.ini")]
    if os.geteuid() == 0:  # pgbouncer refuses to run as root: as postgres, like the server
        shutil.chown(directory, "postgres")
        command[1:1] = ["-u", "postgres"]
    with open(directory / "stderr.log", "wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return Bouncer(port, directory, process, target)
        except OSError:
            if process.poll() is not None:
                break
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"pgbouncer did not start: {(directory / 'stderr.log').read_text()}")


@pytest.fixture(scope="session")
def bouncers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Bouncer]]:
    """{"plain": pgbouncer, "prepared": pgbouncer with max_prepared_statements (if any)}."""
    require_postgres()
    # Not under pytest's tmp dir: that is private to this user, and pgbouncer may run as
    # postgres (see _start).
    root = Path(tempfile.mkdtemp(prefix="outbox-pgbouncer-"))
    os.chmod(root, 0o755)  # noqa: S103 (postgres must reach its dir)
    started = {
        "plain": _start(root / "plain"),
        # pgbouncer's default: the options startup parameter is refused.
        "strict": _start(root / "strict", ignore="extra_float_digits"),
    }
    if pgbouncer_version() >= (1, 21):
        started["prepared"] = _start(root / "prepared", "max_prepared_statements = 100\n")
    try:
        yield started
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for b in started.values():
            b.process.terminate()
            try:
                b.process.wait(10)
            except subprocess.TimeoutExpired:
                b.process.kill()


@dataclass
class Place:
    """One test's schema: the URL through pgbouncer and the direct one."""

    schema: str
    pooled: str
    direct: str
    bouncer: Bouncer


MODES = ["transaction", "session", "transaction+prepared"]


@pytest.fixture(params=MODES)
def place(request: pytest.FixtureRequest, bouncers: dict[str, Bouncer]) -> Iterator[Place]:
    mode: str = request.param
    if mode.endswith("+prepared"):
        if "prepared" not in bouncers:
            pytest.skip(f"pgbouncer {pgbouncer_version()} has no max_prepared_statements")
        bouncer = bouncers["prepared"]
    else:
        bouncer = bouncers["plain"]
    schema = f"pgb_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{schema}" LOGIN'))
        conn.execute(text(f'CREATE SCHEMA "{schema}" AUTHORIZATION "{schema}"'))
        conn.execute(text(f'ALTER ROLE "{schema}" SET search_path = "{schema}"'))
    database = f"{schema}_{'session' if mode == 'session' else 'tx'}"
    bouncer.add(database, schema, "session" if mode == "session" else "transaction")
    direct = make_url(POSTGRES_URL).set(username=schema)
    try:
        yield Place(
            schema,
            bouncer.url(database, schema),
            direct.render_as_string(hide_password=False),
            bouncer,
        )
    finally:
        with admin.begin() as conn:
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :u"),
                {"u": schema},
            )
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            conn.execute(text(f'DROP ROLE "{schema}"'))
        admin.dispose()
