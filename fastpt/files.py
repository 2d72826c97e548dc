"""Crash-safe file primitives: atomic writes, and one owner per output folder."""
from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO, Callable

from fastpt.errors import ConfigError


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Call write(file) on a temp name, fsync, rename over path: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def lock(path: Path, what: str) -> IO[str]:
    """Take an exclusive OS lock on `path` (created if missing) for as long as the returned file
    stays open. The OS drops it when the process dies, SIGKILL included, so it is never stuck;
    a second process is refused with one line naming the owner."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"{path.parent} is in use by another {what} ({owner}); wait for it to end "
                          "or choose another --out") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f
