"""AdamW in two parameter groups (optionally Muon for the blocks' matrices beside them) and the
learning-rate schedules: the seed's warmup + cosine, warmup-stable-decay and linear."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

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


def lr_schedule(schedule: str, step: int, peak_lr: float, warmup_steps: int, max_steps: int,
                min_ratio: float = 0.1, decay_fraction: float = 0.2) -> float:
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


def is_decayed(name: str, p: torch.Tensor, rule: str) -> bool:
    """ndim: decay every tensor with >= 2 dims. strict: also spare biases, norms and embeddings."""
    if rule == "ndim":
        return p.dim() >= 2
    if rule == "strict":
        lowered = name.lower()
        return p.dim() >= 2 and not (name.endswith(".bias") or "norm" in lowered or "emb" in lowered)
    raise ValueError(f"decay rule must be 'ndim' or 'strict', got {rule!r}")


def param_groups(model: nn.Module, weight_decay: float, rule: str = "ndim",
                 skip: Callable[[str, torch.Tensor], bool] | None = None) -> list[dict]:
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


def build_optimizer(model: nn.Module, weight_decay: float, rule: str, lr: float,
                    betas: tuple[float, float], eps: float,
                    skip: Callable[[str, torch.Tensor], bool] | None = None) -> torch.optim.AdamW:
    """AdamW, fused into one kernel per step on devices where torch has it."""
    device = next(model.parameters()).device.type
    fused = device in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, weight_decay, rule, skip), lr=lr, betas=betas,
                             eps=eps, fused=fused, foreach=None if fused else True)


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """What --optimizer muon gives Muon: the transformer blocks' 2-D weights (attention and MLP
    projections); the embedding, the head and the norms stay with AdamW, as in modded-nanogpt."""
    return name.startswith("layers.") and p.dim() == 2


class Optimizers:
    """Several optimizers that the loop, the GradScaler and checkpoints use as one: param_groups is
    all of theirs (so a GradScaler unscales and checks every gradient), step and zero_grad call each,
    and iterating yields them (what torch.distributed.checkpoint's get_state_dict takes)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [group for o in self.optimizers for group in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list[dict]:
        return [o.state_dict() for o in self.optimizers]

    def load_state_dict(self, states: list[dict]) -> None:
        for o, state in zip(self.optimizers, states, strict=True):
            o.load_state_dict(state)


def optimizer_for(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer | Optimizers:
    """The run's optimizer: the seed's grouped AdamW, or (--optimizer muon) torch.optim.Muon for the
    blocks' matrices beside AdamW for the rest. Muon's group carries lr_scale = muon_lr / lr: the
    loop sets each group's lr to the schedule's value times its lr_scale (1 when absent). Muon gets
    no weight decay (Keller Jordan's reference and modded-nanogpt's records use none)."""
    with_muon = cfg.optimizer == "muon"
    adamw = build_optimizer(model, cfg.weight_decay, cfg.decay_rule, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps,
                            skip=is_muon_matrix if with_muon else None)
    if not with_muon:
        return adamw
    matrices = [p for name, p in model.named_parameters() if p.requires_grad and is_muon_matrix(name, p)]
    muon = torch.optim.Muon([{"params": matrices, "lr_scale": cfg.muon_lr / cfg.lr}], lr=cfg.muon_lr,
                            weight_decay=0.0, momentum=cfg.muon_momentum)
    return Optimizers(adamw, muon)
