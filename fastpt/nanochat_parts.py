"""Layers from nanochat's GPT (Karpathy 2025, after modded-nanogpt), each a model option off by default:
learned per-layer scalars on the residual stream and on the embedding fed back into every block, and
the backout of a middle block's output from the last hidden state."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

BACKOUT_INIT = 0.2  # the share of the middle block's output taken out at the start (nanochat's)
EMBED_STD, HEAD_STD = 0.8, 0.001  # --init nanochat: the token embedding's and the untied head's normal std
MLP_IN_SHARE = 0.4  # the MLP's input matrices start at this share of the attention inputs' scale


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


def has_value_embed(layer: int, n_layers: int) -> bool:
    """--value-embeds: every other block, counted back from the last (which always has one)."""
    return layer % 2 == (n_layers - 1) % 2


class ValueEmbeddings(nn.Module):
    """A token embedding of the values' width (kv_heads x head_dim) for each block has_value_embed picks,
    looked up from the input tokens and added to that block's attention values through a ValueGate
    (value residual learning, ResFormer; modded-nanogpt, nanochat). Initialized uniform at std
    1 / sqrt(dim), as nanochat's value projections."""

    def __init__(self, n_layers: int, vocab_size: int, value_dim: int, dim: int):
        super().__init__()
        self.dim = dim
        layers = [i for i in range(n_layers) if has_value_embed(i, n_layers)]
        self.tables = nn.ModuleDict({str(i): nn.Embedding(vocab_size, value_dim) for i in layers})
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound = math.sqrt(3 / self.dim)
        for table in self.tables.values():
            nn.init.uniform_(table.weight, -bound, bound)

    def forward(self, i: int, idx: torch.Tensor) -> torch.Tensor | None:
        """Block i's value embedding of idx (B, T, value_dim); None for a block without one."""
        return self.tables[str(i)](idx) if str(i) in self.tables else None


class ValueGate(nn.Module):
    """v + gate * ve per key/value head, the gate 3 * sigmoid(x[..., :12] W) read from the first 12
    channels of the attention's input (nanochat's), so in (0, 3); W starts uniform in [0, 0.02], the
    gates just above 1.5."""

    channels, most = 12, 3.0

    def __init__(self, dim: int, kv_heads: int):
        super().__init__()
        self.proj = nn.Linear(min(self.channels, dim), kv_heads, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.uniform_(self.proj.weight, 0.0, 0.02)

    def forward(self, x: torch.Tensor, v: torch.Tensor, ve: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) the attention's input, v (B, T, Hkv, hd), ve (B, T, Hkv * hd)."""
        gate = self.most * torch.sigmoid(self.proj(x[..., : self.proj.in_features]))  # (B, T, Hkv)
        return v + gate.unsqueeze(-1) * ve.view_as(v)


class Smear(nn.Module):
    """x_t + weight * sigmoid(x_t[:24] W) * x_(t-1): each token's embedding takes in a gated share of the
    one before it, a cheap bigram (nanochat). The gate reads the first 24 channels; weight starts at 0,
    so the model starts without it, W uniform in [0, 0.02]."""

    channels = 24

    def __init__(self, dim: int):
        super().__init__()
        self.gate = nn.Linear(min(self.channels, dim), 1, bias=False)
        self.weight = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.uniform_(self.gate.weight, 0.0, 0.02)
        self.weight.zero_()

    def forward(self, x: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C); before (B, 1, C): the embedding of the token before x's first (decoding with a
        KV cache), or None: the first token has none and is left as it is."""
        previous = x[:, :-1] if before is None else torch.cat((before, x[:, :-1]), dim=1)
        current = x[:, -previous.size(1) :] if previous.size(1) else x[:, :0]
        mixed = current + self.weight * torch.sigmoid(self.gate(current[..., : self.gate.in_features])) * previous
        return mixed if before is not None else torch.cat((x[:, :1], mixed), dim=1)


OWN_INIT = (LayerScalars, Backout, ValueEmbeddings, ValueGate, Smear)  # parts whose reset_parameters is their init


@torch.no_grad()
def nanochat_init(model: nn.Module) -> None:
    """--init nanochat, on a fastpt Transformer (untied): the embedding at N(0, 0.8), the head at
    N(0, 0.001); the attention's q, k, v uniform with std 1 / sqrt(dim) (a uniform has no outliers),
    the MLP's input matrices at 0.4 of that; the output projections (attention wo, MLP down) at zero,
    so every block starts as the identity. Everything else keeps the model's own init."""
    bound = math.sqrt(3 / model.cfg.dim)  # the uniform on [-b, b] has std b / sqrt(3)
    for name, p in model.named_parameters():
        if name == "tok_embeddings.weight":
            nn.init.normal_(p, std=EMBED_STD)
        elif name == "output.weight":
            nn.init.normal_(p, std=HEAD_STD)
        elif name.endswith(("wo.weight", "w2.weight")):
            nn.init.zeros_(p)
        elif name.endswith(("wq.weight", "wk.weight", "wv.weight")):
            nn.init.uniform_(p, -bound, bound)
        elif name.endswith(("w1.weight", "w3.weight")):
            nn.init.uniform_(p, -MLP_IN_SHARE * bound, MLP_IN_SHARE * bound)
