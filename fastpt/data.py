"""Training data: finding and checking token shards, and a deterministic, resumable loader."""
from __future__ import annotations

import atexit
import contextlib
import json
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastpt.errors import DataError
from fastpt.shards import INCOMPLETE, MAX_VOCAB, read_shard, shard_vocab
from fastpt.tokenizer import load_tokenizer, read_nanogpt_meta

GPT2_VOCAB = 50257  # what nanoGPT assumes for headerless data without a meta.pkl


def prepare_hint(path: Path) -> str:
    return f"prepare it first with `python -m fastpt.prepare {path} --out DIR`, then train with --data DIR"


def find_shards(folder: str | Path, split: str, data_format: str = "llmc") -> list[Path]:
    """train_*.bin / val_*.bin (llm.c and ours), or nanoGPT's train.bin / val.bin; an error that
    says what to do for anything else (a text file, a folder of text, an interrupted prepare)."""
    folder = Path(folder)
    if folder.is_file():
        raise DataError(f"--data {folder} is a file, not a folder of token shards: "
                        + (prepare_hint(folder) if folder.suffix != ".bin" else "give the folder that holds it"))
    if not folder.is_dir():
        raise DataError(f"data folder {folder} does not exist")
    if (folder / INCOMPLETE).exists():
        raise DataError(f"{folder} is an unfinished fastpt.prepare output (interrupted): run the prepare again")
    pattern = f"{split}.bin" if data_format == "nanogpt" else f"*{split}_*.bin"
    shards = sorted(folder.glob(pattern))
    if shards:
        return shards
    if data_format == "llmc" and (folder / f"{split}.bin").exists():
        raise DataError(f"data folder {folder} has nanoGPT's {split}.bin: add --data-format nanogpt")
    if any(p.is_file() and p.suffix != ".bin" and not p.name.startswith(".") for p in folder.iterdir()):
        raise DataError(f"data folder {folder} holds text but no {pattern} token shards: {prepare_hint(folder)}")
    raise DataError(f"data folder {folder} has no {pattern} files")


@dataclass
class Batch:
    x: torch.Tensor  # (B, T) inputs
    y: torch.Tensor  # (B, T) targets, x shifted by one


