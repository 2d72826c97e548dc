"""The kernels against the reference on a small random probe, forward and backward, where they are
about to run: a kernel that computes wrong on this device, dtype or shape, or fails to compile, is
found before it trains anything. Triton's interpreter cannot check a GPU's bf16 code, so the first
GPU run checks it itself (a trainer calls `failures` before its first step).

The oracle is the reference in float64; each result and input gradient must lie within TOLERANCE
(of the dtype) times the oracle's largest magnitude, the kernels' documented accuracy, or within
twice the reference's own error in the run's dtype where that is larger (bf16 rounding of a large
gradient is no kernel's fault).
"""

from collections.abc import Callable

import torch

from . import api

__all__ = ["TOLERANCE", "failures"]

# Relative to the oracle's largest magnitude: fp32 kernels agree to ~1e-5 (the margin covers the
# reductions' order), 16-bit ones to a rounding of their inputs and outputs.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
ROWS = 8  # the probe's rows: every program shape the kernels pick for a row, a few microseconds each


def _probes(
    dtype: torch.dtype, device: torch.device, dim: int, vocab: int, eps: float, z_loss: float
) -> dict[str, tuple[Callable, list[torch.Tensor]]]:
    """Each op as the trainer calls it (activations in the run's dtype, weights fp32 as parameters
    are), with its inputs."""
    gen = torch.Generator(device).manual_seed(0)
    randn = lambda *shape, dtype=dtype: torch.randn(shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
    target = torch.randint(0, vocab, (ROWS,), generator=gen, device=device)
    target[0] = -100  # an ignored row, as padding makes
    loss = dict(z_loss=z_loss, return_z_loss=False)
    return {
        "rms_norm": (lambda x, w, b: b(x, w, eps), [randn(ROWS, dim), 1 + 0.1 * randn(dim, dtype=torch.float32)]),
        "cross_entropy": (lambda x, b: b(x, target, **loss), [3 * randn(ROWS, vocab)]),
        "linear_cross_entropy": (
            lambda x, w, b: b(x, w, target, **loss),
            [randn(ROWS, dim), randn(vocab, dim, dtype=torch.float32) / dim**0.5],
        ),
    }


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference relative to the oracle's largest magnitude (inf for a nan or inf)."""
    diff = (actual.double() - expected).abs().max()
    return (diff / expected.abs().max().clamp_min(1e-30)).nan_to_num(float("inf")).item()


def _run(name: str, call: Callable, inputs: list[torch.Tensor], backend: str) -> list[torch.Tensor]:
    """The op's result and the gradient of each input for a fixed random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = call(*leaves, lambda *a, **k: getattr(api, name)(*a, backend=backend, **k))
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(upstream.to(out.device, out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _check(name: str, call: Callable, inputs: list[torch.Tensor], rtol: float) -> str | None:
    """What differs from the float64 oracle beyond `rtol`, or beyond twice the reference's own error
    in the run's dtype where that is larger (the forward, or which input's gradient); or why it did not run."""
    try:
        ours = _run(name, call, inputs, "triton")
    except Exception as e:  # a kernel that fails to compile or launch here: any error Triton raises
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    oracle = _run(name, call, [t.double() for t in inputs], "torch")
    whats = ["the result", *(f"the gradient of input {i}" for i in range(len(inputs)))]
    for i, (what, actual, want) in enumerate(zip(whats, ours, oracle)):
        if (worst := _worst(actual, want)) <= rtol:
            continue
        # Only now: what the dtype's rounding alone costs the reference (all inputs in it, as autocast has them).
        limit = max(rtol, 2 * _worst(_run(name, call, [t.to(actual.dtype) for t in inputs], "torch")[i], want))
        if worst > limit:
            return f"{what} differs from the reference by {worst:.1e} of its largest value (tolerance {limit:.0e})"
    return None


def failures(
    dtype: torch.dtype, device: torch.device, dim: int, vocab: int, eps: float = 1e-6, z_loss: float = 0.0
) -> dict[str, str]:
    """Each kernel (rms_norm, cross_entropy, linear_cross_entropy) that fails its probe at hidden size
    `dim` and vocabulary `vocab` in `dtype` on `device`, with what went wrong; empty when all pass."""
    rtol = TOLERANCE[dtype]
    found = {}
    for name, (call, inputs) in _probes(dtype, device, dim, vocab, eps, z_loss).items():
        if why := _check(name, call, inputs, rtol):
            found[name] = why
    return found
