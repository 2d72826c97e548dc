"""The kernels against the reference on a small random probe, forward and backward, where they are
about to run: a kernel that computes wrong on this device, dtype or shape, or fails to compile, is
found before it trains anything. Triton's interpreter cannot check a GPU's bf16 code, so the first
GPU run checks it itself (a trainer calls `failures` before its first step).

Each op runs as a trainer calls it: under autocast in the run's dtype, on activations and weights
in the dtype the parameters compute in, once with gradients (training's launches) and once without
(evaluation's). The probe keeps what picks the kernels' code: the hidden size, the dtype, and so
each kernel's tile; it narrows the rest. On a GPU ROWS rows, a multiple of 16 as a run's rows are,
so that Triton specializes the integer arguments as for the run (all but the RMSNorm backward's
rows per program), fewer under the interpreter; and the vocabulary cut to two tiles of the
cross-entropy kernel's sweep, a full one and then one as long as the run's last (ragged when the
run's is, with the same padding), so that the sweep's carry from tile to tile is checked too. The
standalone cross_entropy op is not probed: the model never calls it (its loss is linear +
cross-entropy, whose launches run the same kernel).

The oracle is the reference in float64; each result and input gradient must lie within TOLERANCE
(of the dtype) times the oracle's largest magnitude, the kernels' documented accuracy, or within
twice the reference's own error in the run's dtype where that is larger (bf16 rounding of a large
gradient is no kernel's fault).
"""

from collections.abc import Callable

import torch

from . import api

__all__ = ["TOLERANCE", "ROWS", "failures", "probe_vocab"]

# Relative to the oracle's largest magnitude: fp32 kernels agree to ~1e-5 (the margin covers the
# reductions' order), 16-bit ones to a rounding of their inputs and outputs.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# The probe's rows. On a GPU 16, as a run's rows are a multiple of 16, so that the probe's launches
# compile once for both (tests/test_aot.py); Triton's interpreter compiles nothing and pays per row
# (a program each), so 8 there. The first row is ignored (-100), as padding makes, the second
# targets the last logit.
ROWS, INTERPRETED_ROWS = 16, 8


def probe_vocab(vocab: int, dtype: torch.dtype) -> int:
    """The probe's vocabulary for a run's `vocab` whose logits are `dtype`: at most two tiles of the
    cross-entropy kernel's sweep, a full tile and then one as long as the run's last."""
    from .ops.cross_entropy import launch_plan  # imports triton: only where the kernels run

    block = launch_plan(vocab, dtype.itemsize)[1]
    return vocab if vocab <= 2 * block else block + (vocab - 1) % block + 1


def _probes(
    device: torch.device, dim: int, vocab: int, dtype: torch.dtype, eps: float, z_loss: float, softcap: float
) -> dict[str, tuple[Callable, dict[str, torch.Tensor], bool]]:
    """Each op the model calls, with its named inputs in `dtype` and whether it launches a kernel of
    its own without gradients (linear + cross-entropy's loss alone, evaluation's)."""
    rows = ROWS if device.type == "cuda" else INTERPRETED_ROWS
    gen = torch.Generator(device).manual_seed(0)
    randn = lambda *shape: torch.randn(shape, generator=gen, device=device).to(dtype)  # noqa: E731
    target = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    target[:2] = torch.tensor([-100, vocab - 1])
    return {
        "rms_norm": (lambda x, w, b: b(x, w, eps), {"input": randn(rows, dim), "weight": 1 + 0.1 * randn(dim)}, False),
        "linear_cross_entropy": (
            lambda x, w, b: b(x, w, target, z_loss=z_loss, softcap=softcap),
            {"input": randn(rows, dim), "weight": randn(vocab, dim) / dim**0.5},
            True,
        ),
    }


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference relative to the oracle's largest magnitude (inf for a nan or inf)."""
    diff = (actual.double() - expected).abs().max()
    return (diff / expected.abs().max().clamp_min(1e-30)).nan_to_num(float("inf")).item()


def _run(
    name: str, call: Callable, inputs: list[torch.Tensor], backend: str, dtype: torch.dtype, evaluation: bool
) -> list[torch.Tensor]:
    """The op's result under autocast to `dtype` with gradients (and without, for `evaluation`), and
    the gradient of each input for a fixed random upstream gradient."""
    op = lambda *a, **k: getattr(api, name)(*a, backend=backend, **k)  # noqa: E731
    leaves = [t.detach().requires_grad_() for t in inputs]  # new leaves over the same storage: nothing writes it
    autocast = lambda: torch.autocast(inputs[0].device.type, dtype, enabled=dtype != torch.float32)  # noqa: E731
    with autocast():
        out = call(*leaves, op)
        if evaluation:
            with torch.no_grad():
                alone = call(*inputs, op)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(upstream.to(out.device, out.dtype))
    return [out.detach(), *([alone] if evaluation else []), *(t.grad for t in leaves)]


def _check(
    name: str, call: Callable, inputs: dict[str, torch.Tensor], evaluation: bool, dtype: torch.dtype
) -> str | None:
    """What differs from the float64 oracle beyond the tolerance, or beyond twice the reference's
    own error in `dtype` where that is larger (the result, or which input's gradient); or why it did not run."""
    tensors = list(inputs.values())
    try:
        ours = _run(name, call, tensors, "triton", dtype, evaluation)
    except Exception as e:  # a kernel that fails to compile or launch here: any error Triton raises
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    oracle = _run(name, call, [t.double() for t in tensors], "torch", torch.float32, evaluation)
    whats = ["the result", *(["the result without gradients"] if evaluation else [])]
    whats += [f"the gradient of the {what}" for what in inputs]
    for i, (what, actual, want) in enumerate(zip(whats, ours, oracle)):
        if (worst := _worst(actual, want)) <= (rtol := TOLERANCE[dtype]):
            continue
        # Only now: what the dtype's rounding alone costs the reference, on the same inputs.
        limit = max(rtol, 2 * _worst(_run(name, call, tensors, "torch", dtype, evaluation)[i], want))
        if worst > limit:
            return f"{what} differs from the reference by {worst:.1e} of its largest value (tolerance {limit:.0e})"
    return None


def failures(
    dtype: torch.dtype,
    device: torch.device,
    dim: int,
    vocab: int,
    eps: float = 1e-6,
    z_loss: float = 0.0,
    params: torch.dtype = torch.float32,
    softcap: float = 0.0,
) -> dict[str, str]:
    """Each kernel (rms_norm, linear_cross_entropy: the cross-entropy kernel runs inside it) that
    fails its probe at hidden size `dim` and vocabulary `vocab` under autocast to `dtype`, with
    parameters and activations in `params`, on `device`, with what went wrong; empty when all pass.
    The loss is probed with the run's z_loss and logit soft-cap (a cap compiles a kernel of its own)."""
    found = {}
    for name, (call, inputs, evaluation) in _probes(
        device, dim, probe_vocab(vocab, dtype), params, eps, z_loss, softcap
    ).items():
        if why := _check(name, call, inputs, evaluation, dtype):
            found[name] = why
    return found
