"""Text files -> tokenizer + train/val token shards.

python -m fastpt.prepare [INPUT ...] --out DIR [--tokenizer bpe|bytes] [--vocab-size N]

With no INPUT the corpus is the running interpreter's standard-library .py sources:
real text that every machine has, so nothing is downloaded.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fastpt.data import write_shard
from fastpt.tokenizer import BPETokenizer, ByteTokenizer

VAL_EVERY = 50  # every 50th document goes to validation
SHARD_TOKENS = 100_000_000


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files, folders (every file below, sorted) and globs -> a sorted, de-duplicated file list."""
    found: set[Path] = set()
    for item in inputs:
        matches = [Path(m) for m in glob.glob(item, recursive=True)] or [Path(item)]
        for m in matches:
            if m.is_dir():
                found.update(p for p in m.rglob("*") if p.is_file())
            elif m.is_file():
                found.add(m)
            else:
                raise SystemExit(f"fastpt.prepare: input {item} does not exist")
    return sorted(found)


def read_documents(files: list[Path]) -> list[str]:
    docs = [f.read_text(encoding="utf-8", errors="replace") for f in tqdm(files, desc="read files", unit="file")]
    return [d for d in docs if d.strip()]


def write_split(docs: list[str], tokenizer, out: Path, split: str, vocab_size: int) -> int:
    """Tokenize documents (EOT before each) into shards of at most SHARD_TOKENS tokens."""
    buffer: list[np.ndarray] = []
    buffered = total = shard_index = 0

    def flush() -> None:
        nonlocal buffer, buffered, shard_index
        write_shard(out / f"{split}_{shard_index:06d}.bin", np.concatenate(buffer), vocab_size)
        buffer, buffered, shard_index = [], 0, shard_index + 1

    bar = tqdm(total=len(docs), desc=f"tokenize {split}", unit="doc")
    for i in range(0, len(docs), 256):
        for ids in tokenizer.encode_batch(docs[i:i + 256]):
            buffer.append(np.array([tokenizer.eot_id, *ids], dtype=np.uint32))
            buffered += len(ids) + 1
            total += len(ids) + 1
            if buffered >= SHARD_TOKENS:
                flush()
        bar.update(min(256, len(docs) - i))
        bar.set_postfix(tokens=f"{total:,}")
    bar.close()
    if buffer:
        flush()
    return total


def prepare(files: list[Path], out: str | Path, tokenizer: str = "bpe", vocab_size: int = 32000) -> dict:
    """Build the tokenizer and shards into `out` (written to a temp folder, renamed when complete)."""
    out = Path(out)
    docs = read_documents(files)
    if len(docs) < 2:
        raise SystemExit(f"fastpt.prepare: need at least 2 non-empty documents, found {len(docs)}")
    val = docs[::VAL_EVERY]
    train = [d for i, d in enumerate(docs) if i % VAL_EVERY]
    if tokenizer == "bytes":
        tok = ByteTokenizer()
    else:
        print(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on {len(train)} documents", flush=True)
        tok = BPETokenizer.train(train, vocab_size)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(tmp / "tokenizer.json")
    meta = {
        "tokenizer": tokenizer, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
        "documents": {"train": len(train), "val": len(val)},
        "tokens": {s: write_split(d, tok, tmp, s, tok.vocab_size) for s, d in (("train", train), ("val", val))},
        "sources": len(files),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return meta


def cache_dir() -> Path:
    root = os.environ.get("FASTPT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastpt")
    return Path(root)


def default_corpus(vocab_size: int) -> Path:
    """The stdlib corpus, prepared once per interpreter version and vocab, then reused."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    out = cache_dir() / f"stdlib-{version}-bpe{vocab_size}"
    if not (out / "meta.json").is_file():
        print(f"preparing the default corpus (Python stdlib sources) into {out} (once)", flush=True)
        prepare(stdlib_sources(), out, "bpe", vocab_size)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastpt.prepare", description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="*", help="text files, folders or globs (default: the Python stdlib sources)")
    ap.add_argument("--out", required=True, help="output folder for shards, tokenizer.json, meta.json")
    ap.add_argument("--tokenizer", choices=("bpe", "bytes"), default="bpe", help="tokenizer kind (default: %(default)s)")
    ap.add_argument("--vocab-size", type=int, default=32000, help="BPE vocabulary size (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.vocab_size < 257:
        ap.error(f"--vocab-size must be at least 257 (256 bytes + end-of-text), got {args.vocab_size}")
    files = expand_inputs(args.inputs) if args.inputs else stdlib_sources()
    meta = prepare(files, args.out, args.tokenizer, args.vocab_size)
    print(f"wrote {meta['tokens']['train']:,} train and {meta['tokens']['val']:,} val tokens "
          f"(vocab {meta['vocab_size']}) to {args.out}")


if __name__ == "__main__":
    main()
