"""``outbox console`` as a real subprocess on a free port of 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

OUTBOX_SCRIPT = Path(sys.executable).with_name("outbox")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ConsoleProcess:
    proc: subprocess.Popen[str]
    url: str
    lines: list[str] = field(default_factory=list)

    def token(self) -> str:
        """The generated token: the line after the one announcing it (printed before
        the server answers; the reader thread may still be catching up)."""
        while True:
            lines = list(self.lines)
            for i, line in enumerate(lines):
                if line.startswith("sign-in token for") and i + 1 < len(lines):
                    return lines[i + 1].strip()
            if self.proc.poll() is not None:
                raise AssertionError(f"no token printed: {lines}")
            time.sleep(0.05)


@contextmanager
def console_process(
    *args: str, options: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Iterator[ConsoleProcess]:
    """Start ``outbox ARGS console --port P OPTIONS`` and wait until it answers."""
    port = free_port()
    full_env = {**os.environ, **(env or {})}
    full_env.pop("OUTBOX_DATABASE_URL", None)
    proc = subprocess.Popen(
        [str(OUTBOX_SCRIPT), *args, "console", "--port", str(port), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
    )
    running = ConsoleProcess(proc, f"http://127.0.0.1:{port}")
    assert proc.stdout is not None
    stdout = proc.stdout

    def pump() -> None:
        for line in stdout:
            running.lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        # Wait for the server to answer (bounded by the test timeout, not a timed assert).
        while True:
            if proc.poll() is not None:
                reader.join(5)
                raise AssertionError(f"console exited {proc.returncode}: {running.lines}")
            try:
                httpx.get(f"{running.url}/login", timeout=2.0)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        yield running
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
        stdout.close()
