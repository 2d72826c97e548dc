"""Muon (Jordan et al. 2024) for the blocks' weight matrices, in one process or over torchrun: each
matrix's Nesterov momentum, orthogonalized by Newton-Schulz (or Polar Express), as the update;
optionally NorMuon's per-row normalization of it and cautious weight decay (nanochat's Muon). Over several ranks the
work is split by whole matrices, as nanochat's DistMuon does: each rank orthogonalizes its share of
each shape's matrices and an all-gather hands every rank all of them, under DDP (parameters and
gradients replicated) and FSDP2 (each a DTensor shard: a matrix is gathered whole for Newton-Schulz,
and each rank keeps its own rows of the result). The arithmetic of a matrix is the same whichever
rank does it, so any layout steps bit for bit as one process given the same gradients."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's, tuned for the slope at zero (Jordan et al.)
NS_STEPS = 5
NS_EPS = 1e-7
# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): one quintic per iteration, each
# minimax-optimal for the singular values the previous ones leave; the paper's five for a 2e-2 safety
# factor, run on the update scaled a hair below unit norm (POLAR_EXPRESS_MARGIN) so none starts above 1.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_MARGIN = 1.01
ORTHOGONALIZERS = ("newton-schulz", "polar-express")  # --muon-orthogonalize
NORMUON_EPS = 1e-10  # floors a row's mean square before its inverse root


def ns_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """A batch (k, m, n) of matrices, each orthogonalized (its singular values pushed to ~1) by
    `steps` quintic Newton-Schulz iterations, batched as modded-nanogpt does. bf16 on CUDA (its
    tensor cores; the published numerics), fp32 elsewhere: a CPU without bf16 units runs bf16
    matmuls several times slower than fp32 ones."""
    return quintic_iterations(g, (NS_COEFFICIENTS,) * steps)


def polar_express(g: torch.Tensor) -> torch.Tensor:
    """A batch (k, m, n) of matrices orthogonalized by Polar Express's five quintics (each iteration
    its own coefficients), in newton_schulz's precision and batching."""
    return quintic_iterations(g, POLAR_EXPRESS_COEFFICIENTS, margin=POLAR_EXPRESS_MARGIN)


def quintic_iterations(g: torch.Tensor, coefficients: tuple, margin: float = 1.0) -> torch.Tensor:
    """x <- a x + (b X + c X^2) x with X = x x^T, for each (a, b, c) in turn, from g scaled to
    Frobenius norm 1 / margin (which bounds its spectral norm)."""
    x = g.to(ns_dtype(g.device))
    tall = x.size(-2) > x.size(-1)
    if tall:  # the Gram matrix of the short side is the smaller one
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * margin).clamp(min=NS_EPS)
    for a, b, c in coefficients:
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


ORTHOGONALIZE = {"newton-schulz": newton_schulz, "polar-express": polar_express}


def normalize_rows(o: torch.Tensor, variance: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon (Li et al. 2025, arXiv:2510.05491): the orthogonalized update o (m, n) divided by
    the root of a running mean (`variance`, updated in place) of its mean square along the short
    side, so every row (a wide matrix's every column, as nanochat) moves at a like rate; then
    rescaled to o's Frobenius norm, so Muon's step size stays what it was."""
    square_mean = o.float().square().mean(dim=short_side(o.shape), keepdim=True)
    variance.lerp_(square_mean.to(variance.dtype), 1 - beta2)
    scaled = o.float() * variance.float().clamp(min=NORMUON_EPS).rsqrt()
    ratio = o.float().norm() / scaled.norm().clamp(min=NORMUON_EPS)  # a zero update stays zero
    return (scaled * ratio).to(o.dtype)


def short_side(shape: torch.Size | tuple) -> int:
    """The dim NorMuon averages over: the columns of a tall or square matrix, the rows of a wide one."""
    return -1 if shape[-2] >= shape[-1] else -2


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


def orthogonalize(
    updates: list[torch.Tensor],
    method: str = "newton-schulz",
    then: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Every update orthogonalized (by ORTHOGONALIZE[method]), each in its own layout. Same-shape
    matrices go through it as one batch; under a process group rank r takes the r-th contiguous
    share of each shape's matrices and one all-gather per shape brings every rank the rest.
    then(i, o): applied to update i's whole orthogonalized matrix on every rank alike (so state it
    keeps is the same on each), before it is cut to the update's layout."""
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
            ORTHOGONALIZE[method](torch.stack(local))
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
            o = done[j].to(updates[i].dtype)
            out[i] = like(then(i, o) if then else o, updates[i])
    return out


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters: Nesterov momentum, orthogonalized (`orthogonalize`: newton-schulz or
    polar-express), scaled by sqrt(max(1, rows / cols)) (Jordan's, torch.optim.Muon's "original"),
    with decoupled weight decay. `normuon_beta2` > 0: NorMuon's per-row normalization of the
    orthogonalized update (normalize_rows); `cautious`: the decay shrinks only the entries the
    update also pulls toward zero (Chen et al. 2025, nanochat). Its state is a `momentum_buffer` per
    parameter in the parameter's layout, as torch.optim.Muon's, so checkpoints reshard between
    layouts and world sizes like AdamW's; NorMuon's `row_variance` (a column or a row) is whole and
    the same on every rank."""

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        orthogonalize: str = "newton-schulz",
        normuon_beta2: float = 0.0,
        cautious: bool = False,
    ):
        if orthogonalize not in ORTHOGONALIZE:
            raise ValueError(f"orthogonalize must be one of {', '.join(ORTHOGONALIZE)}, got {orthogonalize!r}")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": True}
        defaults.update(orthogonalize=orthogonalize, normuon_beta2=normuon_beta2, cautious=cautious)
        super().__init__(params, defaults)
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
            then = self.row_normalizer(params, group["normuon_beta2"]) if group["normuon_beta2"] else None
            for p, o in zip(params, orthogonalize(updates, group["orthogonalize"], then)):
                rows, cols = p.shape
                decay = group["lr"] * group["weight_decay"]
                if group["cautious"]:  # only where p - lr * o moves toward zero: o and p share a sign
                    p.sub_(p * (o * p >= 0), alpha=decay)
                else:
                    p.mul_(1 - decay)
                p.add_(o, alpha=-group["lr"] * max(1.0, rows / cols) ** 0.5)

    def row_normalizer(self, params: list, beta2: float) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """orthogonalize's `then` for NorMuon: params[i]'s update through normalize_rows, with its
        running mean square (zeros at first) in its state."""

        def normalize(i: int, o: torch.Tensor) -> torch.Tensor:
            state = self.state[params[i]]
            if "row_variance" not in state:
                side = short_side(o.shape)
                state["row_variance"] = o.new_zeros(tuple(1 if d == side % 2 else n for d, n in enumerate(o.shape)))
            return normalize_rows(o, state["row_variance"], beta2)

        return normalize
