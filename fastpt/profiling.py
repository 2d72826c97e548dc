"""What the training steps cost, seen from inside: --profile START:END traces (and CUDA memory
snapshots), the graphs torch.compile builds after warm-up, and CUDA graphs it skipped.

Trace files open in https://ui.perfetto.dev (or chrome://tracing) and in TensorBoard's profiler
plugin; memory snapshots in https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function

from fastpt.config import TrainConfig, profile_steps, uses_cuda_graphs


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def skipped_cuda_graphs() -> int:
    """Compiled graphs that Inductor ran without the CUDA graphs their mode asked for."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


class StepProbe:
    """Wraps each optimizer step (`with probe.step(n): ...`). Counts the graphs compiled after the
    first step of this process (recompiles: 0 when shapes and guards are stable), says once if CUDA
    graphs were asked for but skipped, and records steps START..END with torch.profiler into
    out_dir: a Chrome / TensorBoard trace per rank, and on CUDA a memory snapshot."""

    def __init__(self, cfg: TrainConfig, device: torch.device, rank: int = 0):
        self.steps, self.out_dir, self.device, self.rank = profile_steps(cfg), Path(cfg.out) / "profile", device, rank
        self.cuda_graphs = uses_cuda_graphs(cfg)
        self.warm = False  # past this process's first step, which compiles
        self.window_recompiles = 0
        self.profiler: profile | None = None

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Around optimizer step n (1-based, as the dashboard counts)."""
        if self.steps and n == self.steps[0]:
            self._start()
        graphs = compiled_graphs()
        with record_function(f"fastpt step {n}") if self.profiler else contextlib.nullcontext():
            yield
        if self.warm:
            self.window_recompiles += compiled_graphs() - graphs
        else:
            self.warm = True
            self._check_cuda_graphs()
        if self.profiler and n == self.steps[1]:
            self.close()
        elif self.profiler:
            self.profiler.step()  # PyTorch's own ProfilerStep#N ranges, which TensorBoard's plugin reads

    def recompiles(self) -> int:
        """Graphs compiled in training steps since the last call (the first step not counted)."""
        n, self.window_recompiles = self.window_recompiles, 0
        return n

    def close(self) -> None:
        """Stop the recording, if one runs, and write its files: after step END, or at the end of a
        run that stopped inside the window."""
        if self.profiler is None:
            return
        self.profiler.stop()
        name = f"rank{self.rank}_steps{self.steps[0]}-{self.steps[1]}"
        self.profiler.export_chrome_trace(str(self.out_dir / f"{name}.pt.trace.json"))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.out_dir / f"{name}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.profiler = None

    def _start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if self.device.type == "cuda":  # every allocation with its stack, for memory_viz
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        # with_stack off: Python stacks make the trace many times larger and slow the recorded steps.
        # A schedule (record every step) makes step() mark ProfilerStep#N ranges, numbered as ours.
        self.profiler = profile(
            activities=activities, record_shapes=True, with_stack=False, schedule=lambda _: ProfilerAction.RECORD
        )
        self.profiler.step_num = self.steps[0]
        self.profiler.start()

    def _check_cuda_graphs(self) -> None:
        skipped = skipped_cuda_graphs() if self.cuda_graphs else 0
        if skipped and self.rank == 0:
            why = "they need a CUDA device" if self.device.type != "cuda" else "TORCH_LOGS=perf_hints says why"
            print(
                f"fastpt: warning: the compile mode asks for CUDA graphs, but torch.compile ran {skipped} "
                f"graph(s) without them ({why})",
                file=sys.stderr,
                flush=True,
            )
