"""Layers from nanochat's GPT (Karpathy 2025, after modded-nanogpt), each a model option off by default:
learned per-layer scalars on the residual stream and on the embedding fed back into every block, and
the backout of a middle block's output from the last hidden state."""

from __future__ import annotations

import torch
import torch.nn as nn

BACKOUT_INIT = 0.2  # the share of the middle block's output taken out at the start (nanochat's)


class LayerScalars(nn.Module):
    """Block i reads resid[i] * h + x0[i] * x0, h the residual stream and x0 the embedding (after its
    norm, where the model has one): each block rescales the stream and takes back some of the token's
    own embedding. Initialized as nanochat's, falling linearly with depth: resid from 1.15 to 1.05
    (early blocks amplify the stream, late ones less) and x0 from 0.20 to 0.05."""

    def __init__(self, n_layers: int):
        super().__init__()
        self.resid = nn.Parameter(torch.empty(n_layers))
        self.x0 = nn.Parameter(torch.empty(n_layers))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        n = self.resid.numel()
        depth = torch.arange(n, dtype=torch.float32) / max(n - 1, 1)  # 0 at the first block, 1 at the last
        self.resid.copy_(1.15 - 0.10 * depth)
        self.x0.copy_(0.20 - 0.15 * depth)

    def forward(self, i: int, h: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        return self.resid[i] * h + self.x0[i] * x0


class Backout(nn.Module):
    """h - weight * (block n_layers // 2's output), before the final norm: the last hidden state sheds
    a learned share (from 0.2) of what the middle of the network wrote, its low-level features,
    before the head reads it."""

    def __init__(self, n_layers: int):
        super().__init__()
        self.layer = n_layers // 2  # the block whose output is taken out
        self.weight = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(BACKOUT_INIT)

    def forward(self, h: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
        return h - self.weight * middle
