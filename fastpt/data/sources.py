"""Where documents come from, streamed: text files, JSONL (.jsonl / .json / .ndjson lines, also
.gz / .zst), parquet, Hugging Face datasets saved with `save_to_disk` or streamed from the Hub.

Nothing is read whole: a text file is cut into pieces of about a million characters (at a
newline), records are read a batch at a time. A file that is none of these (NUL bytes, a known
binary magic) is refused, naming it, before any work starts; a compressed or parquet file found
damaged while reading is an error naming it and where it broke, never a shorter corpus.
"""

from __future__ import annotations

import codecs
import glob
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fastpt.errors import DataError, FastptError, require

PIECE_BYTES = 1 << 20  # a text file is tokenized in pieces of this size, cut after a newline
SNIFF_BYTES = 8192
JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
BINARY_MAGIC = {
    b"PAR1": "a parquet file (name it .parquet)",
    b"ARROW1": "an Arrow file",
    b"PK\x03\x04": "a zip archive",
    b"\x1f\x8b": "gzip data (name it .gz)",
    b"\x28\xb5\x2f\xfd": "zstd data (name it .zst)",
    b"\x7fELF": "an executable",
    b"%PDF": "a PDF",
    b"\x89PNG": "a PNG image",
    b"\xff\xd8\xff": "a JPEG image",
    b"GIF8": "a GIF image",
    b"\x93NUMPY": "a numpy array",
}


@dataclass(frozen=True)
class Source:
    name: str  # a path, or the Hub dataset spec
    kind: str  # text, jsonl, parquet, saved (save_to_disk folder) or hub


class Decompressed(io.RawIOBase):
    """The bytes of a .gz or .zst file, every member (frame) of it, checked to the end: data that is
    corrupt, or that stops inside a frame (a cut-off download or copy), is a DataError naming the
    file and the compressed byte offset, never a silently shorter read."""

    CHUNK = 1 << 16

    def __init__(self, path: Path):
        self.path, self.format = path, {".gz": "gzip", ".zst": "zstd"}[path.suffix]
        self.zstd = require("zstandard", f"reading {path}", extra="data") if self.format == "zstd" else None
        self.errors = (zlib.error, self.zstd.ZstdError) if self.zstd else (zlib.error,)  # what a damaged frame raises
        self.file = open(path, "rb")
        self.decoder, self.fresh = self._decoder(), True  # fresh: no byte of the current frame seen yet
        self.out, self.pos, self.offset = b"", 0, 0  # decompressed bytes, how many handed out; bytes read

    def _decoder(self):
        return self.zstd.ZstdDecompressor().decompressobj() if self.zstd else zlib.decompressobj(16 + zlib.MAX_WBITS)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.pos == len(self.out):
            chunk = self.file.read(self.CHUNK)
            if not chunk:
                if not self.fresh:
                    raise DataError(
                        f"{self.path}: truncated {self.format} data: it ends inside a compressed "
                        f"frame at byte {self.offset:,} (an incomplete download or copy?)"
                    )
                return 0
            self.out, self.pos = self._feed(chunk), 0
            self.offset += len(chunk)
        n = min(len(buffer), len(self.out) - self.pos)
        buffer[:n] = self.out[self.pos : self.pos + n]
        self.pos += n
        return n

    def _feed(self, data: bytes) -> bytes:
        """Decompress `data`, starting a new decoder at each frame end (a file may hold several)."""
        parts = []
        while data:
            try:
                parts.append(self.decoder.decompress(data))
            except self.errors as e:
                raise DataError(
                    f"{self.path}: corrupt {self.format} data between bytes {self.offset:,} and "
                    f"{self.offset + self.CHUNK:,} ({e})"
                ) from None
            self.fresh = False
            if not self.decoder.eof:
                break
            data, self.decoder, self.fresh = self.decoder.unused_data, self._decoder(), True
        return b"".join(parts)

    def close(self) -> None:
        self.file.close()
        super().close()


def _open(path: Path):
    """A binary file object, decompressing .gz and .zst (checked to their end)."""
    if path.suffix in (".gz", ".zst"):
        return io.BufferedReader(Decompressed(path), Decompressed.CHUNK)
    return open(path, "rb")


