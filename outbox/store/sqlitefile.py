"""Checks on a SQLite file before outbox uses it, that never cost another connection in
this process its locks.

SQLite's locks are POSIX advisory locks (``fcntl``), and those belong to the process and
the file, not to a descriptor: closing *any* descriptor on the file drops every lock the
process holds on it, including those of connections still open (SQLite itself works
around this inside its own library, by keeping such descriptors open until the last lock
goes; see "the POSIX advisory locking problem" in its ``os_unix.c``). A plain
``open(path).read(); close()`` of the database file in a process whose application
engine already had a connection on it silently unlocked that connection. The next
process to close its last connection then believed itself the last one everywhere: it
checkpointed and *deleted* the -wal and -shm files while the application still wrote to
them. Every later commit of the application went to a WAL no other process could see
(``outbox status`` said ``pending: 0`` while the application read its rows) until the
application exited and checkpointed its orphaned WAL back into the file.

So the raw header is read here through a descriptor that SQLite opened and closes (its
own closing keeps the process's locks), never through one of ours.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path

from outbox.errors import StoreError
from outbox.store.revisions import VERSION_TABLE, check_known

_SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_BYTES = 100
#: Where the process's open descriptors are listed (Linux, macOS and the BSDs).
_FD_DIR = "/dev/fd"


def check_sqlite_file(path: Path, *, must_exist: bool = False) -> None:
    """Refuse, before SQLite opens (and converts) it, what is not an outbox database
    file: a directory, a file that is not SQLite, a truncated one, or one migrated by
    a newer outbox. A missing or empty file is a new database (unless ``must_exist``).

    The file is opened read-only by SQLite (which writes nothing then), and its header
    read through SQLite's own descriptor, so other connections of this process keep
    their locks (see the module docstring)."""
    if path.is_dir():
        raise StoreError(f"{path} is a directory, not a database file")
    if path.exists() and not path.is_file():  # a device, a FIFO (which would block), a socket
        raise StoreError(f"{path} is not a regular file (nothing was changed)")
    if not path.exists():
        if must_exist:
            raise StoreError(f"{path} does not exist (opened read-only: nothing was created)")
        return
    if path.stat().st_size == 0:
        return
    try:
        raw = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read {path}: {exc} (nothing was changed)") from exc
    with closing(raw):
        _check_header(path)
        try:
            found = raw.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (VERSION_TABLE,)
            ).fetchone()
            revision = (
                raw.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchone()
                if found
                else None
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read {path}: {exc} (nothing was changed)") from exc
    check_known(revision[0] if revision else None, str(path))


def _check_header(path: Path) -> None:
    size = path.stat().st_size
    header = read_header(path)
    if len(header) < _HEADER_BYTES or not header.startswith(_SQLITE_MAGIC):
        raise StoreError(f"{path} is not a SQLite database (nothing was changed)")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    header_valid = header[24:28] == header[92:96]
    if page_size < 512 or size % page_size or (header_valid and size < pages * page_size):
        raise StoreError(
            f"{path} is truncated or damaged: {size} bytes, expected "
            f"{pages * page_size if header_valid else 'a whole number of'} pages of "
            f"{page_size} (nothing was changed)"
        )


def read_header(path: Path) -> bytes:
    """The first 100 bytes of the file, read (``pread``) through a descriptor this process
    already has open on it, so that no descriptor on it is closed here. Only where the
    process's descriptors cannot be listed is the file opened and closed by us."""
    fd = open_descriptor(path)
    if fd is not None:
        return os.pread(fd, _HEADER_BYTES, 0)
    with path.open("rb") as f:  # pragma: no cover - a platform without /dev/fd
        return f.read(_HEADER_BYTES)


def open_descriptor(path: Path) -> int | None:
    """A descriptor of this process open on ``path``'s file (same device and inode)."""
    try:
        wanted = os.stat(path)
        names = os.listdir(_FD_DIR)
    except OSError:
        return None
    for name in names:
        try:
            fd = int(name)
            found = os.fstat(fd)
        except (ValueError, OSError):
            continue
        if (found.st_dev, found.st_ino) == (wanted.st_dev, wanted.st_ino):
            return fd
    return None
