"""AdamW in two parameter groups and the seed's warmup + cosine learning-rate curve."""
from __future__ import annotations

import math

import torch
import torch.nn as nn


def lr_at(step: int, peak_lr: float, warmup_steps: int, max_steps: int, min_ratio: float = 0.1) -> float:
    """Linear warmup from 0 to peak, cosine decay to min_ratio * peak, flat after max_steps."""
    if step < warmup_steps:
        return peak_lr * step / max(1, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak_lr * (min_ratio + (1 - min_ratio) * cosine)


def is_decayed(name: str, p: torch.Tensor, rule: str) -> bool:
    """ndim: decay every tensor with >= 2 dims. strict: also spare biases, norms and embeddings."""
    if rule == "ndim":
        return p.dim() >= 2
    if rule == "strict":
        lowered = name.lower()
        return p.dim() >= 2 and not (name.endswith(".bias") or "norm" in lowered or "emb" in lowered)
    raise ValueError(f"decay rule must be 'ndim' or 'strict', got {rule!r}")


def param_groups(model: nn.Module, weight_decay: float, rule: str = "ndim") -> list[dict]:
    """The two AdamW groups: [decayed, not decayed]; frozen parameters are left out."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if is_decayed(name, p, rule) else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, weight_decay: float, rule: str, lr: float,
                    betas: tuple[float, float], eps: float) -> torch.optim.AdamW:
    """AdamW, fused into one kernel per step on devices where torch has it."""
    device = next(model.parameters()).device.type
    fused = device in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, weight_decay, rule), lr=lr, betas=betas,
                             eps=eps, fused=fused, foreach=None if fused else True)
