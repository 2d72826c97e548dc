"""pytest-benchmark: one optimizer step per round, per mode; tiny preset on CPU, 0.04b on GPU.

The warm-up rounds absorb torch.compile; each round ends in a device sync.
"""

from __future__ import annotations

import pytest
import torch

from bench.common import cpu_threads, sync
from bench.suite import median_s, needs_cuda, record
from bench.train_step import BATCH, Setup, build, parse_mode
from fastpt.metrics import peak_mem_gib
from fastpt.presets import PRESETS


def bench_step(benchmark, setup: Setup, mode_name: str, rounds: int) -> None:
    device = torch.device(setup.device)
    with cpu_threads(setup.threads):
        run_rounds(benchmark, setup, mode_name, rounds, device)


def run_rounds(benchmark, setup: Setup, mode_name: str, rounds: int, device: torch.device) -> None:
    torch._dynamo.reset()  # a fresh compile: earlier tests' models must not count against its cache
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = build(setup, parse_mode(mode_name))

    def step() -> torch.Tensor:
        loss = run.step()
        sync(device)
        return loss

    loss = benchmark.pedantic(step, rounds=rounds, warmup_rounds=2, iterations=1)
    run.loader.close()
    median = median_s(benchmark)
    peak = peak_mem_gib(device)
    record(
        benchmark,
        device,
        mode=mode_name,
        preset=setup.preset,
        dtype=setup.dtype,
        shape=[setup.micro_batch, setup.seq_len, setup.grad_accum],
        loss=loss.item(),
        tok_s=run.tokens_per_step / median if median else None,
        # CPU: the whole pytest process's peak RSS (ru_maxrss never goes down)
        peak_mem_gib=peak,
    )
    assert torch.isfinite(loss)


def setup_for(preset: str, device: str, dtype: str, data) -> Setup:
    micro_batch, grad_accum = BATCH[preset]
    # one CPU thread: steadier on a shared machine, and the same as the CI table
    return Setup(
        preset,
        device,
        micro_batch,
        grad_accum,
        PRESETS[preset].max_seq_len,
        dtype,
        str(data),
        threads=1 if device == "cpu" else 0,
    )


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_train_step_cpu(benchmark, bench_data, mode):
    bench_step(benchmark, setup_for("tiny", "cpu", "fp32", bench_data), mode, rounds=3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["eager", "compiled", "compiled+kernels", "baseline"])
def test_train_step_gpu(benchmark, bench_data, mode):
    # the shapes of `python -m bench` on 0.04b, so Inductor's on-disk cache is warm after it
    bench_step(benchmark, setup_for("0.04b", "cuda", "bf16", bench_data), mode, rounds=10)
