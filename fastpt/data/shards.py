"""The token shard file: llm.c / modded-nanogpt format, read as a memory map, written as a stream.

A shard is a 256 x int32 little-endian header (magic, version, token count, vocab size), then
the tokens as uint16 (magic 20240520) or uint32 (magic 20240801). Numpy only: the prepare
workers import this, and never torch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from fastpt.errors import DataError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# magic -> (version, token dtype), as written by llm.c and modded-nanogpt
FORMATS = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}
# Real vocabularies stop near 2^18 (Gemma's 262k); a larger header value is a corrupt file, and
# building a model for it would try to allocate terabytes.
MAX_VOCAB = 2**21
# fastpt.prepare writes a dataset under a temporary name with this marker in it, removed just
# before the rename: a folder that still has it is an interrupted prepare, never training data.
INCOMPLETE = ".incomplete"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of the vocab fits, else uint32 (little-endian, as on disk)."""
    return np.dtype("<u2" if 0 < vocab_size <= 2**16 else "<u4")


def _header(dtype: np.dtype, count: int, vocab_size: int) -> bytes:
    magic = 20240520 if dtype.itemsize == 2 else 20240801
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = (magic, FORMATS[magic][0], count, vocab_size)
    return header.tobytes()


def write_shard(path: str | Path, tokens, vocab_size: int = 0) -> Path:
    """Write tokens as an llm.c shard: uint16 when every id of the vocab (or, vocab 0 = unknown,
    every id given) fits, else uint32."""
    tokens = np.asarray(tokens)
    dtype = token_dtype(vocab_size or (int(tokens.max()) + 1 if tokens.size else 1))
    path = Path(path)
    with open(path, "wb") as f:
        f.write(_header(dtype, tokens.size, vocab_size))
        f.write(tokens.astype(dtype).tobytes())
    return path


def stat(path: Path) -> os.stat_result:
    """The file's stat, or a DataError that says why it cannot be read."""
    if path.is_symlink() and not path.exists():
        raise DataError(f"{path}: a dangling symlink (its target {os.readlink(path)} does not exist)")
    try:
        return path.stat()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def read_header(path: Path) -> tuple[np.dtype, int, int]:
    """Check an llm.c header against the file; returns (token dtype, token count, vocab size)."""
    size = stat(path).st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path}: {size} bytes is too short for a {HEADER_BYTES}-byte shard header")
    try:
        header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    magic, version, count, vocab = (int(v) for v in header[:4])
    if magic not in FORMATS:
        raise DataError(
            f"{path}: bad magic {magic} (expected 20240520 or 20240801; "
            "a headerless nanoGPT .bin needs data_format = 'nanogpt')"
        )
    want_version, dtype = FORMATS[magic]
    if version != want_version:
        raise DataError(f"{path}: version {version} does not match magic {magic} (expected {want_version})")
    if not 0 <= vocab <= MAX_VOCAB:
        raise DataError(f"{path}: header vocab size {vocab} is not plausible (0 to {MAX_VOCAB:,}): a corrupt header")
    itemsize = np.dtype(dtype).itemsize
    if size != HEADER_BYTES + count * itemsize:
        raise DataError(
            f"{path}: header says {count} tokens ({HEADER_BYTES + count * itemsize} bytes) "
            f"but the file has {size} bytes (truncated or corrupt)"
        )
    return np.dtype(dtype).newbyteorder("<"), count, vocab


def read_shard(path: str | Path, headerless: bool = False) -> np.memmap:
    """Memory-map a shard's tokens (never loaded whole); headerless = nanoGPT uint16 .bin."""
    path = Path(path)
    if headerless:
        size = stat(path).st_size
        if size % 2:
            raise DataError(f"{path}: odd byte count, not a headerless uint16 token file")
        dtype, count, offset = np.dtype("<u2"), size // 2, 0
    else:
        (dtype, count, _), offset = read_header(path), HEADER_BYTES
    if count == 0:
        raise DataError(f"{path}: holds no tokens")
    try:
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def content_key(path: Path, blocks: int = 16, block_bytes: int = 1 << 16) -> str:
    """What a cache of a shard's contents is keyed by: size, mtime, ctime and inode (which no
    `touch` can set back and which any rewrite changes) and a digest of the header and `blocks`
    blocks spread over the file (bytes the file's contents decide), read in well under a
    millisecond whatever the shard's size."""
    st = stat(path)
    digest = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            for i in range(blocks + 1):
                f.seek(st.st_size * i // (blocks + 1))
                digest.update(f.read(block_bytes))
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{digest.hexdigest()}"


def shard_vocab(path: str | Path) -> int:
    """The vocab size recorded in a shard's header (0 = unknown)."""
    return read_header(Path(path))[2]


def count_tokens(paths: list[Path]) -> int:
    return sum(read_header(p)[1] for p in paths)


class ShardWriter:
    """Appends token arrays to `{split}_000000.bin`, `{split}_000001.bin`, ... in `folder`, starting
    a new shard every `shard_tokens` tokens; each header is written when its shard is full."""

    def __init__(self, folder: Path, split: str, vocab_size: int, shard_tokens: int):
        self.folder, self.split, self.vocab_size, self.shard_tokens = folder, split, vocab_size, shard_tokens
        self.dtype = token_dtype(vocab_size)
        self.paths: list[Path] = []
        self.total = 0
        self._file = None
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                self.paths.append(self.folder / f"{self.split}_{len(self.paths):06d}.bin")
                self._file = open(self.paths[-1], "wb")
                self._file.write(_header(self.dtype, 0, self.vocab_size))  # count filled in when full
            part, tokens = tokens[: self.shard_tokens - self._count], tokens[self.shard_tokens - self._count :]
            self._file.write(part.tobytes())
            self._count += part.size
            self.total += part.size
            if self._count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        self._file.seek(0)
        self._file.write(_header(self.dtype, self._count, self.vocab_size))
        self._file.close()
        self._file, self._count = None, 0

    def close(self) -> list[Path]:
        if self._file is not None:
            self._finish()
        return self.paths


def move_tail(paths: list[Path], n: int, dest: ShardWriter) -> list[Path]:
    """Move the last n tokens of the shard stream `paths` into `dest`, in order, a chunk at a time;
    shards left empty are deleted, the last one kept is truncated. Returns the shards kept."""
    paths = list(paths)
    cuts = []  # (shard, first token moved), from the end of the stream backwards
    while n > 0 and paths:
        count = read_header(paths[-1])[1]
        cuts.append((paths[-1], max(0, count - n)))
        n -= count - cuts[-1][1]
        if cuts[-1][1] == 0:
            paths.pop()
    chunk = 1 << 24
    for path, start in reversed(cuts):
        tokens = read_shard(path)
        for i in range(start, len(tokens), chunk):
            dest.write(np.array(tokens[i : min(i + chunk, len(tokens))]))
        del tokens
        if start == 0:
            path.unlink()
        else:
            _truncate(path, start)
    return paths


def _truncate(path: Path, count: int) -> None:
    dtype, _, vocab = read_header(path)
    with open(path, "r+b") as f:
        f.write(_header(dtype, count, vocab))
        f.truncate(HEADER_BYTES + count * dtype.itemsize)
