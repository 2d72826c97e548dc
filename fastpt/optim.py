"""The run's optimizers and their schedule: the seed's two AdamW groups, or (--optimizer muon)
Muon for the blocks' matrices beside AdamW groups of their own for the embedding and the head, as
nanochat and modded-nanogpt run it; the LR schedules (the seed's warmup + cosine, warmup-stable-decay
and linear) and Muon's momentum warmup, set on every group by apply_schedule."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn as nn

from fastpt.config import TrainConfig, wsd_decay_steps
from fastpt.model import INIT_STD
from fastpt.muon import Muon
from fastpt.presets import PRESETS

# nanochat's AdamW LRs beside Muon, tuned at width 768 and scaled as (dim / 768) ** -0.5. Its 0.2 for
# the embedding is for one initialized at std 1; AdamW's step does not scale with the weights, so
# ours, at INIT_STD, takes 0.2 * INIT_STD for the same relative step (the best of 0.0035-1.39 in the
# race's screen at width 64, bench/results/2026-12-03-cpu-race5-screen/method.md).
EMBED_LR_768, HEAD_LR_768 = 0.2 * INIT_STD, 0.004
# Under --init nanochat (its embedding at std 0.8) nanochat's own base-training LRs at width 768 (its
# scripts/base_train.py's --embedding-lr and --unembedding-lr), on the same width rule.
NANOCHAT_EMBED_LR_768, NANOCHAT_HEAD_LR_768 = 0.3, 0.008
MUON_MOMENTUM_START = 0.85  # Muon's momentum warms up from here (nanochat, modded-nanogpt)
NORMUON_BETA2 = 0.9  # NorMuon's running mean square (nanochat's)
# --adamw-groups nanochat: its AdamW settings per group beside Muon (its gpt.py setup_optimizer): the
# head, the embedding, the value embeddings and the scalars (fastpt.nanochat_parts), each its own
NANOCHAT_ADAMW = {
    "head": {"betas": (0.8, 0.96), "weight_decay": 0.01, "eps": 1e-10},
    "embed": {"betas": (0.8, 0.995), "weight_decay": 0.001, "eps": 1e-10},
    "value_embed": {"betas": (0.8, 0.995), "weight_decay": 0.01, "eps": 1e-10},
    "resid": {"betas": (0.8, 0.95), "weight_decay": 0.05, "eps": 1e-10},
    "x0": {"betas": (0.96, 0.95), "weight_decay": 0.0, "eps": 1e-10},
    "scalar": {"betas": (0.8, 0.95), "weight_decay": 0.0, "eps": 1e-10},
}
# nanochat's peak LRs for its scalars, whatever the width: 0.01 x its scalar LR 0.5 for the residual
# scalars, 0.5 for the x0 scalars, 0.2 for the backout's; the value embeddings take half the embedding's
NANOCHAT_SCALAR_LRS = {"resid": 0.005, "x0": 0.5, "scalar": 0.2}
SCALAR_ROLES = {
    "layer_scalars.resid": "resid",
    "layer_scalars.x0": "x0",
    "backout.weight": "scalar",
    "smear.weight": "scalar",
    "smear.gate.weight": "scalar",
}
# Each setting reapply_settings puts back after a resume: what the config says, not the checkpoint.
OPTIMIZER_SETTINGS = (
    "lr",
    "muon_lr",
    "embed_lr",
    "head_lr",
    "weight_decay",
    "muon_weight_decay",
    "beta1",
    "beta2",
    "muon_adam_beta1",
    "eps",
    "muon_momentum",
    "muon_momentum_warmup",
    "muon_momentum_end",
    "muon_weight_decay_schedule",
    "muon_orthogonalize",
    "normuon",
    "cautious_weight_decay",
    "adamw_groups",
)
ADAMW_SETTINGS = ("lr", "weight_decay", "beta1", "beta2", "eps")  # the ones the seed's optimizer has


def lr_at(step: int, peak_lr: float, warmup_steps: int, max_steps: int, min_ratio: float = 0.1) -> float:
    """Linear warmup from 0 to peak, cosine decay to min_ratio * peak, flat after max_steps."""
    if step < warmup_steps:
        return peak_lr * step / max(1, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak_lr * (min_ratio + (1 - min_ratio) * cosine)


def lr_schedule(cfg: TrainConfig, step: int, peak_lr: float) -> float:
    """The LR at `step` (0-based) of a group peaking at peak_lr: cosine is lr_at (the seed's);
    wsd holds the peak after warmup, then decays to decay_floor * peak over the last decay_fraction
    of max_steps, linearly or as 1 - sqrt(progress) (--decay-shape, Hägele et al. 2024); linear
    decays linearly to min_lr_ratio * peak from the end of warmup. Warmup is lr_at's in all three;
    flat at the floor after max_steps."""
    if cfg.schedule == "cosine":
        return lr_at(step, peak_lr, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    if cfg.schedule not in ("wsd", "linear"):
        raise ValueError(f"schedule must be 'cosine', 'wsd' or 'linear', got {cfg.schedule!r}")
    if step < cfg.warmup_steps:
        return peak_lr * step / max(1, cfg.warmup_steps)
    wsd = cfg.schedule == "wsd"
    decay_steps = wsd_decay_steps(cfg) if wsd else cfg.max_steps - cfg.warmup_steps
    decay_start = cfg.max_steps - decay_steps
    progress = min(1.0, max(0, step - decay_start) / max(1, decay_steps))
    if not wsd:
        return peak_lr * (1 - (1 - cfg.min_lr_ratio) * progress)
    floor = cfg.decay_floor * peak_lr
    left = 1 - math.sqrt(progress) if cfg.decay_shape == "sqrt" else 1 - progress
    return floor + (peak_lr - floor) * left


def decay_start(cfg: TrainConfig) -> int:
    """The step the LR starts to fall: wsd's decay, or the end of warmup (cosine, linear)."""
    return cfg.max_steps - wsd_decay_steps(cfg) if cfg.schedule == "wsd" else cfg.warmup_steps


def muon_momentum_at(cfg: TrainConfig, step: int) -> float:
    """Muon's momentum at `step`: linear from 0.85 to muon_momentum over muon_momentum_warmup steps;
    with muon_momentum_end, then linear from muon_momentum to it across the LR's decay (nanochat)."""
    if cfg.muon_momentum_end and step >= (start := decay_start(cfg)):
        progress = min(1.0, (step - start) / max(1, cfg.max_steps - start))
        return cfg.muon_momentum + (cfg.muon_momentum_end - cfg.muon_momentum) * progress
    frac = min(1.0, step / cfg.muon_momentum_warmup) if cfg.muon_momentum_warmup else 1.0
    return MUON_MOMENTUM_START + (cfg.muon_momentum - MUON_MOMENTUM_START) * frac


def muon_weight_decay_at(cfg: TrainConfig, step: int) -> float:
    """Muon's weight decay at `step`: muon_weight_decay, or (cosine) its half-cosine from full at step 0
    to zero at max_steps (nanochat); Muon's step shrinks by lr times it."""
    if cfg.muon_weight_decay_schedule == "constant":
        return cfg.muon_weight_decay
    return cfg.muon_weight_decay * 0.5 * (1 + math.cos(math.pi * min(1.0, step / cfg.max_steps)))


def is_tied(cfg: TrainConfig) -> bool:
    return cfg.tie_embeddings if cfg.tie_embeddings is not None else PRESETS[cfg.preset].tie_embeddings


def peak_lrs(cfg: TrainConfig, dim: int, tied: bool | None = None) -> dict[str, float]:
    """Each group's peak LR by name: "lr" (the seed's groups; under Muon the norms), and under
    --optimizer muon "muon", "head" and, with an untied head, "embed" (a tied matrix is the head's
    group). --embed-lr / --head-lr 0 take 0.2 * INIT_STD (nanochat's 0.2 at our init) / nanochat's
    0.004, times (dim / 768) ** -0.5.
    `tied`: the model's tie_embeddings, by default the config's (or its preset's)."""
    if cfg.optimizer != "muon":
        return {"lr": cfg.lr}
    width = (dim / 768) ** -0.5
    nanochat = cfg.init == "nanochat"
    embed_768, head_768 = (NANOCHAT_EMBED_LR_768, NANOCHAT_HEAD_LR_768) if nanochat else (EMBED_LR_768, HEAD_LR_768)
    peaks = {"lr": cfg.lr, "head": cfg.head_lr or head_768 * width, "muon": cfg.muon_lr}
    if not (is_tied(cfg) if tied is None else tied):
        peaks["embed"] = cfg.embed_lr or embed_768 * width
    return peaks


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
    """The seed's two AdamW groups: [decayed, not decayed]; frozen parameters, and those
    skip(name, p) takes for another optimizer, are left out."""
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
    """The seed's AdamW, fused into one kernel per step on devices where torch has it."""
    return adamw(param_groups(model, weight_decay, rule, skip), model, lr=lr, betas=betas, eps=eps)


def adamw(groups: list[dict], model: nn.Module, **defaults) -> torch.optim.AdamW:
    fused = next(model.parameters()).device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, fused=fused, foreach=None if fused else True, **defaults)


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """What --optimizer muon gives Muon: the transformer blocks' 2-D weights (attention and MLP
    projections); the embedding, the head and the norms stay with AdamW, as in modded-nanogpt."""
    return name.startswith("layers.") and p.dim() == 2