def _kind(path: Path) -> str:
    inner = path.with_suffix("").suffix if path.suffix in (".gz", ".zst") else path.suffix
    return "jsonl" if inner in JSONL_SUFFIXES else "parquet" if inner == ".parquet" else "text"


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


class NotText(DataError):
    """A file given as text that is binary (a folder's image, an executable)."""


def _check_text(path: Path) -> None:
    """Refuse a binary file given as text, and an unreadable one, before any work starts."""
    try:
        with _open(path) as f:
            head = f.read(SNIFF_BYTES)
    except FastptError:
        raise
    except Exception as e:  # permission denied, a corrupt .gz / .zst, ...
        raise DataError(f"{path}: cannot read ({e})") from None
    what = next((name for magic, name in BINARY_MAGIC.items() if head.startswith(magic)), None)
    if what or b"\0" in head:
        raise NotText(
            f"{path}: not text ({what or 'NUL bytes: binary, or not UTF-8'}); fastpt.prepare reads "
            "text, .jsonl/.json (.gz/.zst), .parquet and Hugging Face datasets"
        )


def _source(path: Path) -> Source:
    kind = _kind(path)
    if kind == "text":
        _check_text(path)
    elif not os.access(path, os.R_OK):
        raise DataError(f"{path}: cannot read (permission denied)")
    return Source(str(path), kind)


def _walk(folder: Path, skip: Path | None, skipped: list[Path] | None) -> Iterator[Source]:
    """Every file below a folder, sorted; hidden files and folders and the folder `skip` are
    skipped, and a saved Hugging Face dataset inside it is one source. A file that is not text is
    appended to `skipped` when it is a list (--skip-binary), else refused, naming the way to skip it."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not _inside(Path(root, d), skip))
        for d in [d for d in dirs if _is_saved_dataset(Path(root, d))]:
            dirs.remove(d)
            yield Source(str(Path(root, d)), "saved")
        for f in sorted(files):
            if not f.startswith("."):
                try:
                    yield _source(Path(root, f))
                except NotText as e:
                    if skipped is None:
                        hint = "or add --skip-binary to leave out a folder's files that are not text"
                        raise NotText(f"{e}; {hint}") from None
                    skipped.append(Path(root, f))


def _inside(path: Path, folder: Path | None) -> bool:
    return folder is not None and Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))


def find_sources(
    inputs: list[str | Path],
    hf_dataset: str | None = None,
    skip: Path | None = None,
    skipped: list[Path] | None = None,
) -> list[Source]:
    """Files, folders and globs (in the order given; a folder's files sorted), plus a Hub dataset.
    Nothing inside `skip` (the output folder: an earlier dataset there is not text) is taken; a
    folder's files that are not text go to `skipped` when it is a list (see _walk)."""
    sources: list[Source] = []
    for item in map(str, inputs):
        paths = [Path(item)] if os.path.lexists(item) else [Path(m) for m in sorted(glob.glob(item, recursive=True))]
        if not paths:
            raise DataError(f"input {item} does not exist")
        for p in paths:
            if _inside(p, skip):
                continue
            if p.is_dir():
                sources += [Source(str(p), "saved")] if _is_saved_dataset(p) else list(_walk(p, skip, skipped))
            elif p.exists():
                sources.append(_source(p))
            else:
                raise DataError(f"{p}: a dangling symlink (its target {os.readlink(p)} does not exist)")
    if hf_dataset:
        sources.append(Source(hf_dataset, "hub"))
    if not sources:
        raise DataError(f"no input files in {' '.join(map(str, inputs))}")
    return list(dict.fromkeys(sources))  # a file named twice (a folder and a glob) is read once


def _text_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    first, carry = True, ""
    with _open(path) as f:
        while block := f.read(PIECE_BYTES):
            text = carry + decoder.decode(block)
            cut = text.rfind("\n") + 1 or len(text)
            if cut:
                yield text[:cut], first
                first = False
            carry = text[cut:]
    if rest := carry + decoder.decode(b"", final=True):
        yield rest, first


def _field(record, field: str, where: str) -> str | None:
    if not isinstance(record, dict) or field not in record:
        fields = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: no {field!r} field (it has {fields}); choose the text field with --text-field")
    value = record[field]
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {type(value).__name__}, not text")
    return value


def _jsonl_docs(path: Path, field: str) -> Iterator[str | None]:
    with _open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}:{lineno}: not a JSON line ({e})") from None
                yield _field(record, field, f"{path}:{lineno}")


