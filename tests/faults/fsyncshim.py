"""An ``LD_PRELOAD`` shim that makes a SQLite write-ahead log's fsync fail with EIO.

Compiled with gcc into the test's tmp directory (:func:`build`). In a process started
with :func:`environment`, the first ``fsync``/``fdatasync`` on a file whose name ends in
``-wal`` after the *trigger* file appears fails with EIO, and the trigger is removed
(so exactly one fsync fails per trigger). While the *always* file exists, every such
fsync fails. Each injected failure appends the file's name to the log.

The write itself is left alone: the frames are in the page cache, as after a real EIO
from a disk that wrote them but could not confirm it. What SQLite's recovery does with
them after a crash is what the tests look at.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int wal_of(int fd, char *name, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, name, size - 1);
    if (n < 4) return 0;
    name[n] = 0;
    return strcmp(name + n - 4, "-wal") == 0;
}

static int inject(int fd) {
    const char *trigger = getenv("OUTBOX_FSYNC_TRIGGER");
    const char *always = getenv("OUTBOX_FSYNC_ALWAYS");
    const char *log = getenv("OUTBOX_FSYNC_LOG");
    char name[4096];
    if (!wal_of(fd, name, sizeof name)) return 0;
    int fail = (trigger && unlink(trigger) == 0) || (always && access(always, F_OK) == 0);
    if (fail && log) {
        int out = open(log, O_WRONLY | O_APPEND | O_CREAT, 0600);
        if (out >= 0) {
            dprintf(out, "EIO %s\n", name);
            close(out);
        }
    }
    return fail;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    if (inject(fd)) { errno = EIO; return -1; }
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    if (inject(fd)) { errno = EIO; return -1; }
    return real(fd);
}
"""


@dataclass(frozen=True)
class Shim:
    library: Path
    trigger: Path
    always: Path
    log: Path

    def environment(self) -> dict[str, str]:
        """The environment of a process whose WAL fsyncs the shim controls."""
        return {
            **os.environ,
            "LD_PRELOAD": str(self.library),
            "OUTBOX_FSYNC_TRIGGER": str(self.trigger),
            "OUTBOX_FSYNC_ALWAYS": str(self.always),
            "OUTBOX_FSYNC_LOG": str(self.log),
        }

    def injected(self) -> list[str]:
        """The files whose fsync failed, one line per injected EIO."""
        return self.log.read_text().splitlines() if self.log.exists() else []


def build(tmp: Path) -> Shim:
    """Compile the shim (skips the test when gcc is missing)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is needed to build the fsync-failure LD_PRELOAD shim")
    source = tmp / "fsyncshim.c"
    source.write_text(_SOURCE)
    library = tmp / "fsyncshim.so"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-o", str(library), str(source), "-ldl"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return Shim(library, tmp / "fsync.trigger", tmp / "fsync.always", tmp / "fsync.log")
