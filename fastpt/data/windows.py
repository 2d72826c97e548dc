"""Windows of seq_len + 1 tokens over memory-mapped shards, as the loader draws them: cut from the
stream (concat), starting at documents and packed best-fit (bos), or a weighted mixture of sets."""

from __future__ import annotations

import bisect
import itertools
import math
from pathlib import Path

import numpy as np
import torch

from fastpt.data.shards import read_shard
from fastpt.errors import DataError

BEST_FIT_BUFFER = 1000  # documents --packing bos chooses among for each window, as nanochat's
MIX_BLOCK = 1000  # stream positions per mixture block: each block holds every source at its share


def permuted(n: int, positions: np.ndarray, seed: tuple[int, ...], cache: dict) -> np.ndarray:
    """Stream positions -> indices of n windows: a seeded permutation per epoch (no replacement).
    `cache` keeps the latest epoch's permutation."""
    epochs = positions // n
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        key = (*seed, int(epoch))
        if key not in cache:
            cache.clear()
            cache[key] = np.random.default_rng(list(key)).permutation(n)
        mask = epochs == epoch
        out[mask] = cache[key][positions[mask] % n]
    return out


class WindowSet:
    """What the loader needs of a set of windows: len(), gather(indices) and draw(positions, *seed)."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self._perms: dict = {}  # the latest epoch's permutation, by (seed..., epoch)

    def draw(self, positions: np.ndarray, *seed: int) -> torch.Tensor:
        """The windows at these positions of the shuffled stream -> (len(positions), seq_len + 1)."""
        return self.gather(permuted(len(self), positions, seed, self._perms))

    def composition(self) -> list[dict] | None:
        """What a mixture draws from, per source (folder, windows per block, windows); None for one set."""
        return None


class Windows(WindowSet):
    """Non-overlapping windows of seq_len + 1 tokens over a list of memory-mapped shards."""

    def __init__(self, shards: list[Path], seq_len: int, headerless: bool = False):
        super().__init__(seq_len)
        self.shards = shards
        self.tokens = [read_shard(p, headerless) for p in shards]
        per_shard = np.array([len(t) // (seq_len + 1) for t in self.tokens], dtype=np.int64)
        if per_shard.sum() == 0:
            longest = max(len(t) for t in self.tokens)
            raise DataError(
                f"seq_len {seq_len} is longer than the data: the longest shard "
                f"({shards[int(np.argmax([len(t) for t in self.tokens]))]}) has {longest} tokens"
            )
        self.starts = np.concatenate(([0], np.cumsum(per_shard)))  # window index where each shard begins

    def __len__(self) -> int:
        return int(self.starts[-1])

    def gather(self, indices: np.ndarray) -> torch.Tensor:
        """Windows by global index -> (len(indices), seq_len + 1) int64."""
        span = self.seq_len + 1
        shard_ids = np.searchsorted(self.starts, indices, side="right") - 1
        rows = [
            self.tokens[s][(i - self.starts[s]) * span : (i - self.starts[s] + 1) * span]
            for s, i in zip(shard_ids, indices)
        ]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def document_starts(tokens: np.ndarray, doc_id: int, chunk: int = 1 << 24) -> np.ndarray:
    """Offsets of every document token in a shard, scanned in chunks so memory stays bounded."""
    found = [np.flatnonzero(tokens[i : i + chunk] == doc_id) + i for i in range(0, len(tokens), chunk)]
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)


def best_fit(lengths: list[int], span: int, buffer: int) -> tuple[list[int], list[int], list[int]]:
    """Pack documents shorter than span into rows of exactly span tokens (nanochat's best-fit):
    each row takes the longest buffered document that still fits; when none does, the shortest,
    cropped to fill the row. Returns (document, tokens taken) per segment and each row's end
    segment; an unfilled last row is left out."""
    pool: list[tuple[int, int]] = []  # (length, document), sorted
    upcoming = iter(enumerate(lengths))
    seg_doc, seg_take, row_ends = [], [], []
    while True:
        left = span
        while left:
            for doc, n in itertools.islice(upcoming, buffer - len(pool)):
                bisect.insort(pool, (n, doc))
            if not pool:
                end = row_ends[-1] if row_ends else 0
                return seg_doc[:end], seg_take[:end], row_ends
            n, doc = pool.pop(max(bisect.bisect_right(pool, (left, math.inf)) - 1, 0))
            seg_doc.append(doc)
            seg_take.append(min(n, left))
            left -= seg_take[-1]
        row_ends.append(len(seg_doc))


class BosWindows(WindowSet):
    """Windows of seq_len + 1 tokens that each start at a document token (--packing bos): a document
    at least that long gives one window of its first tokens, shorter ones are packed best-fit.
    `dropped` is the fraction of the shards' tokens no window holds (cropped tails, and the
    first partial document of a shard that starts mid-document)."""

    def __init__(self, shards: list[Path], seq_len: int, doc_id: int, headerless: bool = False):
        super().__init__(seq_len)
        self.shards = shards
        self.tokens = [read_shard(p, headerless) for p in shards]
        span = seq_len + 1
        starts = [document_starts(t, doc_id) for t in self.tokens]
        if not sum(map(len, starts)):
            raise DataError(f"{shards[0].parent}: no document token (id {doc_id}) in its shards for --packing bos")
        shard_of = np.concatenate([np.full(len(s), i) for i, s in enumerate(starts)])
        begin = np.concatenate(starts)
        length = np.concatenate([np.diff(s, append=len(t)) for s, t in zip(starts, self.tokens)])
        long, short = np.flatnonzero(length >= span), np.flatnonzero(length < span)
        seg_doc, seg_take, row_ends = best_fit(length[short].tolist(), span, BEST_FIT_BUFFER)
        docs = np.concatenate((long, short[np.array(seg_doc, dtype=np.int64)]))
        self.seg_shard, self.seg_begin = shard_of[docs], begin[docs]
        self.seg_take = np.concatenate((np.full(len(long), span), seg_take)).astype(np.int64)
        self.row_start = np.concatenate(([0], np.arange(1, len(long) + 1), len(long) + np.array(row_ends, np.int64)))
        if len(self) == 0:
            raise DataError(
                f"seq_len {seq_len} is longer than the data: {shards[0].parent} has {sum(map(len, self.tokens))} tokens"
            )
        self.dropped = 1 - len(self) * span / sum(map(len, self.tokens))

    def __len__(self) -> int:
        return len(self.row_start) - 1

    def gather(self, indices: np.ndarray) -> torch.Tensor:
        """Windows by index -> (len(indices), seq_len + 1) int64, each the concatenation of its segments."""
        rows = [
            np.concatenate(
                [
                    self.tokens[self.seg_shard[j]][self.seg_begin[j] : self.seg_begin[j] + self.seg_take[j]]
                    for j in range(self.row_start[w], self.row_start[w + 1])
                ]
            )
            for w in indices
        ]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def quotas(weights: list[float], total: int) -> np.ndarray:
    """Integer shares of `total` in proportion to weights (largest remainder) that sum to `total`,
    each at least 1: a source too small for one window of `total` still gets one, taken from the
    sources that hold more than one. More sources than `total` is a DataError."""
    if len(weights) > total:
        raise DataError(f"'data' names {len(weights)} sources; a mixture takes at most {total}")
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    quota = np.maximum(1, np.floor(exact)).astype(np.int64)
    while quota.sum() < total:
        quota[np.argmax(exact - quota)] += 1
    while quota.sum() > total:  # the forced ones: give back from the sources most over their share
        quota[np.argmax(np.where(quota > 1, quota - exact, -np.inf))] -= 1
    return quota


class Mixture(WindowSet):
    """Several window sets sampled by weight: every block of MIX_BLOCK stream positions holds each
    source at its quota, in a seeded order; each source walks its own shuffled epochs, so a small
    source with a large weight repeats sooner. Position -> (source, draw) is arithmetic, so resume
    and rank striping work as for one source. One epoch = the positions before any source repeats."""

    def __init__(self, parts: list[WindowSet], weights: list[float]):
        super().__init__(parts[0].seq_len)
        self.parts = parts
        self.quota = quotas(weights, MIX_BLOCK)
        self.shares = self.quota / MIX_BLOCK
        self.epoch_len = max(1, int(min(len(p) / s for p, s in zip(parts, self.shares))))
        self._blocks: dict = {}

    def __len__(self) -> int:
        return self.epoch_len

    def composition(self) -> list[dict]:
        return [
            {"folder": str(part.shards[0].parent), "quota": int(q), "windows": len(part)}
            for part, q in zip(self.parts, self.quota)
        ]

    def _route(self, positions: np.ndarray, seed: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions -> (source, how many draws that source had before)."""
        source, local = np.empty_like(positions), np.empty_like(positions)
        for block in np.unique(positions // MIX_BLOCK):
            key = (*seed, int(block))
            if key not in self._blocks:
                order = np.random.default_rng([*key, len(self.parts)]).permutation(
                    np.repeat(np.arange(len(self.parts)), self.quota)
                )
                rank = np.empty_like(order)
                for k, q in enumerate(self.quota):
                    rank[order == k] = np.arange(q)
                self._blocks = {key: (order, rank)}
            order, rank = self._blocks[key]
            mask = positions // MIX_BLOCK == block
            offsets = positions[mask] % MIX_BLOCK
            source[mask] = order[offsets]
            local[mask] = block * self.quota[order[offsets]] + rank[offsets]
        return source, local

    def _rows(self, positions: np.ndarray, seed: tuple[int, ...], shuffled: bool) -> torch.Tensor:
        source, local = self._route(positions, seed)
        out = torch.empty(len(positions), self.seq_len + 1, dtype=torch.int64)
        for k in np.unique(source):
            mask, part = source == k, self.parts[k]
            rows = part.draw(local[mask], *seed, int(k)) if shuffled else part.gather(local[mask] % len(part))
            out[torch.from_numpy(mask)] = rows
        return out

    def draw(self, positions: np.ndarray, *seed: int) -> torch.Tensor:
        return self._rows(positions, seed, shuffled=True)

    def gather(self, indices: np.ndarray) -> torch.Tensor:
        """Validation: the same interleaving every time, each source's windows in order."""
        return self._rows(indices, (), shuffled=False)

    def sources(self, indices: np.ndarray) -> np.ndarray:
        """Which part each of gather(indices)'s windows comes from."""
        return self._route(indices, ())[0]
