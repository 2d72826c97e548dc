"""Pure-PyTorch reference ops: the CPU fallback and the oracle for the Triton kernels."""
import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32, output in x's dtype."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy over the last dim, computed in fp32."""
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)


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
