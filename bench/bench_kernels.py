"""pytest-benchmark: forward + backward of each kernel provider (small fp32 on CPU, bf16 on GPU)."""

from __future__ import annotations

import pytest
import torch

from bench.common import cpu_threads, sync
from bench.kernel_table import SHAPES, extra_gib, fwd_bwd, grads, make_inputs, max_rel_err, oracle, providers
from bench.suite import median_s, needs_cuda, record

PEERS = {
    "rms_norm": ["F.rms_norm", "liger"],
    "cross_entropy": ["liger"],
    "linear_cross_entropy": ["liger", "F.linear_cross_entropy"],
}
VARIANTS = {"cross_entropy": ["fastpt-inplace"]}  # fastpt's own options, as kernel_table.providers names them
GPU_CASES = [(op, p) for op in SHAPES for p in ["torch", "torch.compile", "fastpt", *VARIANTS.get(op, []), *PEERS[op]]]


def bench_kernel(benchmark, op: str, provider: str, device: torch.device, dtype: torch.dtype, rounds: int) -> dict:
    """Times forward + backward of one provider and records it; returns what it recorded."""
    available = providers(op, device)
    if provider not in available:
        pytest.skip(f"{provider} is not available here")
    fn, shape = available[provider], SHAPES[op][device.type != "cuda"]
    args = make_inputs(op, shape, device, dtype)

    def call() -> None:
        fwd_bwd(fn, args)
        sync(device)

    with cpu_threads(1 if device.type == "cpu" else 0):  # as the train-step suite: steady on a shared CPU
        benchmark.pedantic(call, rounds=rounds, warmup_rounds=3, iterations=1)
    median = median_s(benchmark)
    fresh = make_inputs(op, shape, device, dtype)  # the timed ones may hold gradients written over them
    want = oracle(op, make_inputs(op, shape, device, dtype), dtype)
    info = {
        "op": op,
        "provider": provider,
        "shape": list(shape),
        "dtype": str(dtype),
        "ms": 1e3 * median if median else None,
        "extra_gib": extra_gib(call, device),
        "rel_err": max_rel_err(grads(fwd_bwd(fn, fresh), fresh), want),
    }
    record(benchmark, device, **info)
    return info


@pytest.mark.parametrize("provider", ["torch", "fastpt"])
@pytest.mark.parametrize("op", list(SHAPES))
def test_kernel_cpu(benchmark, op, provider):
    """What it records holds: a positive time (when timing is on), no memory figure on a CPU, and
    output and gradients within fp32 rounding of the float64 reference."""
    info = bench_kernel(benchmark, op, provider, torch.device("cpu"), torch.float32, rounds=5)
    assert info["ms"] is None or info["ms"] > 0
    assert info["extra_gib"] is None and info["rel_err"] < 1e-5
    assert benchmark.extra_info["rel_err"] == info["rel_err"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op,provider", GPU_CASES)
def test_kernel_gpu(benchmark, op, provider):
    bench_kernel(benchmark, op, provider, torch.device("cuda"), torch.bfloat16, rounds=50)