def adamw_role(name: str, cfg: TrainConfig) -> str:
    """Which peak LR an AdamW parameter takes under --optimizer muon: the head's (a tied embedding
    is the head too), the embedding's, the value embeddings' or --lr (the norms; the scalars too,
    which --adamw-groups nanochat gives groups of their own)."""
    if name.startswith("value_embeds."):
        return "value_embed"
    if cfg.adamw_groups == "nanochat" and name in SCALAR_ROLES:
        return SCALAR_ROLES[name]
    return {"output.weight": "head", "tok_embeddings.weight": "embed"}.get(name, "lr")


def role_peak_lrs(cfg: TrainConfig, dim: int) -> dict[str, float]:
    """The peak LRs of the roles beyond peak_lrs's: the value embeddings at half the untied embedding's
    (nanochat's), and under --adamw-groups nanochat its scalars' (NANOCHAT_SCALAR_LRS)."""
    embed = peak_lrs(dataclasses.replace(cfg, optimizer="muon"), dim, tied=False)["embed"]
    return {"value_embed": 0.5 * embed, **(NANOCHAT_SCALAR_LRS if cfg.adamw_groups == "nanochat" else {})}


def group_settings(group: dict, cfg: TrainConfig, peaks: dict[str, float]) -> dict:
    """The config's hyperparameters for a group the optimizers hold (its "name" and "decayed" say
    which): peak LR, weight decay, betas and eps; Muon's momentum is the schedule's (apply_schedule)."""
    name = group["name"]
    if name == "muon":
        return {
            "peak_lr": peaks[name],
            "weight_decay": cfg.muon_weight_decay,
            "orthogonalize": cfg.muon_orthogonalize,
            "normuon_beta2": NORMUON_BETA2 if cfg.normuon else 0.0,
            "cautious": cfg.cautious_weight_decay,
        }
    beta1 = cfg.beta1 if name == "lr" else cfg.muon_adam_beta1  # the seed's betas for the seed's groups
    decay = cfg.weight_decay if group["decayed"] else 0.0
    own = {"peak_lr": peaks[name], "weight_decay": decay, "betas": (beta1, cfg.beta2), "eps": cfg.eps}
    if cfg.optimizer == "muon" and cfg.adamw_groups == "nanochat" and name in NANOCHAT_ADAMW:
        own.update(NANOCHAT_ADAMW[name])  # nanochat decays these groups whatever the decay rule
    return own


