"""Text -> tokenizer + train/val token shards, streamed in bounded memory by parallel workers.

python -m fastpt.prepare [INPUT ...] --out DIR [--tokenizer bpe|bytes|char|FILE|hf:NAME|tiktoken:NAME]

With no INPUT the corpus is the running interpreter's standard-library .py sources:
real text that every machine has, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import sysconfig
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fastpt import cores, files
from fastpt.data.shards import INCOMPLETE, MAX_VOCAB, ShardWriter, count_tokens, move_tail, token_dtype
from fastpt.data.sources import Source, documents, find_sources
from fastpt.data.tokenizer import KINDS, build_tokenizer, tokenizer_from_json
from fastpt.errors import ArgumentParser, ConfigError, DataError, run_command
from fastpt.presets import PRESETS

VAL_FRACTION = 0.005
MAX_VAL_FRACTION = 0.1
MIN_VAL_TOKENS = 2049  # one eval window at seq_len 2048, the longest preset's
SHARD_TOKENS = 100_000_000  # as llm.c's FineWeb shards
TOKENIZER_SAMPLE_MB = 100
BATCH_CHARS = 1 << 20  # text per task sent to a worker: large enough to amortise the pickling
DATASET_FILES = ("meta.json", "tokenizer.json", "train_*.bin", "val_*.bin", ".*.maxid", ".*.maxid.tmp*")


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


# ---- tokenizing in worker processes, in order, a bounded number of batches in flight

_worker: dict = {}


def _init_worker(tokenizer_json: str, pooled: bool) -> None:
    """Load the tokenizer from its json text (not from the temporary folder, which an interrupted
    prepare may have deleted before a worker starts)."""
    if pooled:  # Ctrl-C is the parent's to handle (it stops us and cleans up); see submit()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
        threading.Thread(target=_exit_with_parent, daemon=True).start()
    tok = tokenizer_from_json(tokenizer_json)
    _worker.update(tok=tok, dtype=token_dtype(tok.vocab_size))


def _exit_with_parent() -> None:
    """A worker whose parent is gone (killed, or interrupted before it registered this worker)
    would otherwise wait for tasks forever."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)


def encode(pieces: list[tuple[str, bool]]) -> tuple[np.ndarray, int, int]:
    """Pieces -> (their tokens, the document token before each document's first piece; text bytes; documents)."""
    tok, eot = _worker["tok"], _worker["tok"].eot_id
    parts: list[Iterable[int]] = []
    for (_, starts), ids in zip(pieces, tok.encode_batch([text for text, _ in pieces])):
        if starts and eot is not None:
            parts.append((eot,))
        parts.append(ids)
    tokens = np.fromiter(itertools.chain.from_iterable(parts), _worker["dtype"], count=sum(map(len, parts)))
    return tokens, sum(len(text.encode()) for text, _ in pieces), sum(starts for _, starts in pieces)


