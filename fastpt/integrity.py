"""Checkpoint checksums: a CRC-32 of every byte a checkpoint is made of, written with it and
checked before it is read, so a flipped bit is a damaged checkpoint, never a silently changed
weight (torch.load does not check the CRCs of the zip it reads).

- A checkpoint file (`ckpt_N.pt`, and `state.pt` in a folder) carries its checksum inside it, as
  the zip's comment: `fastpt crc32 XXXXXXXX`, the CRC-32 of every byte before the comment. Any zip
  reader ignores the comment, so torch.load and older fastpt read the file as before, and the file
  and its checksum are one write (files.write_atomic): there is never one without the other.
- A sharded checkpoint folder (DCP) holds MANIFEST: one line `CRC SIZE NAME` per other file in it,
  written into the hidden folder before it is renamed into place (files.publish), so it is part of
  the same publish.
CRC-32 finds every burst of up to 32 flipped bits and misses random damage once in 2^32; it is the
zip format's own checksum and several times faster than a cryptographic hash. It guards against
damage, not forgery: crafted files are refused by the loader (checkpoint.py) instead.
"""

from __future__ import annotations

import os
import re
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO

from fastpt.errors import DamagedCheckpoint
from fastpt.files import open_regular, write_atomic

TAG = b"fastpt crc32 "
TRAILER = len(TAG) + 8  # the zip comment: TAG and eight hex digits
END_RECORD = 22  # a zip's end-of-central-directory record, the last bytes torch.save writes
END_SIGNATURE = b"PK\x05\x06"
MANIFEST = "checksums.crc32"
CHUNK = 1 << 22


class _ChecksumWriter:
    """The file object torch.save writes through: every byte goes on to `f` and into the CRC, except
    the zip's end record, held back until `close` sets its comment length and appends the comment."""

    def __init__(self, f: IO[bytes]):
        self.f, self.crc, self.held = f, 0, b""

    def _out(self, data) -> None:
        self.f.write(data)
        self.crc = zlib.crc32(data, self.crc)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= END_RECORD:
            self._out(self.held)
            self._out(view[:-END_RECORD])
            self.held = bytes(view[-END_RECORD:])
        else:
            joined = self.held + bytes(view)
            self._out(joined[:-END_RECORD])
            self.held = joined[-END_RECORD:]
        return len(view)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        if not (self.held.startswith(END_SIGNATURE) and self.held[-2:] == b"\0\0"):
            raise RuntimeError("torch.save did not end its file with a zip end record without a comment")
        self._out(self.held[:-2] + TRAILER.to_bytes(2, "little"))
        self.f.write(TAG + b"%08x" % self.crc)


def write_zip(f: IO[bytes], save: Callable[[IO[bytes]], object]) -> None:
    """save(out) writes a zip (torch.save) into `f`, which then ends with the comment holding its CRC."""
    out = _ChecksumWriter(f)
    save(out)
    out.close()


def crc_of(path: Path, size: int) -> int:
    """The CRC-32 of the first `size` bytes of `path`, read in chunks."""
    crc, buffer = 0, bytearray(CHUNK)
    with open_regular(path) as f:  # never a FIFO: it would wait for a writer
        while size > 0:
            n = f.readinto(memoryview(buffer)[: min(CHUNK, size)])
            if not n:
                break
            crc, size = zlib.crc32(memoryview(buffer)[:n], crc), size - n
    return crc