def muon_adamw_groups(model: nn.Module, cfg: TrainConfig, tied: bool) -> list[dict]:
    """AdamW's groups beside Muon: one per (role, decayed) pair that has parameters."""
    groups: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and not is_muon_matrix(name, p):
            role = "head" if tied and name == "tok_embeddings.weight" else adamw_role(name, cfg)
            groups.setdefault((role, is_decayed(name, p, cfg.decay_rule)), []).append(p)
    return [{"params": params, "name": role, "decayed": decayed} for (role, decayed), params in groups.items()]


def optimizers_for(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """The run's optimizers: [the seed's grouped AdamW], or (--optimizer muon) [AdamW for the
    embedding, head and norms, fastpt.muon.Muon for the blocks' matrices]; the loop, GradScaler
    and checkpoints take the list. Every group carries its "name" (a peak_lrs key) and its
    "peak_lr", which apply_schedule scales by the schedule at each step."""
    tied = getattr(model, "output", None) is None
    if cfg.optimizer != "muon":
        groups = param_groups(model, cfg.weight_decay, cfg.decay_rule)
        for group, decayed in zip(groups, (True, False)):
            group.update(name="lr", decayed=decayed)
        optimizers = [adamw(groups, model, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)]
    else:
        matrices = [p for name, p in model.named_parameters() if p.requires_grad and is_muon_matrix(name, p)]
        muon = Muon([{"params": matrices, "name": "muon", "decayed": True}], lr=cfg.muon_lr, momentum=cfg.muon_momentum)
        optimizers = [adamw(muon_adamw_groups(model, cfg, tied), model, lr=cfg.lr), muon]
    reapply_settings(optimizers, cfg, model.cfg.dim, tied)
    return optimizers


def reapply_settings(
    optimizers: list[torch.optim.Optimizer], cfg: TrainConfig, dim: int, tied: bool | None = None
) -> None:
    """Every group's hyperparameters as the config says: after a resume loaded the checkpoint's
    (set_optimizer_state_dict restores each group's saved ones), a changed --lr, --muon-lr,
    --weight-decay, betas or momentum applies."""
    peaks = peak_lrs(cfg, dim, tied) | (role_peak_lrs(cfg, dim) if cfg.optimizer == "muon" else {})
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group.update(group_settings(group, cfg, peaks))


def changed_settings(saved: dict, cfg: TrainConfig) -> str:
    """The optimizer settings a checkpoint's saved train config differs on ('muon_lr 0.02 -> 0.01')."""
    used = [k for k in OPTIMIZER_SETTINGS if cfg.optimizer == "muon" or k in ADAMW_SETTINGS]
    return ", ".join(f"{k} {saved[k]} -> {getattr(cfg, k)}" for k in used if k in saved and saved[k] != getattr(cfg, k))


def apply_schedule(optimizers: list[torch.optim.Optimizer], cfg: TrainConfig, step: int) -> dict[str, float]:
    """Every group's LR for `step` (its peak_lr on the run's schedule), Muon's momentum and weight decay;
    returns each group name's LR and --lr's as "lr" (what the dashboard and metrics.jsonl show)."""
    lrs = {"lr": lr_schedule(cfg, step, cfg.lr)}  # --lr's, logged even where no group is left at it
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lrs[group["name"]] = lr_schedule(cfg, step, group["peak_lr"])
            if group["name"] == "muon":
                group["momentum"] = muon_momentum_at(cfg, step)
                group["weight_decay"] = muon_weight_decay_at(cfg, step)
    return lrs


def step_all(optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler, grad_norm: torch.Tensor) -> None:
    """scaler.step for every optimizer (each gradient already unscaled), as one update: under fp16
    an overflow anywhere (a non-finite global norm) skips them all, where GradScaler alone would
    skip only the optimizer that holds it and half-apply the step."""
    if scaler.is_enabled() and len(optimizers) > 1 and not torch.isfinite(grad_norm):
        return  # scaler.update() still lowers the scale: unscale_ recorded the overflow
    for optimizer in optimizers:
        scaler.step(optimizer)