def batches(pieces: Iterable[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def submit(pool: ProcessPoolExecutor, item) -> Future:
    """pool.submit(encode, item), which may spawn a worker, with Ctrl-C held until it returns: a
    worker cut off mid-spawn prints a traceback or waits for tasks forever. The worker inherits
    the blocked SIGINT, so a Ctrl-C during its start-up waits for its initializer, which ignores
    it. The held Ctrl-C is raised here, never lost."""
    held: list[int] = []
    main = threading.current_thread() is threading.main_thread()  # signal handlers live there
    previous = signal.signal(signal.SIGINT, lambda *_: held.append(1)) if main else None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return pool.submit(encode, item)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if main:
            signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(signal.SIGINT, None)


def encode_all(items: Iterable, tokenizer_json: str, workers: int) -> Iterator[tuple[np.ndarray, int, int]]:
    """encode() over items, in order: in this process for one worker, else in spawned processes
    with at most two batches per worker in flight, so memory stays bounded whatever the corpus."""
    if workers == 1:
        _init_worker(tokenizer_json, pooled=False)
        yield from map(encode, items)
        return
    pool = ProcessPoolExecutor(
        workers, multiprocessing.get_context("spawn"), initializer=_init_worker, initargs=(tokenizer_json, True)
    )
    try:
        pending: deque = deque()
        for item in items:
            pending.append(submit(pool, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise ConfigError(
            f"a tokenizer process died (killed for lack of memory?): try --workers below {workers}"
        ) from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def tokenize(
    sources: list[Source], text_field: str, folder: Path, vocab_size: int, workers: int, shard_tokens: int
) -> tuple[list[Path], int, int]:
    """Every document into train shards, written as they fill, by the tokenizer saved in `folder`;
    returns (shards, documents, text bytes)."""
    tokenizer_json = (folder / "tokenizer.json").read_text(encoding="utf-8")
    writer = ShardWriter(folder, "train", vocab_size, shard_tokens)
    docs = nbytes = 0
    # a terminal gets a live bar; a log file one progress line every 30 s (none for a shorter run)
    log_interval = 0 if sys.stderr.isatty() else 30
    with tqdm(
        desc="tokenize",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        mininterval=log_interval or 0.1,
        delay=log_interval,
    ) as bar:
        for tokens, n, d in encode_all(batches(documents(sources, text_field)), tokenizer_json, workers):
            writer.write(tokens)
            docs, nbytes = docs + d, nbytes + n
            bar.update(n)
            bar.set_postfix_str(f"{writer.total:,} tokens", refresh=False)
    return writer.close(), docs, nbytes


def hold_out_val(
    train: list[Path], total: int, val_fraction: float, folder: Path, vocab_size: int, shard_tokens: int
) -> tuple[list[Path], list[Path]]:
    """Move the tail of the token stream to val: val_fraction of it, at least one eval window,
    at most MAX_VAL_FRACTION."""
    n_val = min(max(round(total * val_fraction), MIN_VAL_TOKENS), int(total * MAX_VAL_FRACTION))
    if n_val < 1:
        raise DataError(f"the corpus is {total} tokens: too few to hold out any validation tokens")
    val = ShardWriter(folder, "val", vocab_size, shard_tokens)
    train = move_tail(train, n_val, val)
    return train, val.close()


def text_sample(sources: list[Source], text_field: str, mb: float) -> Iterator[str]:
    """The first `mb` megabytes of the corpus (by characters), what bpe and char learn from."""
    left = mb * 2**20
    for text, _ in documents(sources, text_field):
        if left <= 0:
            return
        left -= len(text)
        yield text


def check_options(
    tokenizer: str, vocab_size: int, val_fraction: float, workers: int, shard_tokens: int, tokenizer_sample_mb: float
) -> None:
    if tokenizer == "bpe" and not 257 <= vocab_size <= MAX_VOCAB:
        raise ConfigError(f"--vocab-size {vocab_size}: must be 257 (256 bytes + end-of-text) to {MAX_VOCAB:,}")
    if not 0 < val_fraction <= MAX_VAL_FRACTION:
        raise ConfigError(f"--val-fraction {val_fraction}: must be in (0, {MAX_VAL_FRACTION}]")
    if workers < 0:
        raise ConfigError(f"--workers {workers}: must be >= 1, or 0 for all cores")
    if not 1 <= shard_tokens < 2**31:
        raise ConfigError(f"--shard-tokens {shard_tokens}: must be 1 to 2^31-1 (the header holds an int32)")
    if not tokenizer_sample_mb > 0:
        raise ConfigError(f"--tokenizer-sample {tokenizer_sample_mb}: must be > 0 (megabytes)")


def worker_count(requested: int) -> int:
    """The tokenizer processes --workers asks for (0: one per core), at most one per core this process
    may use: more only wait their turn, each a process of its own (a million would spawn until the
    machine gave out), so they are capped, saying so."""
    usable = cores.all_cores()
    if requested > usable:
        print(
            f"fastpt: warning: --workers {requested} is more than the {usable} cores this process may use: "
            f"using {usable}",
            file=sys.stderr,
            flush=True,
        )
    return min(requested or usable, usable)


def prepare(
    inputs: list[str | Path],
    out: str | Path,
    tokenizer: str = "bpe",
    vocab_size: int = 32000,
    *,
    hf_dataset: str | None = None,
    text_field: str = "text",
    val_fraction: float = VAL_FRACTION,
    workers: int = 0,
    shard_tokens: int = SHARD_TOKENS,
    tokenizer_sample_mb: float = TOKENIZER_SAMPLE_MB,
    overwrite: bool = False,
    skip_binary: bool = False,
) -> dict:
    """Tokenize `inputs` (files, folders, globs; plus a Hub dataset) into train/val shards in `out`,
    with tokenizer.json and meta.json; written into a locked temporary folder, renamed when complete.
    skip_binary: a folder's files that are not text are left out, named in one line."""
    out = Path(os.path.abspath(out))  # `--out .` or `x/..` have a name to put the temporary folder beside
    check_options(tokenizer, vocab_size, val_fraction, workers, shard_tokens, tokenizer_sample_mb)
    files.check_out(out, DATASET_FILES, "meta.json", "fastpt.prepare", overwrite)
    skipped: list[Path] | None = [] if skip_binary else None
    sources = find_sources(inputs, hf_dataset, skip=out, skipped=skipped)
    if skipped:
        names = ", ".join(map(str, skipped[:3])) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        print(f"--skip-binary: left out {len(skipped)} file(s) that are not text: {names}", flush=True)
    workers = worker_count(workers)
    start = time.perf_counter()
    with files.staged(out, "fastpt.prepare") as tmp:
        (tmp / INCOMPLETE).touch()  # what train refuses, should this folder ever be published unfinished
        tok = build_tokenizer(tokenizer, vocab_size, lambda: text_sample(sources, text_field, tokenizer_sample_mb))
        tok.save(tmp / "tokenizer.json")
        if tok.eot_id is None:
            print("note: the tokenizer has no end-of-text or BOS token: documents are joined without one", flush=True)
        tokenizer_s = round(time.perf_counter() - start, 3)
        shards, docs, nbytes = tokenize(sources, text_field, tmp, tok.vocab_size, workers, shard_tokens)
        train, val = hold_out_val(shards, count_tokens(shards), val_fraction, tmp, tok.vocab_size, shard_tokens)
        meta = {
            "format": "fastpt",
            "tokenizer": tokenizer,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "tokens": {"train": count_tokens(train), "val": count_tokens(val)},
            "shards": {"train": len(train), "val": len(val)},
            "documents": docs,
            "text_bytes": nbytes,
            "sources": len(sources),
            "text_field": text_field,
            "val_fraction": val_fraction,
            "workers": workers,
            "seconds": {"tokenizer": tokenizer_s, "tokenize": round(time.perf_counter() - start - tokenizer_s, 3)},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        (tmp / INCOMPLETE).unlink()
    return meta


def cache_dir() -> Path:
    root = os.environ.get("FASTPT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastpt"
    )
    return Path(root)


def encoding_content(path: Path) -> bytes:
    """A tokenizer.json's bytes as far as they decide fastpt's ids: without its post-processor, which
    only adds tokens around a text encoded with special tokens (an export's BOS), which fastpt never asks for."""
    content = path.read_bytes()
    try:
        config = json.loads(content)
    except ValueError:
        return content
    if not isinstance(config, dict) or "type" in config:  # fastpt's own kinds: their bytes as they are
        return content
    return json.dumps({**config, "post_processor": None}, sort_keys=True).encode()


def default_corpus(vocab_size: int, tokenizer: Path | None = None) -> Path:
    """The stdlib corpus, prepared once per interpreter version and tokenizer (a local BPE of
    `vocab_size`, or the given tokenizer.json, e.g. the one of an --init-from model), then reused.
    A given tokenizer is known by its content (encoding_content): a corpus already prepared with the
    same one (the local BPE that a model exported from a default run carries along) is reused as it is."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    if tokenizer is None:
        out, kind = cache_dir() / f"stdlib-{version}-bpe{vocab_size}", "bpe"
    else:  # named by content: another model's tokenizer.json under the same path is another corpus
        content = encoding_content(Path(tokenizer))
        out, kind = cache_dir() / f"stdlib-{version}-tok{hashlib.sha256(content).hexdigest()[:16]}", str(tokenizer)
        out = next(
            (
                c
                for c in sorted(cache_dir().glob(f"stdlib-{version}-*"))
                if (c / "meta.json").is_file()
                and (c / "tokenizer.json").is_file()
                and encoding_content(c / "tokenizer.json") == content
            ),
            out,
        )
    if not (out / "meta.json").is_file():
        print(f"preparing the default corpus (Python stdlib sources) into {out} (once)", flush=True)
        # in this process: the trainer has imported torch, and spawned workers would import it again
        prepare(stdlib_sources(), out, kind, vocab_size, workers=1)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m fastpt.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "inputs",
        nargs="*",
        help="text, .jsonl/.json(.gz/.zst), .parquet files, folders, globs, "
        "saved Hugging Face datasets (default: the Python stdlib sources)",
    )
    ap.add_argument("--out", required=True, help="output folder for shards, tokenizer.json, meta.json")
    ap.add_argument(
        "--overwrite", action="store_true", help="replace a dataset already in --out (default: %(default)s)"
    )
    ap.add_argument("--tokenizer", default="bpe", help=f"{KINDS} (default: %(default)s)")
    ap.add_argument("--vocab-size", type=int, default=32000, help="BPE vocabulary size (default: %(default)s)")
    ap.add_argument(
        "--tokenizer-sample",
        type=float,
        default=TOKENIZER_SAMPLE_MB,
        metavar="MB",
        help="bpe and char learn from the corpus's first MB megabytes (default: %(default)s)",
    )
    ap.add_argument(
        "--hf-dataset",
        metavar="NAME[:CONFIG][:SPLIT]",
        help="also stream this Hugging Face Hub dataset (default: %(default)s)",
    )
    ap.add_argument(
        "--text-field", default="text", help="JSONL field / parquet or dataset column (default: %(default)s)"
    )
    ap.add_argument(
        "--val-fraction",
        type=float,
        default=VAL_FRACTION,
        help=f"tail of the tokens held out for validation, at most {MAX_VAL_FRACTION} "
        f"(default: %(default)s, at least {MIN_VAL_TOKENS} tokens)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=0,
        help="tokenizer processes, at most one per core (more are capped, saying so); 0 = all cores "
        "(default: %(default)s)",
    )
    ap.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens per shard (default: %(default)s)")
    ap.add_argument(
        "--skip-binary",
        action="store_true",
        help="leave out the files in input folders that are not text (images, executables), naming them; "
        "without it such a file is refused (default: %(default)s)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    inputs = args.inputs or ([] if args.hf_dataset else stdlib_sources())
    if not (args.inputs or args.hf_dataset):  # a newcomer may not know what an input-less command reads
        root = sysconfig.get_paths()["stdlib"]
        print(
            f"no inputs given: the corpus is the Python standard library's source ({len(inputs):,} .py files in {root})"
        )
    meta = prepare(
        inputs,
        args.out,
        args.tokenizer,
        args.vocab_size,
        hf_dataset=args.hf_dataset,
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
        tokenizer_sample_mb=args.tokenizer_sample,
        overwrite=args.overwrite,
        skip_binary=args.skip_binary,
    )
    seconds = max(meta["seconds"]["tokenize"], 1e-3)
    print(
        f"wrote {meta['tokens']['train']:,} train and {meta['tokens']['val']:,} val tokens "
        f"(vocab {meta['vocab_size']}, {meta['documents']:,} documents) to {args.out}; tokenized "
        f"{meta['text_bytes'] / 2**20:,.1f} MB in {seconds:.1f} s ({meta['text_bytes'] / 2**20 / seconds:.1f} MB/s)"
    )
    if note := vocab_note(meta):
        print(note)


SMALL_CORPUS_TOKENS_PER_ID = 1000  # below this many training tokens per vocab id, the vocab is large for the corpus


def vocab_note(meta: dict) -> str | None:
    """A learnt vocab large for its corpus: on a small model it is most of the parameters and the time."""
    vocab, tokens = meta["vocab_size"], meta["tokens"]["train"]
    if meta["tokenizer"] != "bpe" or vocab <= 4096 or tokens >= SMALL_CORPUS_TOKENS_PER_ID * vocab:
        return None
    tiny = PRESETS["tiny"]
    embedding, rest = vocab * tiny.dim, dataclasses.replace(tiny, vocab_size=1).num_params()
    return (
        f"note: vocab {vocab:,} for {tokens:,} training tokens: on the tiny preset the embedding is "
        f"{embedding / (embedding + rest):.0%} of the parameters; for a CPU run or a corpus this small, "
        "--vocab-size 4096 (the default corpus's) trains several times faster"
    )


if __name__ == "__main__":
    run_command(main)
