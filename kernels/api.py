"""fastpt.kernels' public ops (`from fastpt.kernels import api as kernels`): each picks the Triton kernel or
the pure-PyTorch reference per call.

Every op takes ``backend``: "auto" runs the Triton kernels on CUDA tensors and the reference on
CPU tensors, unless TRITON_INTERPRET=1 is set, which runs the kernels on CPU through Triton's
interpreter; "triton" forces the kernels (an error where they cannot run); "torch" the reference
(linear_cross_entropy: the reference's result chunked over rows, kernels.chunked).
Inside ``tracing_only()``, "triton" picks the kernels' ops on any tensor, for tracing their
registered fakes (a memory plan of a GPU run on a machine that cannot run them).
"""

import contextlib
import importlib.util
import math
import os

import torch

from . import chunked, functional, reference

__all__ = ["rms_norm", "cross_entropy", "linear_cross_entropy", "available", "interpreting", "tracing_only"]

BACKENDS = ("auto", "triton", "torch")
REDUCTIONS = ("mean", "sum", "none")
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_tracing_only = False


@contextlib.contextmanager
def tracing_only():
    """While inside, backend="triton" selects the Triton ops whatever this machine can run: only
    for tensors that never run them (fake tensors), whose shapes the ops' fakes give."""
    global _tracing_only
    before, _tracing_only = _tracing_only, True
    try:
        yield
    finally:
        _tracing_only = before


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for the kernels to run through Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def available() -> bool:
    """Whether the Triton kernels can run here: Triton installed, and a CUDA device or TRITON_INTERPRET=1."""
    return _HAS_TRITON and (torch.cuda.is_available() or interpreting())


def _use_triton(backend: str, t: torch.Tensor) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if _tracing_only and backend == "triton":
        return True
    # CUDA is checked first so torch.compile never traces the environment lookup on GPU.
    runnable = _HAS_TRITON and (t.is_cuda or interpreting())
    if backend == "triton" and not runnable:
        why = "Triton is not installed" if not _HAS_TRITON else f"{t.device} tensors need TRITON_INTERPRET=1"
        raise RuntimeError(f"backend='triton' cannot run: {why}")
    return runnable


def _check_loss_args(reduction: str, softcap: float, **matrices: torch.Tensor) -> None:
    """The same refusals on every backend: the reference would broadcast what the kernels reject."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    for name, t in matrices.items():
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, backend: str = "auto") -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight over the last dim; output in x's dtype."""
    impl = functional if _use_triton(backend, x) else reference
    return impl.rms_norm(x, weight, eps)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    inplace_backward: bool = False,
    softcap: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of logits (N, V) against target (N,), as F.cross_entropy; fp32 loss.

    z_loss adds z_loss * logsumexp(logits)^2 per counted row, reduced like the loss (PaLM's
    stabilizer); return_z_loss=True returns (loss, that term alone, detached). inplace_backward=True
    lets the Triton path's backward overwrite the logits with their gradient (one (N, V) buffer, not
    two): do not read logits after the backward. The reference ignores it. softcap > 0 computes all
    of it on the logits softcap * tanh(logits / softcap) (Gemma 2's final_logit_softcapping), in fp32.
    """
    _check_loss_args(reduction, softcap, logits=logits)
    kwargs = dict(z_loss=z_loss, return_z_loss=return_z_loss, softcap=float(softcap))
    if not _use_triton(backend, logits):
        return reference.cross_entropy(logits, target, ignore_index, reduction, **kwargs)
    return functional.cross_entropy(
        logits, target, ignore_index, reduction, inplace_backward=inplace_backward, **kwargs
    )


def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    softcap: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy(input @ weight.T, target, ...), input (N, D), weight (V, D); fp32 loss, z_loss,
    return_z_loss and softcap as in cross_entropy. Neither path materializes the (N, V) logits,
    capped or not: the Triton kernels, or "torch"'s chunked PyTorch (kernels.chunked; the unchunked
    reference.linear_cross_entropy is the tests' oracle)."""
    _check_loss_args(reduction, softcap, input=input, weight=weight)
    impl = functional if _use_triton(backend, input) else chunked
    return impl.linear_cross_entropy(
        input,
        weight,
        target,
        ignore_index,
        reduction,
        z_loss=z_loss,
        return_z_loss=return_z_loss,
        softcap=float(softcap),
    )
