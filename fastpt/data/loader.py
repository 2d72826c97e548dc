"""The resumable training loader: a seeded per-epoch permutation of windows striped over
micro-steps and ranks, fed from a background thread through pinned memory; eval batches."""

from __future__ import annotations

import atexit
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from fastpt.data.windows import Mixture, WindowSet
from fastpt.errors import DataError


@dataclass
class Batch:
    x: torch.Tensor  # (B, T) inputs
    y: torch.Tensor  # (B, T) targets, x shifted by one
    source: torch.Tensor | None = None  # (B,) validation: the mixture's source of each row (0 for one source)


class TrainLoader:
    """Seeded per-epoch permutation of windows, striped over micro-steps and ranks.

    Optimizer step s consumes global windows [s*G, (s+1)*G) of the permuted stream,
    G = micro_batch * grad_accum * world_size, so any split of G sees the same data.
    The only state is the position in that stream (plus the seed).
    """

    def __init__(
        self,
        windows: WindowSet,
        micro_batch: int,
        seed: int,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
    ):
        self.windows, self.micro_batch, self.seed = windows, micro_batch, seed
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.prefetch = prefetch
        self.position = 0  # micro-steps handed out so far (each covers world_size micro-batches)
        self.wait_s = 0.0  # time spent blocked on the prefetch queue, for data-wait %
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _positions(self, micro_step: int) -> np.ndarray:
        first = (micro_step * self.world_size + self.rank) * self.micro_batch
        return np.arange(first, first + self.micro_batch)

    def _produce(self, start: int, q: queue.Queue, stop: threading.Event) -> None:
        """Build batches in order from micro-step `start`; contiguous (and pinned for CUDA) here,
        off the training thread, so the step only issues two non-blocking copies. An error is
        queued too: the training thread raises it instead of waiting forever."""
        pin = self.device.type == "cuda"
        step = start
        while not stop.is_set():
            try:
                w = self.windows.draw(self._positions(step), self.seed)  # (B, T+1)
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
        self._thread = threading.Thread(
            target=self._produce, args=(self.position, self._queue, self._stop), daemon=True
        )
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
        return {
            "windows_consumed": self.position * self.world_size * self.micro_batch,
            "seed": self.seed,
            "num_windows": len(self.windows),
            "mixture": self.windows.composition(),
        }

    def load_state_dict(self, state: dict) -> None:
        check_same_mixture(state["mixture"], self.windows.composition())
        if state["num_windows"] != len(self.windows):
            raise DataError(
                f"checkpoint's loader saw {state['num_windows']} windows, the data now has "
                f"{len(self.windows)}: resume with the same data, seq_len and packing"
            )
        per_micro = self.world_size * self.micro_batch
        if state["windows_consumed"] % per_micro:
            raise DataError(
                f"checkpoint position {state['windows_consumed']} windows is not a multiple of "
                f"micro_batch x world_size = {per_micro}"
            )
        self.close()
        self.seed = state["seed"]
        self.position = state["windows_consumed"] // per_micro


def describe_mixture(composition: list[dict] | None) -> str:
    if composition is None:
        return "one dataset"
    block = sum(part["quota"] for part in composition)
    return " + ".join(f"{p['folder']} {p['quota'] / block:.1%} ({p['windows']:,} windows)" for p in composition)


def check_same_mixture(saved: list[dict] | None, now: list[dict] | None) -> None:
    """A resumed mixture must draw as the checkpoint's did: other shares or sources would remap every
    later position of the stream. Folders may move; the shares and the sources' sizes may not."""

    def shape(composition):
        return composition and [(p["quota"], p["windows"]) for p in composition]

    if shape(saved) != shape(now):
        raise DataError(
            f"the checkpoint's mixture is {describe_mixture(saved)}, --data now gives {describe_mixture(now)}: "
            "resume with the checkpoint's sources and weights (a mixture cannot change mid-run)"
        )


def eval_batches(
    windows: WindowSet, micro_batch: int, eval_tokens: int, device: torch.device, rank: int = 0, world_size: int = 1
):
    """The first eval_tokens of the validation windows, in order: the same every evaluation and
    for any world size, each row with its source (a mixture's part). Ranks take every
    world_size-th window; FSDP ranks must run the same forwards, so a rank that runs out repeats
    window 0 with its targets ignored (-100)."""
    n = min(len(windows), max(1, eval_tokens // windows.seq_len))
    mine = np.arange(rank, n, world_size)
    padding = -(-n // world_size) - len(mine)
    indices = np.concatenate((mine, np.zeros(padding, dtype=mine.dtype)))
    for i in range(0, len(indices), micro_batch):
        chunk = indices[i : i + micro_batch]
        w = windows.gather(chunk).to(device)  # (B, T+1)
        x, y = w[:, :-1], w[:, 1:].clone()
        y[max(0, len(mine) - i) :] = -100  # the padding rows count for nothing
        source = windows.sources(chunk) if isinstance(windows, Mixture) else np.zeros_like(chunk)
        yield Batch(x, y, torch.from_numpy(source).to(device))
