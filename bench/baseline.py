"""The peer fastpt is measured against: the same Llama architecture written the way a user
would write it from the seed, in plain nanoGPT-style PyTorch. No fastpt code on purpose.

The bench runs it with torch.compile, fused AdamW, bf16 autocast on GPU and F.cross_entropy
on the materialized (B*T, V) logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = True

    @classmethod
    def like(cls, cfg) -> GPTConfig:
        """The shape of a fastpt ModelConfig (read by field name: the peer does not import fastpt)."""
        return cls(
            cfg.vocab_size,
            cfg.dim,
            cfg.n_layers,
            cfg.n_heads,
            cfg.kv_heads,
            cfg.ffn_dim,
            cfg.max_seq_len,
            cfg.norm_eps,
            cfg.rope_theta,
            cfg.tie_embeddings,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, cos, sin):
    """Rotate the interleaved pairs of x (B, H, T, hd) by the angles in cos/sin (T, hd/2)."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.c_attn = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * self.head_dim, bias=False)
        self.c_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        hd = self.head_dim
        q, k, v = self.c_attn(x).split([self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], dim=2)
        q = q.view(B, T, self.n_heads, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv_heads, hd).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.c_fc = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = RMSNorm(cfg.dim, cfg.eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln_1(x), cos, sin)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        head_dim = cfg.dim // cfg.n_heads
        freqs = cfg.rope_theta ** -(torch.arange(0, head_dim, 2).double() / head_dim)
        angles = torch.arange(cfg.max_seq_len).double()[:, None] * freqs[None, :]  # (T, hd/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: scale the residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, labels=None):
        T = idx.size(1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.wte(idx)
        for block in self.h:
            x = block(x, cos, sin)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)
        return logits, loss, None  # the seed's `_, loss, _ = self.model(x, labels=y)`

    def configure_optimizers(self, weight_decay: float, lr: float, betas: tuple[float, float]):
        """nanoGPT's recipe: decay the >= 2-D tensors only; fused AdamW."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)

    @torch.no_grad()
    def load_llama_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights from Meta's Llama layout (tok_embeddings, layers.i.attention.wq, ...)."""
        head = "tok_embeddings.weight" if self.cfg.tie_embeddings else "output.weight"
        own = {"wte.weight": sd["tok_embeddings.weight"], "lm_head.weight": sd[head], "ln_f.weight": sd["norm.weight"]}
        for i in range(self.cfg.n_layers):
            src, dst = f"layers.{i}.", f"h.{i}."
            own[dst + "ln_1.weight"] = sd[src + "attention_norm.weight"]
            own[dst + "ln_2.weight"] = sd[src + "ffn_norm.weight"]
            own[dst + "attn.c_attn.weight"] = torch.cat([sd[src + f"attention.{w}.weight"] for w in ("wq", "wk", "wv")])
            own[dst + "attn.c_proj.weight"] = sd[src + "attention.wo.weight"]
            own[dst + "mlp.c_gate.weight"] = sd[src + "feed_forward.w1.weight"]
            own[dst + "mlp.c_fc.weight"] = sd[src + "feed_forward.w3.weight"]
            own[dst + "mlp.c_proj.weight"] = sd[src + "feed_forward.w2.weight"]
        self.load_state_dict(own)
