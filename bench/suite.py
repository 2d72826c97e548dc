"""Helpers for the pytest-benchmark suites (bench_*.py)."""

from __future__ import annotations

import pytest
import torch

from bench.common import env_info

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def median_s(benchmark) -> float | None:
    """The timed rounds' median, or None when pytest-benchmark is disabled (one plain call)."""
    stats = getattr(benchmark, "stats", None)
    return stats.stats.median if stats else None


def record(benchmark, device: torch.device, **info) -> None:
    """extra_info every stored result carries: device, versions, commit, plus the caller's fields."""
    env = env_info(device)
    benchmark.extra_info.update({k: env[k] for k in ("device_name", "torch", "triton", "commit")}, **info)
