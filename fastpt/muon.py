"""Muon (Jordan et al. 2024) for the blocks' weight matrices, in one process or over torchrun: each
matrix's Nesterov momentum, orthogonalized by Newton-Schulz, as the update. Over several ranks the
work is split by whole matrices, as nanochat's DistMuon does: each rank orthogonalizes its share of
each shape's matrices and an all-gather hands every rank all of them, under DDP (parameters and
gradients replicated) and FSDP2 (each a DTensor shard: a matrix is gathered whole for Newton-Schulz,
and each rank keeps its own rows of the result). The arithmetic of a matrix is the same whichever
rank does it, so any layout steps bit for bit as one process given the same gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's, tuned for the slope at zero (Jordan et al.)
NS_STEPS = 5
NS_EPS = 1e-7


def ns_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """A batch (k, m, n) of matrices, each orthogonalized (its singular values pushed to ~1) by
    `steps` quintic Newton-Schulz iterations, batched as modded-nanogpt does. bf16 on CUDA (its
    tensor cores; the published numerics), fp32 elsewhere: a CPU without bf16 units runs bf16
    matmuls several times slower than fp32 ones."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(ns_dtype(g.device))
    tall = x.size(-2) > x.size(-1)
    if tall:  # the Gram matrix of the short side is the smaller one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def whole(u: torch.Tensor) -> torch.Tensor:
    """The whole matrix: a DTensor shard gathered (a collective: every rank calls it), else itself.
    (A DTensor is known by its methods: torch.distributed.tensor, ~1 s to import, is imported only
    where FSDP runs, not at fastpt.train's start-up.)"""
    return u.full_tensor() if hasattr(u, "full_tensor") else u


def like(o: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The whole matrix o in u's layout: under FSDP this rank's rows of it (a local slice, no
    communication), else o itself."""
    if not hasattr(u, "device_mesh"):  # not a DTensor (see whole)
        return o
    from torch.distributed.tensor import DTensor, Replicate

    replicated = DTensor.from_local(o, u.device_mesh, [Replicate()] * u.device_mesh.ndim, run_check=False)
    return replicated.redistribute(u.device_mesh, u.placements)


def orthogonalize(updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every update orthogonalized, each in its own layout. Same-shape matrices go through
    Newton-Schulz as one batch; under a process group rank r takes the r-th contiguous share of each
    shape's matrices and one all-gather per shape brings every rank the rest."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    out: list[torch.Tensor | None] = [None] * len(updates)
    by_shape: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        by_shape.setdefault(tuple(u.shape), []).append(i)
    for shape, idx in by_shape.items():
        share = -(-len(idx) // world)
        mine = range(rank * share, min(len(idx), (rank + 1) * share))
        local = []
        for j, i in enumerate(idx):
            full = whole(updates[i])  # every rank takes part in every gather, and keeps its share only
            if j in mine:
                local.append(full)
        device = updates[idx[0]].device
        done = (
            newton_schulz(torch.stack(local))
            if local
            else torch.empty((0, *shape), dtype=ns_dtype(device), device=device)
        )
        if world > 1:
            padded = torch.zeros((share, *done.shape[1:]), dtype=done.dtype, device=done.device)
            padded[: len(done)] = done
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded)
            done = torch.cat(parts)
        for j, i in enumerate(idx):
            out[i] = like(done[j].to(updates[i].dtype), updates[i])
    return out


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters: Nesterov momentum, orthogonalized, scaled by sqrt(max(1, rows /
    cols)) (Jordan's, torch.optim.Muon's "original"), with decoupled weight decay. Its state is a
    `momentum_buffer` per parameter in the parameter's layout, as torch.optim.Muon's, so checkpoints
    reshard between layouts and world sizes like AdamW's."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": True})
        for group in self.param_groups:
            if any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon takes 2-D parameters only")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                updates.append(p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
            for p, o in zip(params, orthogonalize(updates)):
                rows, cols = p.shape
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(o, alpha=-group["lr"] * max(1.0, rows / cols) ** 0.5)
