"""AdamW in two parameter groups (optionally Muon for the blocks' matrices beside them) and the
learning-rate schedules: the seed's warmup + cosine, warmup-stable-decay and linear."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from fastpt.config import TrainConfig


def lr_at(step: int, peak_lr: float, warmup_steps: int, max_steps: int, min_ratio: float = 0.1) -> float:
    """Linear warmup from 0 to peak, cosine decay to min_ratio * peak, flat after max_steps."""
    if step < warmup_steps:
        return peak_lr * step / max(1, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak_lr * (min_ratio + (1 - min_ratio) * cosine)


def lr_schedule(
    schedule: str,
    step: int,
    peak_lr: float,
    warmup_steps: int,
    max_steps: int,
    min_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """The LR at `step` (0-based): cosine is lr_at; wsd holds the peak after warmup, then decays
    linearly to min_ratio * peak over the last decay_fraction of max_steps; linear decays linearly
    from the end of warmup. Warmup is lr_at's in all three; flat at the floor after max_steps."""
    if schedule == "cosine":
        return lr_at(step, peak_lr, warmup_steps, max_steps, min_ratio)
    if schedule not in ("wsd", "linear"):
        raise ValueError(f"schedule must be 'cosine', 'wsd' or 'linear', got {schedule!r}")
    if step < warmup_steps:
        return peak_lr * step / max(1, warmup_steps)
    decay_steps = max_steps - warmup_steps if schedule == "linear" else round(decay_fraction * max_steps)
    decay_start = max(warmup_steps, max_steps - decay_steps)
    progress = min(1.0, max(0, step - decay_start) / max(1, max_steps - decay_start))
    return peak_lr * (1 - (1 - min_ratio) * progress)


def run_lr(cfg: TrainConfig, step: int) -> float:
    """The LR of the run's schedule (--schedule, --lr, --warmup-steps, ...) at `step`."""
    return lr_schedule(
        cfg.schedule, step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, cfg.decay_fraction
    )


def is_decayed(name: str, p: torch.Tensor, rule: str) -> bool:
    """ndim: decay every tensor with >= 2 dims. strict: also spare biases, norms and embeddings."""
    if rule == "ndim":
        return p.dim() >= 2
    if rule == "strict":
        lowered = name.lower()
        return p.dim() >= 2 and not (name.endswith(".bias") or "norm" in lowered or "emb" in lowered)
    raise ValueError(f"decay rule must be 'ndim' or 'strict', got {rule!r}")


def param_groups(
    model: nn.Module, weight_decay: float, rule: str = "ndim", skip: Callable[[str, torch.Tensor], bool] | None = None
) -> list[dict]:
    """The two AdamW groups: [decayed, not decayed]; frozen parameters, and those skip(name, p) takes
    for another optimizer, are left out."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad and not (skip and skip(name, p)):
            (decay if is_decayed(name, p, rule) else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    weight_decay: float,
    rule: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    skip: Callable[[str, torch.Tensor], bool] | None = None,
) -> torch.optim.AdamW:
    """AdamW, fused into one kernel per step on devices where torch has it."""
    device = next(model.parameters()).device.type
    fused = device in ("cuda", "cpu")
    return torch.optim.AdamW(
        param_groups(model, weight_decay, rule, skip),
        lr=lr,
        betas=betas,
        eps=eps,
        fused=fused,
        foreach=None if fused else True,
    )


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """What --optimizer muon gives Muon: the transformer blocks' 2-D weights (attention and MLP
    projections); the embedding, the head and the norms stay with AdamW, as in modded-nanogpt."""
    return name.startswith("layers.") and p.dim() == 2


def optimizers_for(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """The run's optimizers: [the seed's grouped AdamW], or (--optimizer muon) [AdamW for the rest,
    torch.optim.Muon for the blocks' matrices]; the loop, GradScaler and checkpoints take the list.
    Muon's group carries lr_scale = muon_lr / lr: the loop sets each group's lr to the schedule's
    value times its lr_scale (1 when absent). Muon gets no weight decay (Keller Jordan's reference
    and modded-nanogpt's records use none)."""
    with_muon = cfg.optimizer == "muon"
    adamw = build_optimizer(
        model,
        cfg.weight_decay,
        cfg.decay_rule,
        cfg.lr,
        (cfg.beta1, cfg.beta2),
        cfg.eps,
        skip=is_muon_matrix if with_muon else None,
    )
    if not with_muon:
        return [adamw]
    matrices = [p for name, p in model.named_parameters() if p.requires_grad and is_muon_matrix(name, p)]
    muon = torch.optim.Muon(
        [{"params": matrices, "lr_scale": cfg.muon_lr / cfg.lr}],
        lr=cfg.muon_lr,
        weight_decay=0.0,
        momentum=cfg.muon_momentum,
    )
    return [adamw, muon]


def step_all(optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler, grad_norm: torch.Tensor) -> None:
    """scaler.step for every optimizer (each gradient already unscaled), as one update: under fp16
    an overflow anywhere (a non-finite global norm) skips them all, where GradScaler alone would
    skip only the optimizer that holds it and half-apply the step."""
    if scaler.is_enabled() and len(optimizers) > 1 and not torch.isfinite(grad_norm):
        return  # scaler.update() still lowers the scale: unscale_ recorded the overflow
    for optimizer in optimizers:
        scaler.step(optimizer)


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    """Every group at `lr` times its lr_scale: Muon's group runs at muon_lr on the same curve."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
