"""Pure-PyTorch reference ops: the CPU fallback and the oracle for the Triton kernels."""
import torch
import torch.nn.functional as F


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """At least fp32; fp64 stays fp64 so the reference can serve as a float64 oracle."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in (at least) fp32, output in x's dtype."""
    xf = _upcast(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight).to(x.dtype)


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of logits (N, V) against target (N,), computed in (at least) fp32."""
    return F.cross_entropy(_upcast(logits), target, ignore_index=ignore_index, reduction=reduction)


def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """cross_entropy(input @ weight.T, target); input (N, D), weight (V, D)."""
    logits = F.linear(input, weight)  # (N, V)
    return cross_entropy(logits, target, ignore_index, reduction)