def stored_crc(path: Path) -> int | None:
    """The CRC a checkpoint file carries in its zip comment; None for a file written without one (before
    fastpt wrote them, or by another program). What tells the two apart is the end of the file, not the
    comment's bytes, which damage can hit: a file without a checksum ends with a zip end record that
    declares no comment (as torch.save writes it), or is no zip at all. Any other end raises: a comment
    that is damaged or cut short, or an end record that no longer declares it."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - END_RECORD - TRAILER))
        tail = f.read()
    without = tail[-END_RECORD:]
    if without.startswith(END_SIGNATURE) and without.endswith(b"\0\0"):
        return None
    record, digits = tail[:END_RECORD], tail[-TRAILER:]
    ours = record.startswith(END_SIGNATURE) and record[-2:] == TRAILER.to_bytes(2, "little")
    if not ours and END_SIGNATURE not in tail and TAG not in tail:
        return None  # no zip's end: torch.load says what the file is
    if not (ours and digits.startswith(TAG) and re.fullmatch(rb"[0-9a-f]{8}", digits[len(TAG) :])):
        raise DamagedCheckpoint(f"could not read checkpoint {path}: its checksum (zip comment) is damaged or cut short")
    return int(digits[len(TAG) :], 16)


def verify_file(path: Path) -> bool:
    """Check a checkpoint file against the CRC it carries: True when it matches, False when it carries
    none; DamagedCheckpoint when its bytes differ (damaged on disk or in transfer)."""
    expected = stored_crc(path)
    if expected is None:
        return False
    if (actual := crc_of(path, path.stat().st_size - TRAILER)) != expected:
        raise DamagedCheckpoint(
            f"could not read checkpoint {path}: its bytes do not match its checksum "
            f"(crc32 {actual:08x}, written as {expected:08x}): damaged on disk or in transfer"
        )
    return True


def write_manifest(folder: Path) -> None:
    """Write MANIFEST into `folder`: the CRC and size of every other file in it (a DCP checkpoint
    before it is published)."""
    lines = []
    for file in sorted(p for p in folder.iterdir() if p.name != MANIFEST):
        size = file.stat().st_size
        lines.append(f"{crc_of(file, size):08x} {size} {file.name}\n")
    write_atomic(folder / MANIFEST, lambda f: f.write("".join(lines).encode()))


def read_manifest(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (crc, size) from a folder's MANIFEST; a damaged one raises, naming the line."""
    manifest, entries = folder / MANIFEST, {}
    with open_regular(manifest) as f:
        text = f.read().decode("utf-8", "replace")
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        match = re.fullmatch(r"([0-9a-f]{8}) (\d+) ([^/\s]+)\n", line)
        if not match or match.group(3) in entries:
            raise DamagedCheckpoint(f"could not read checkpoint {folder}: {MANIFEST} is damaged (line {number})")
        entries[match.group(3)] = int(match.group(1), 16), int(match.group(2))
    return entries


def verify_folder(folder: Path, state_file: str) -> bool:
    """Check every file of a DCP checkpoint folder against its MANIFEST: True when all match, False
    for a folder written before checksums (no MANIFEST, and a `state_file` without one); DamagedCheckpoint
    naming the first file that is missing, unlisted, of another size or of other bytes."""
    if not (folder / MANIFEST).is_file():
        if (folder / state_file).is_file() and stored_crc(folder / state_file) is not None:
            raise DamagedCheckpoint(f"could not read checkpoint {folder}: its {MANIFEST} is missing")
        return False
    entries = read_manifest(folder)
    present = {p.name for p in folder.iterdir() if p.name != MANIFEST}
    for name in sorted(present ^ entries.keys()):
        why = "is not listed in" if name in present else "is missing; it is listed in"
        raise DamagedCheckpoint(f"could not read checkpoint {folder}: {name} {why} {MANIFEST}")
    for name, (expected, size) in sorted(entries.items()):
        file = folder / name
        if (actual_size := file.stat().st_size) != size:
            raise DamagedCheckpoint(
                f"could not read checkpoint {file}: it has {actual_size:,} bytes, {MANIFEST} says {size:,}"
            )
        if (actual := crc_of(file, size)) != expected:
            raise DamagedCheckpoint(
                f"could not read checkpoint {file}: its bytes do not match {MANIFEST} "
                f"(crc32 {actual:08x}, written as {expected:08x}): damaged on disk or in transfer"
            )
    return True


def carries_checksums(path: Path) -> bool:
    """Whether a checkpoint (a file or a DCP folder) was written with checksums; once `verify` passed
    it, its bytes are then exactly as fastpt wrote them."""
    return (path / MANIFEST).is_file() if path.is_dir() else stored_crc(path) is not None


def warn_if_unverified(path: Path) -> None:
    """One warning for a checkpoint that `verify` passed without checking it (written before checksums)."""
    if carries_checksums(path):
        return
    print(
        f"fastpt: warning: {path} carries no checksum (written before fastpt wrote them): loaded without "
        "checking its bytes",
        file=sys.stderr,
        flush=True,
    )


def verify(path: Path, state_file: str) -> bool:
    """Check a checkpoint (a file, or a DCP folder whose other state is `state_file`) against its
    checksums before anything reads it: True when verified, False for one written without checksums;
    DamagedCheckpoint for damaged bytes; the OSError when the OS would not let us read it (a
    permission, an I/O error), which proves nothing about its bytes."""
    return verify_folder(path, state_file) if path.is_dir() else verify_file(path)