class Windows:
    """Non-overlapping windows of seq_len + 1 tokens over a list of memory-mapped shards."""

    def __init__(self, shards: list[Path], seq_len: int, headerless: bool = False):
        self.seq_len = seq_len
        self.tokens = [read_shard(p, headerless) for p in shards]
        per_shard = np.array([len(t) // (seq_len + 1) for t in self.tokens], dtype=np.int64)
        if per_shard.sum() == 0:
            longest = max(len(t) for t in self.tokens)
            raise DataError(f"seq_len {seq_len} is longer than the data: the longest shard "
                            f"({shards[int(np.argmax([len(t) for t in self.tokens]))]}) has {longest} tokens")
        self.starts = np.concatenate(([0], np.cumsum(per_shard)))  # window index where each shard begins

    def __len__(self) -> int:
        return int(self.starts[-1])

    def gather(self, indices: np.ndarray) -> torch.Tensor:
        """Windows by global index -> (len(indices), seq_len + 1) int64."""
        span = self.seq_len + 1
        shard_ids = np.searchsorted(self.starts, indices, side="right") - 1
        rows = [self.tokens[s][(i - self.starts[s]) * span:(i - self.starts[s] + 1) * span]
                for s, i in zip(shard_ids, indices)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


class TrainLoader:
    """Seeded per-epoch permutation of windows, striped over micro-steps and ranks.

    Optimizer step s consumes global windows [s*G, (s+1)*G) of the permuted stream,
    G = micro_batch * grad_accum * world_size, so any split of G sees the same data.
    The only state is the position in that stream (plus the seed).
    """

    def __init__(self, windows: Windows, micro_batch: int, seed: int,
                 device: torch.device, rank: int = 0, world_size: int = 1, prefetch: int = 2):
        self.windows, self.micro_batch, self.seed = windows, micro_batch, seed
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.prefetch = prefetch
        self.position = 0  # micro-steps handed out so far (each covers world_size micro-batches)
        self.wait_s = 0.0  # time spent blocked on the prefetch queue, for data-wait %
        self._perms: dict[int, np.ndarray] = {}
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _indices(self, micro_step: int) -> np.ndarray:
        n = len(self.windows)
        first = (micro_step * self.world_size + self.rank) * self.micro_batch
        positions = np.arange(first, first + self.micro_batch)
        epochs = positions // n
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._perm(int(epoch))[positions[mask] % n]
        return out

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))}
        return self._perms[epoch]

    def _produce(self, start: int, q: queue.Queue, stop: threading.Event) -> None:
        """Build batches in order from micro-step `start`; contiguous (and pinned for CUDA) here,
        off the training thread, so the step only issues two non-blocking copies. An error is
        queued too: the training thread raises it instead of waiting forever."""
        pin = self.device.type == "cuda"
        step = start
        while not stop.is_set():
            try:
                w = self.windows.gather(self._indices(step))  # (B, T+1)
                x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T) each
                item = (x.pin_memory(), y.pin_memory()) if pin else (x, y)
            except Exception as e:
                item = e
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if isinstance(item, Exception):
                return
            step += 1

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._produce, args=(self.position, self._queue, self._stop),
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)  # also on an exception that skips the trainer's close()

    def close(self) -> None:
        """Stop and join the producer: a thread still inside torch at interpreter exit aborts it."""
        self._stop.set()
        atexit.unregister(self.close)
        if self._thread is not None:
            self._thread.join()
        self._queue = self._thread = None

    def next(self) -> Batch:
        if self._queue is None:
            self._start()
        t0 = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, Exception):
            raise item
        x, y = item
        self.position += 1
        return Batch(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))

    @property
    def epoch(self) -> int:
        return self.position * self.world_size * self.micro_batch // len(self.windows)

    def state_dict(self) -> dict:
        """Position counted in windows of the global stream, so it survives a change of split."""
        return {"windows_consumed": self.position * self.world_size * self.micro_batch,
                "seed": self.seed, "num_windows": len(self.windows)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_windows"] != len(self.windows):
            raise DataError(f"checkpoint's loader saw {state['num_windows']} windows, the data now has "
                            f"{len(self.windows)}: resume with the same data and seq_len")
        per_micro = self.world_size * self.micro_batch
        if state["windows_consumed"] % per_micro:
            raise DataError(f"checkpoint position {state['windows_consumed']} windows is not a multiple of "
                            f"micro_batch x world_size = {per_micro}")
        self.close()
        self.seed = state["seed"]
        self.position = state["windows_consumed"] // per_micro


def eval_batches(windows: Windows, micro_batch: int, eval_tokens: int, device: torch.device,
                 rank: int = 0, world_size: int = 1):
    """The first eval_tokens of the validation windows, in order: the same every evaluation and
    for any world size. Ranks take every world_size-th window; FSDP ranks must run the same
    forwards, so a rank that runs out repeats window 0 with its targets ignored (-100)."""
    n = min(len(windows), max(1, eval_tokens // windows.seq_len))
    mine = np.arange(rank, n, world_size)
    padding = -(-n // world_size) - len(mine)
    indices = np.concatenate((mine, np.zeros(padding, dtype=mine.dtype)))
    for i in range(0, len(indices), micro_batch):
        w = windows.gather(indices[i:i + micro_batch]).to(device)  # (B, T+1)
        x, y = w[:, :-1], w[:, 1:].clone()
        y[max(0, len(mine) - i):] = -100  # the padding rows count for nothing
        yield Batch(x, y)


def data_vocab(folder: Path, shards: list[Path], headerless: bool) -> int:
    """The data's vocab size, from the first that has one: meta.json (fastpt.prepare), nanoGPT's
    meta.pkl, the shard headers, a tokenizer.json beside the shards; else GPT-2's for headerless
    data (nanoGPT's own rule without a meta.pkl), else the largest token id + 1."""
    folder = Path(folder)
    if (folder / "meta.json").is_file():
        return _meta_json_vocab(folder / "meta.json")
    if (folder / "meta.pkl").is_file():
        return read_nanogpt_meta(folder / "meta.pkl")["vocab_size"]
    recorded = 0 if headerless else max(shard_vocab(p) for p in shards)
    if recorded:
        return recorded
    if (folder / "tokenizer.json").is_file():
        return load_tokenizer(folder / "tokenizer.json").vocab_size
    largest = max(max_token_id(p, headerless) for p in shards)
    return max(GPT2_VOCAB, largest + 1) if headerless else largest + 1


def _meta_json_vocab(path: Path) -> int:
    try:
        vocab = json.loads(path.read_text())["vocab_size"]
    except (OSError, UnicodeError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a readable fastpt meta.json ({type(e).__name__}: {e})") from None
    if not isinstance(vocab, int) or not 0 < vocab <= MAX_VOCAB:
        raise DataError(f"{path}: vocab_size {vocab!r} is not a vocabulary size (1 to {MAX_VOCAB:,})")
    return vocab


def doc_token(folder: Path) -> int | None:
    """The token that starts every document (meta.json's eot_id, as fastpt.prepare records it); None
    when the folder has no meta.json or its tokenizer has no such token."""
    path = Path(folder) / "meta.json"
    if not path.is_file():
        return None
    try:
        eot = json.loads(path.read_text()).get("eot_id")
    except (OSError, UnicodeError, ValueError, AttributeError) as e:
        raise DataError(f"{path}: not a readable fastpt meta.json ({type(e).__name__}: {e})") from None
    if eot is not None and (not isinstance(eot, int) or isinstance(eot, bool) or eot < 0):
        raise DataError(f"{path}: eot_id {eot!r} is not a token id")
    return eot


def max_token_id(path: Path, headerless: bool) -> int:
    """Largest id in a shard, scanned in chunks; cached beside the shard by size and mtime."""
    cache = path.with_name(f".{path.name}.maxid")
    stat = path.stat()
    key = f"{stat.st_size}:{stat.st_mtime_ns}"
    if cache.is_file():
        saved_key, _, value = cache.read_text().partition(" ")
        if saved_key == key:
            return int(value)
    tokens = read_shard(path, headerless)
    chunk = 1 << 24
    largest = max((int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)
    with contextlib.suppress(OSError):  # a read-only data folder just isn't cached
        cache.write_text(f"{key} {largest}")
    return largest


def check_token_ids(shards: list[Path], vocab_size: int, headerless: bool) -> None:
    """Fail before training, naming the file and id, instead of a device-side assert in CUDA."""
    for p in shards:
        largest = max_token_id(p, headerless)
        if largest >= vocab_size:
            raise DataError(f"{p}: token id {largest} is out of range for vocab size {vocab_size}")
