"""Pure-PyTorch reference ops: the CPU fallback and the oracle for the Triton kernels."""

import torch
import torch.nn.functional as F


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """At least fp32; fp64 stays fp64 so the reference can serve as a float64 oracle."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def reduce_rows(rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """Per-row losses (0 on ignored rows) reduced as F.cross_entropy does: "mean" over the counted
    rows (0 / 0 = nan when none counts), "sum", or "none"."""
    if reduction == "none":
        return rows
    return rows.sum() / (target != ignore_index).sum() if reduction == "mean" else rows.sum()


def row_scale(target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """d reduce_rows / d row of a counted row, 0-dim fp32, without a host sync: 1/n_counted for
    "mean" (1 if no row counts: every gradient is 0 then), else 1."""
    if reduction == "mean":
        return 1.0 / (target != ignore_index).sum().clamp(min=1).float()
    return torch.ones((), dtype=torch.float32, device=target.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in (at least) fp32, output in x's dtype."""
    xf = _upcast(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight).to(x.dtype)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping); the logits as they are for cap 0."""
    return cap * torch.tanh(logits / cap) if cap else logits


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of logits (N, V) against target (N,), computed in (at least) fp32, plus the
    z-loss z_loss * logsumexp(logits)^2 of each counted row, reduced alike; with return_z_loss,
    (loss, z-loss term alone, detached). softcap > 0: of the logits soft_cap(logits, softcap)."""
    logits = soft_cap(_upcast(logits), softcap)
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    if not (z_loss or return_z_loss):
        return loss
    z_rows = torch.where(target != ignore_index, z_loss * logits.logsumexp(-1).square(), 0.0)
    z = reduce_rows(z_rows, target, ignore_index, reduction)
    loss = loss + z
    return (loss, z.detach()) if return_z_loss else loss


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy(input @ weight.T, target, ...); input (N, D), weight (V, D)."""
    logits = F.linear(input, weight)  # (N, V)
    return cross_entropy(
        logits, target, ignore_index, reduction, z_loss=z_loss, return_z_loss=return_z_loss, softcap=softcap
    )
