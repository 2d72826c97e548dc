"""Crash-safe file primitives, the one home of each: atomic writes of a file and of a folder
(publish under a temporary name), "is this output folder ours", and the OS locks (flock) that
give a run folder or an output folder one owner."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import fnmatch
import glob
import os
import re
import shutil
import signal
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

from fastpt.errors import ConfigError, DiskError


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def os_reason(e: BaseException) -> str:
    """The OS's words for a failed write ('No space left on device'), also when a library wrapped them."""
    os_error = e if isinstance(e, OSError) else e.__context__
    if isinstance(os_error, OSError) and os_error.strerror:
        return os_error.strerror
    return str(e)


KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}


def special(path: Path) -> str:
    """What `path` is when it is neither a regular file nor a folder (through links): 'a FIFO', 'a
    device', 'a socket', 'a link to nothing'; '' for a file, a folder or nothing there."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a link to nothing" if os.path.islink(path) else ""
    except OSError as e:  # a loop of links, a folder on the way that is a file
        return f"a path the OS cannot follow ({e.strerror})"
    return "" if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else KINDS.get(stat.S_IFMT(mode), "no regular file")


def open_regular(path: Path) -> IO[bytes]:
    """open(path, "rb") of a regular file only: a FIFO (which would wait for a writer), a device or a
    folder is refused with an OSError naming what it is, without waiting."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once this way, and is then refused
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else KINDS.get(stat.S_IFMT(mode), "no regular file")
            raise OSError(errno.EINVAL, f"it is {what}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def write_atomic(path: Path, write: Callable[[IO[bytes]], object], mode: int | None = None) -> None:
    """Call write(file) on a temp name, fsync, rename over path: readers see old or new, never half.
    `mode`: the permissions the file gets (the umask's default when None)."""
    write_atomic_all({path: write}, mode)


def write_atomic_all(writes: dict[Path, Callable[[IO[bytes]], object]], mode: int | None = None) -> None:
    """write_atomic for several files at once: each `write(file)` goes to its temp name and is fsynced
    before any is renamed into place, so a write the OS refuses (a full disk, `ulimit -f`) replaces none."""
    tmps = {path: path.with_name(f".{path.name}.tmp{os.getpid()}") for path in writes}
    try:
        for path, write in writes.items():
            with open(tmps[path], "wb") as f:
                if mode is not None:
                    os.fchmod(f.fileno(), mode)
                write(f)
                f.flush()
                os.fsync(f.fileno())
        for path, tmp in tmps.items():
            os.replace(tmp, path)
        for folder in {path.parent for path in writes}:
            fsync_dir(folder)
    except BaseException:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        raise


# A training run's own files (fastpt.train's --out; checkpoint.NAME is a checkpoint's exact name):
# no output a user names may replace one.
RUN_FILES = ("config.toml", "metrics.jsonl", "tokenizer.json", "latest", ".lock", "ckpt_*", ".ckpt_*")


def run_file(path: Path) -> Path | None:
    """The run folder `path` (or the file a link there leads to) is one of the own files of, else None."""
    for file in dict.fromkeys((Path(os.path.abspath(path)), real(path))):
        folder = file.parent
        if re.fullmatch(r"ckpt_\d{8}(\.pt)?", folder.name):  # inside a sharded checkpoint
            return folder.parent
        with contextlib.suppress(OSError):
            names = os.listdir(folder)
            is_run = "config.toml" in names or "metrics.jsonl" in names or any(n.startswith("ckpt_") for n in names)
            if is_run and any(fnmatch.fnmatch(file.name, pattern) for pattern in RUN_FILES):
                return folder
    return None


def check_output(path: str | Path, flag: str) -> None:
    """Refuse, before any work, an output file the user named (`flag`) that writing would cost them
    something: a folder, one of a training run's own files, a read-only file (a user's word that it
    stays as it is; root could replace it, no other user could)."""
    path = Path(path)
    try:
        found = os.stat(path)
    except FileNotFoundError:
        found = None
    except OSError as e:  # a loop of links, a file where a folder should be
        raise ConfigError(f"{flag} {path}: cannot write it ({os_reason(e)})") from None
    if found is not None and stat.S_ISDIR(found.st_mode):
        raise ConfigError(f"{flag} {path} is a folder: name a file")
    if (run := run_file(path)) is not None:
        raise ConfigError(f"{flag} {path} is one of the files of the training run {run}: name another file")
    if found is not None and stat.S_ISREG(found.st_mode) and not found.st_mode & 0o222 and not _stream(found):
        raise ConfigError(
            f"{flag} {path} is read-only (mode {stat.S_IMODE(found.st_mode):o}): not replaced; "
            "make it writable or name another file"
        )


def write_output(path: str | Path, write: Callable[[IO[bytes]], object], flag: str = "output") -> None:
    """Write a file a user named (--plan-json, fastpt.plot --out, bench's --json), refused first as
    check_output says (the command checks it before its work): a regular file, or none yet, is replaced
    atomically, keeping its permissions (write_atomic; through a symlink, its target, so the link
    stays); anything else is written in place, never renamed over: this process's stdout or stderr
    (/dev/stdout, /proc/self/fd/2: through its own descriptor, so `>> log` appends) as they are, a
    device or a FIFO (/dev/null) opened and written as a shell's `>` would (a FIFO with no reader yet:
    said on stderr, then waited for, as a shell waits)."""
    check_output(path, flag)
    try:
        found = os.stat(path)  # through symlinks
    except FileNotFoundError:  # nothing there, or a link to nothing: made, at the link's target
        found = None
    if found is None or (stat.S_ISREG(found.st_mode) and not _stream(found)):
        write_atomic(real(Path(path)), write, stat.S_IMODE(found.st_mode) if found else None)
    elif fd := _stream(found):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # what this process printed before comes first
        with os.fdopen(os.dup(fd), "wb") as f:
            write(f)
    else:
        with os.fdopen(_open_for_writing(Path(path), found), "wb") as f:
            write(f)


def _open_for_writing(path: Path, found: os.stat_result) -> int:
    """A descriptor writing into the device or FIFO `path`; a FIFO nobody reads yet is said, then waited on."""
    if not stat.S_ISFIFO(found.st_mode):
        return os.open(path, os.O_WRONLY)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no reader
    except OSError as e:
        if e.errno != errno.ENXIO:
            raise
        print(f"fastpt: {path} is a FIFO that nothing reads yet: waiting for a reader", file=sys.stderr, flush=True)
        return os.open(path, os.O_WRONLY)
    os.set_blocking(fd, True)
    return fd


def _stream(found: os.stat_result) -> int:
    """1 or 2 when `found` is the file this process's stdout or stderr writes to; else 0."""
    for fd in (1, 2):
        with contextlib.suppress(OSError):  # a closed descriptor
            if os.path.samestat(found, os.fstat(fd)):
                return fd
    return 0


def clear_temporaries(path: Path) -> None:
    """Delete what write_atomic(path) calls that were killed left behind (a SIGKILL runs no cleanup);
    only for a path whose writer holds a lock, so no live writer's temporary is taken."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp*"):
        stale.unlink(missing_ok=True)


def remove(path: Path) -> None:
    """Delete a file, a link or a whole folder; nothing there is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


RENAME_EXCHANGE = 2  # renameat2(2)'s flag: swap two paths in one step
AT_FDCWD = -100
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None


def exchange(a: Path, b: Path) -> bool:
    """Swap the paths `a` and `b` atomically (Linux renameat2 with RENAME_EXCHANGE, glibc 2.28+);
    False where the C library, the kernel or the filesystem cannot, and nothing was changed."""
    if _renameat2 is None:
        return False
    if _renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # not here: rename twice instead
        return False
    raise OSError(code, os.strerror(code), str(b))


def real(out: Path) -> Path:
    """The folder an output path names, through symlinks: what publish replaces, never the link."""
    return Path(os.path.realpath(out))


def aside(out: Path) -> Path:
    """Where publish moves `out` while the two-rename swap is under way."""
    return out.with_name(f".{out.name}.old")


def publish(tmp: Path, out: Path) -> None:
    """Rename the complete folder `tmp` to `out`. Over an existing `out` the two are swapped in one
    step where the OS allows it (`exchange`), so `out` is never missing; elsewhere `out` is moved
    aside first, and a crash before the new one is in leaves it there for `recover`. Either way the
    old folder is deleted only after the new one is in place, never a mix of the two.
    (Checkpoint directories are published with this too.)"""
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        out.rmdir()
    old = aside(out)
    if out.exists() or out.is_symlink():
        remove(old)
        if exchange(tmp, out):
            fsync_dir(out.parent)
            remove(tmp)  # the old folder, under the temporary name: a crash here leaves it to the next cleanup
            return
        out.rename(old)
    tmp.rename(out)
    fsync_dir(out.parent)
    remove(old)


def recover(out: Path) -> bool:
    """Put back the folder a publish killed between its two renames left aside (only where the OS
    had no atomic exchange): `out` missing and its `.old` whole. True when it did. Call it before
    anything cleans `.old` leftovers, by the writer that owns `out`."""
    old = aside(out)
    if out.exists() or out.is_symlink() or not old.exists():
        return False
    old.rename(out)
    fsync_dir(out.parent)
    return True


def foreign_files(folder: Path, ours: Iterable[str]) -> list[str]:
    """The names in `folder` that match none of the glob patterns `ours`: what a user put there."""
    ours = tuple(ours)
    return sorted(p.name for p in folder.iterdir() if not any(fnmatch.fnmatch(p.name, pat) for pat in ours))


def check_out(out: Path, ours: Iterable[str], marker: str, command: str, overwrite: bool) -> None:
    """Refuse an --out that would cost a user anything: a file, a folder holding files that `command`
    does not write (named), and an earlier output of `command` (its `marker` file) without --overwrite.
    An earlier output that a killed publish left aside is put back first, and checked as `out`."""
    recover(real(out))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is not a folder; --out takes a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    foreign = foreign_files(out, ours)
    if foreign or not (out / marker).is_file():
        named = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(
            f"--out {out} holds files that {command} did not write"
            + (f" ({named})" if foreign else f" (no {marker})")
            + ": nothing deleted; choose a new or empty folder"
        )
    if not overwrite:
        raise ConfigError(
            f"--out {out} already holds the output of an earlier {command}: add --overwrite to replace it"
        )


def lock(path: Path, what: str) -> IO[str]:
    """Take an exclusive OS lock on `path` (created if missing) for as long as the returned file
    stays open. The OS drops it when the process dies, SIGKILL included, so it is never stuck;
    a second process is refused with one line naming the owner."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        error = in_use(path, what, f.read())
        f.close()
        raise error from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def in_use(path: Path, what: str, owner: str) -> ConfigError:
    """The refusal of a folder whose lock file `path` another process holds (`owner`: what it wrote there)."""
    return ConfigError(
        f"{path.parent} is in use by another {what} ({owner.strip() or 'another process'}); "
        "wait for it to end or choose another --out"
    )


def check_unlocked(path: Path, what: str) -> None:
    """Refuse now, as `lock` will, when another process holds the lock file `path`: a check before
    work that the lock, taken later, makes sure of."""
    try:
        f = open(path)
    except OSError:  # no lock file, no owner; one that cannot be read is lock's to report
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released when f closes
        except BlockingIOError:
            raise in_use(path, what, f.read()) from None


@contextlib.contextmanager
def owned_folder(folder: Path, what: str) -> Iterator[None]:
    """Make `folder` (and its missing parents) and hold the lock on its `.lock` while the body runs.
    A body that fails (a refused run) leaves the disk as it found it: what this made, the lock file and
    the folders, is removed again when nothing else was written there. An OSError making the folder
    is the caller's to report."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    folder.mkdir(parents=True, exist_ok=True)
    lock_file = folder / ".lock"
    fresh = not lock_file.exists()
    with lock(lock_file, what):
        try:
            yield
        except BaseException:
            if fresh and os.listdir(folder) == [lock_file.name]:
                lock_file.unlink()  # while still holding it: no other process can own it in between
                with contextlib.suppress(OSError):  # one that another process filled meanwhile stays
                    for path in made:
                        path.rmdir()
            raise


def lock_folder(path: Path, out: Path, command: str) -> int:
    """Make and flock the folder `path` itself; the returned descriptor holds the lock until closed.
    A folder its owner has just renamed away (published) is not the one to hold: lock a fresh one."""
    while True:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot create {path} ({os_reason(e)})") from None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue  # its owner renamed it to --out just now
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot open {path} ({os_reason(e)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"--out {out}: another {command} is writing it (it holds {path}); "
                "wait for it to finish, or choose another --out"
            ) from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)


@contextlib.contextmanager
def file_size_limit_as_error() -> Iterator[None]:
    """A write past `ulimit -f` (RLIMIT_FSIZE) fails with EFBIG, like a full disk, instead of the
    SIGXFSZ that would kill the process without a word (main thread only; restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGXFSZ, previous)


@contextlib.contextmanager
def staged(out: Path, command: str) -> Iterator[Path]:
    """A locked temporary folder beside `out` for `command` to write its output into, published as
    `out` when the body completes and deleted when it fails or is interrupted. What a killed writer
    left there is cleared first. A write the OS refuses (a full disk, a read-only folder, a file-size
    limit) is one DiskError naming the file and the OS's reason: nothing is published. An `out` that
    is a symlink stays one: the folder it points to is the one replaced."""
    target = real(out)
    tmp = target.with_name(f".{target.name}.{command.removeprefix('fastpt.')}-tmp")
    fd = lock_folder(tmp, out, command)
    try:
        with file_size_limit_as_error():
            try:
                for stale in tmp.iterdir():
                    remove(stale)
                yield tmp
                publish(tmp, target)
            except OSError as e:
                if isinstance(e, BrokenPipeError):  # the reader of our output is gone: not a write of ours
                    raise
                kept = "; its earlier contents are intact" if out.exists() else ""
                raise DiskError(f"{command} could not write {out}: {os_reason(e)} (nothing published{kept})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def write_error(e: BaseException) -> OSError | None:
    """The OSError a write failed with, when a library (safetensors, say) wrapped it in its own error
    type: its errno from the message, as Rust's io::Error prints it ('os error 28', 'code: 28')."""
    if isinstance(e, OSError):
        return e
    match = re.search(r"(?:os error|code:) (\d+)", str(e))
    code = int(match.group(1)) if match else 0
    return OSError(code, os.strerror(code)) if code in errno.errorcode else None
