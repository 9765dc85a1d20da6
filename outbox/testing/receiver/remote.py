"""A receiver in another process: spawned (``python -m outbox.testing.receiver``) or
attached to by URL."""

from __future__ import annotations

import http.client
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Self, TypedDict, Unpack

from outbox.testing.receiver.dialects import dialect_named
from outbox.testing.receiver.faults import Faults, RandomFaults
from outbox.testing.receiver.handle import ReceiverHandle
from outbox.testing.receiver.records import json_bytes
from outbox.testing.receiver.service import ADMIN_PREFIX, Flaw, Synchronous, check_options


class SpawnOptions(TypedDict, total=False):
    """:class:`Receiver`'s options that cross a process boundary (all but ``handler``),
    each a flag of ``python -m outbox.testing.receiver`` of its name: the one list that
    :meth:`RemoteReceiver.spawn` writes as flags and the command reads back."""

    host: str
    port: int
    key_ttl_seconds: float | None
    tenant_header: str
    synchronous: Synchronous
    random_faults: RandomFaults | None
    flaw: Flaw | None
    dialect: str


def spawn_argv(options: SpawnOptions) -> list[str]:
    """The flags that start a receiver process with ``options`` (``port`` aside: it is
    given at each start, to keep the port a restart rebinds)."""
    unknown = sorted(options.keys() - SpawnOptions.__optional_keys__)
    if unknown:
        raise TypeError(f"spawn() got unexpected options: {', '.join(unknown)}")
    # Refused here, as Receiver refuses them, not by the child's argument parser.
    check_options(synchronous=options.get("synchronous", "FULL"), flaw=options.get("flaw"),
                  key_ttl_seconds=options.get("key_ttl_seconds"))  # fmt: skip
    argv: list[str] = []
    for name, value in options.items():
        if name == "port" or value is None:
            continue
        if isinstance(value, RandomFaults):
            argv += value.to_argv()
            continue
        if name == "dialect":
            text = dialect_named(str(value)).name
        else:
            text = value if isinstance(value, str) else repr(value)
        # --name=value: a value that starts with "-" is not read as a flag.
        argv.append(f"--{name.replace('_', '-')}={text}")
    return argv


@dataclass(frozen=True, slots=True)
class _Launch:
    """How a spawned receiver's process is (re)started, and what it owns."""

    argv: list[str]
    startup_timeout_seconds: float
    #: The temporary directory holding its database, deleted by close; None: the caller's.
    tmpdir: str | None


class RemoteReceiver(ReceiverHandle):
    """A receiver in another process: faults go through its admin routes, while effects,
    receipts and the request log are read from its SQLite file directly.

    ``RemoteReceiver(url, db_path)`` attaches to a running receiver;
    :meth:`RemoteReceiver.spawn` (or :meth:`Receiver.spawn`) starts one and returns a
    RemoteReceiver that owns it.
    """

    def __init__(self, url: str, db_path: str | os.PathLike[str]) -> None:
        self._url: str | None = url.rstrip("/")
        self._db_path = Path(db_path)
        self._port = 0
        self._launch: _Launch | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self.faults = Faults(self._submit_fault, self._clear_faults)
        """Fault injection controls, sent to the receiver's admin routes."""

    @classmethod
    def spawn(
        cls,
        db_path: str | os.PathLike[str] | None = None,
        *,
        startup_timeout_seconds: float = 15.0,
        **options: Unpack[SpawnOptions],
    ) -> Self:
        """Run ``python -m outbox.testing.receiver`` in its own process, with the options
        of :class:`Receiver` but ``handler`` (see :class:`SpawnOptions`).

        The returned receiver owns the process (and the temporary database when
        ``db_path`` is None): :meth:`close` ends both.
        """
        argv = spawn_argv(options)
        tmpdir = None
        if db_path is None:
            tmpdir = tempfile.mkdtemp(prefix="outbox-receiver-")
            db_path = Path(tmpdir) / "receiver.db"
        argv = ["--db", os.fspath(db_path), *argv]
        remote = cls("", db_path)
        remote._url, remote._port = None, options.get("port", 0)  # not running until started
        remote._launch = _Launch(argv, startup_timeout_seconds, tmpdir)
        try:
            remote.start()
        except BaseException:
            remote.close()
            raise
        return remote

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` of the receiver."""
        if self._url is None:
            raise RuntimeError("the receiver process is not running")
        return self._url

    @property
    def pid(self) -> int | None:
        """The process id when this object spawned the receiver and it is running."""
        return self._process.pid if self._process is not None else None

    def start(self) -> Self:
        """(Re)start the spawned process on the same database and, if possible, port."""
        launch = self._launch
        if launch is None:
            raise RuntimeError("only a receiver made by spawn can be started")
        if self._process is not None:
            return self
        package_root = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "outbox.testing.receiver", *launch.argv]
        process = subprocess.Popen(
            [*cmd, "--port", str(self._port)], stdout=subprocess.PIPE, env=env
        )
        self._process = process
        line = _read_line(process, launch.startup_timeout_seconds)
        if not line.startswith("listening "):
            self.stop()
            raise RuntimeError(f"the receiver did not start (said {line!r})")
        self._url = line.split(" ", 1)[1].strip()
        self._port = urllib.parse.urlsplit(self._url).port or 0
        return self

    def stop(self) -> None:
        """SIGTERM the spawned process and wait for it (SIGKILL after 10 s)."""
        process = self._process
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def kill(self) -> None:
        """SIGKILL the spawned process (a crash, not a shutdown)."""
        process = self._process
        if process is not None:
            process.kill()
        self.stop()

    def close(self) -> None:
        """Stop a spawned process and delete its temporary database, if any."""
        self.stop()
        launch = self._launch
        if launch is not None and launch.tmpdir is not None:
            shutil.rmtree(launch.tmpdir, ignore_errors=True)
            self._launch = replace(launch, tmpdir=None)

    def _admin(self, method: str, route: str, payload: Any = None) -> Any:
        parts = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
        try:
            body = None if payload is None else json_bytes(payload)
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, ADMIN_PREFIX + route, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        if response.status >= 400:
            raise ValueError(f"receiver admin {route}: {response.status} {data.decode()}")
        return json.loads(data)

    def health(self) -> bool:
        """Whether the receiver answers its health route."""
        try:
            return bool(self._admin("GET", "health")["ok"])
        except (OSError, ValueError, RuntimeError):
            return False

    def _submit_fault(self, spec: dict[str, Any]) -> None:
        self._admin("POST", "faults", spec)

    def _clear_faults(self) -> None:
        self._admin("POST", "faults/clear", {})


def _read_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    stream: IO[bytes] | None = process.stdout
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        return ""
    return stream.readline().decode(errors="replace")