TEXT_TYPES = ("string", "large_string", "string_view")  # Arrow's (and datasets') names of text columns


def _check_text_column(type_name: str, field: str, where: str | Path) -> None:
    if type_name not in TEXT_TYPES:
        raise DataError(
            f"{where}: column {field!r} holds {type_name}, not text; choose the text column with --text-field"
        )


def _parquet_docs(path: Path, field: str) -> Iterator[str | None]:
    pq = require("pyarrow.parquet", f"reading {path}", "pyarrow", extra="data")
    try:
        table = pq.ParquetFile(path, page_checksum_verification=True)  # where the writer stored them
    except Exception as e:  # no footer: cut short, or not parquet at all
        raise DataError(
            f"{path}: not a readable parquet file, truncated or corrupt ({type(e).__name__}: {e})"
        ) from None
    if field not in table.schema_arrow.names:
        raise DataError(
            f"{path}: no {field!r} column (it has {', '.join(table.schema_arrow.names)}); "
            "choose the text column with --text-field"
        )
    _check_text_column(str(table.schema_arrow.field(field).type), field, path)
    rows = 0
    try:
        for batch in table.iter_batches(batch_size=1024, columns=[field]):
            yield from batch.column(0).to_pylist()
            rows += batch.num_rows
    except Exception as e:  # a damaged page or row group: say where, never end the file early
        raise DataError(
            f"{path}: corrupt data after row {rows:,} of {table.metadata.num_rows:,} ({type(e).__name__}: {e})"
        ) from None


def _dataset_docs(ds, field: str, where: str) -> Iterator[str | None]:
    if field not in ds.column_names:
        raise DataError(
            f"{where}: no {field!r} column (it has {', '.join(ds.column_names)}); "
            "choose the text column with --text-field"
        )
    _check_text_column(getattr(ds.features[field], "dtype", type(ds.features[field]).__name__), field, where)
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        yield from batch[field]


def _saved_docs(path: Path, field: str) -> Iterator[str | None]:
    """A save_to_disk folder: a Dataset, or a DatasetDict's train split (or its only one)."""
    datasets = require("datasets", f"reading the saved dataset {path}", extra="data")
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds and len(ds) != 1:
            raise DataError(
                f"{path}: a DatasetDict without a train split (it has {', '.join(ds)}); save the split to use by itself"
            )
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    yield from _dataset_docs(ds, field, str(path))


def parse_hub_spec(spec: str) -> tuple[str, str | None, str]:
    """NAME[:CONFIG][:SPLIT] -> (name, config or None, split, default train)."""
    name, config, split = (spec.split(":") + ["", ""])[:3]
    if not name or spec.count(":") > 2:
        raise DataError(f"--hf-dataset {spec!r}: expected NAME[:CONFIG][:SPLIT]")
    return name, config or None, split or "train"


def _hub_docs(spec: str, field: str) -> Iterator[str | None]:
    name, config, split = parse_hub_spec(spec)
    datasets = require("datasets", f"--hf-dataset {spec}", extra="data")
    for row in datasets.load_dataset(name, config, split=split, streaming=True):
        yield _field(row, field, f"--hf-dataset {spec}")


READERS = {"jsonl": _jsonl_docs, "parquet": _parquet_docs, "saved": _saved_docs, "hub": _hub_docs}


def documents(sources: list[Source], field: str = "text") -> Iterator[tuple[str, bool]]:
    """(text, starts a document) pieces in order: a record is one piece, a text file one or more."""
    for source in sources:
        try:
            if source.kind == "text":
                yield from _text_pieces(Path(source.name))
            else:
                reader = READERS[source.kind](source.name if source.kind == "hub" else Path(source.name), field)
                yield from ((doc, True) for doc in reader if doc)
        except FastptError:
            raise
        except Exception as e:  # whatever a reader library raises about a user's file (gzip, zstd, arrow, datasets)
            raise DataError(f"{source.name}: cannot read ({type(e).__name__}: {e})") from None
