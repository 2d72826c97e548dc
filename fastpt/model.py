"""Llama-style decoder: RMSNorm, RoPE, causal SDPA attention (optional GQA; optionally within documents,
see attention.py), SwiGLU (or squared ReLU), tied or untied head; optionally soft-capped logits and
U-net skips between blocks."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastpt import checkpointing
from fastpt.attention import attend, document_mask
from fastpt.kernels import api as kernels
from fastpt.kernels import reference
from fastpt.nanochat_parts import OWN_INIT, Backout, LayerScalars, Smear, ValueEmbeddings, ValueGate, has_value_embed
from fastpt.presets import ModelConfig

INIT_STD = 0.02  # GPT-2's: every weight matrix, the token embedding included

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class LogitsOutput(NamedTuple):
    """What forward returns without labels (decoding, export checks). Read it by name; it still
    unpacks as (logits, None, cache)."""

    logits: torch.Tensor  # (B, T, V)
    loss: None
    cache: KVCache | None  # with kv_cache: the cache extended by this call's keys and values


class LossOutput(NamedTuple):
    """What forward returns with labels (training, eval). `_, loss, _ = model(x, labels=y)` unpacks
    it as in the seed loop; fastpt's own code reads the fields by name."""

    logits: None  # never materialized: the fused loss goes from the last hidden state to the loss
    loss: torch.Tensor  # what backward takes: the mean cross-entropy plus the z-loss term (per target: (B*T,))
    z_loss: torch.Tensor  # the z-loss term alone, detached, for logging (0 when z_loss is 0)

    @property
    def cross_entropy(self) -> torch.Tensor:
        """The cross-entropy alone (detached): the number comparable across runs. With
        reduction="none", each target's (0 where the target is -100)."""
        return self.loss.detach() - self.z_loss


class RMSNorm(nn.Module):
    """x / rms(x) * weight; `learned` False: a weight of ones that is no parameter (nanochat's norms)."""

    def __init__(self, dim: int, eps: float, backend: str, learned: bool = True):
        super().__init__()
        self.eps = eps
        self.backend = backend
        if learned:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_buffer("weight", torch.ones(dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, backend=self.backend)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (T, hd/2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1) of the last dim; x (B, T, H, hd), cos/sin (T, hd/2)."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (B, T, H, hd/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str = "auto", value_embed: bool = False):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # QK-norm: one learned scale of head_dim shared by every head, as Qwen3's q_norm / k_norm.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, backend) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, backend) if cfg.qk_norm else None
        # nanochat's QK-norm: after RoPE, no weight, both sides times qk_norm_scale (sharper attention)
        self.qk_scale = cfg.qk_norm_scale
        self.rope_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, backend, learned=False) if cfg.qk_norm_scale else None
        self.value_gate = ValueGate(cfg.dim, cfg.kv_heads) if value_embed else None  # --value-embeds

    def forward(self, x, cos, sin, cache: tuple | None = None, mask=None, ve=None):
        """cache None (training): returns (y, None), so no view of k and v outlives the call.
        cache () (a prompt's prefill) or (k, v) (decoding one token after it): returns (y, the
        cache extended by this call's keys and values). mask: a document mask (attention.py), or
        None for the causal one. ve: this block's value embedding (--value-embeds), gated into v."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, hd)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim)  # (B, T, Hkv, hd)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim)
        if ve is not None:
            v = self.value_gate(x, v, ve)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over hd, before RoPE
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.rope_norm is not None:
            q, k = self.rope_norm(q) * self.qk_scale, self.rope_norm(k) * self.qk_scale
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        if cache:
            if T > 1:
                raise ValueError("a KV cache decodes one token at a time after the prompt")
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
        # A decoded token may see every cached key. is_causal tests the cache, not its length,
        # to stay a plain bool when compiled with dynamic shapes.
        gqa = self.kv_heads != self.n_heads
        if mask is not None:
            y = attend(q, k, v, mask, gqa)  # (B, H, T, hd)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=not cache, enable_gqa=gqa)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C)
        return self.wo(y), None if cache is None else (k, v)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ReluSquaredFeedForward(nn.Module):
    """relu(x W1)^2 W2 (Primer, So et al. 2021; modded-nanogpt, nanochat), ffn_dim wide: two matrices,
    so a preset's relu2 is 3/2 of its SwiGLU width, at SwiGLU's parameters (presets.model_config)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)).square())


MLPS = {"swiglu": FeedForward, "relu2": ReluSquaredFeedForward}


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap) in fp32 (Gemma 2's final_logit_softcapping); the logits as they are
    for cap 0. The loss caps inside kernels.linear_cross_entropy instead (softcap=)."""
    return reference.soft_cap(logits.float(), cap) if cap else logits


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str, checkpointing: str = "none", value_embed: bool = False):
        super().__init__()
        self.checkpointing = checkpointing  # what the backward recomputes instead of keeping (fastpt.checkpointing)
        learned = not cfg.parameter_free_norms
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, backend, learned)
        self.attention = Attention(cfg, backend, value_embed)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, backend, learned)
        self.feed_forward = MLPS[cfg.mlp](cfg)

    def forward(self, x, cos, sin, cache=None, mask=None, ve=None):
        if self.checkpointing != "none" and self.training and cache is None:
            # Inside the block, so a compiled block (and FSDP's unit, the block) sees it.
            return checkpointing.checkpointed(self.checkpointing, self._forward, x, cos, sin, None, mask, ve)
        return self._forward(x, cos, sin, cache, mask, ve)

    def _forward(self, x, cos, sin, cache=None, mask=None, ve=None):
        a, new_cache = self.attention(self.attention_norm(x), cos, sin, cache, mask, ve)
        x = x + a
        x = x + self.feed_forward(self.ffn_norm(x))
        return x, new_cache


def unet_wiring(n_layers: int) -> str:
    """What --unet-skips wires in Transformer.forward, as the run's summary says it: block i's input
    (i < L // 2, the first half's) x a learned scalar starting at 1, added to block L-1-i's output."""
    pairs = [f"{i}->{n_layers - 1 - i}" for i in range(n_layers // 2)]
    if len(pairs) > 4:
        pairs = [*pairs[:2], "...", pairs[-1]]
    middle = f"; block {n_layers // 2} unpaired" if n_layers % 2 else ""
    if not pairs:
        return "U-net skips: none (one block has no pair, and no skip weight)"
    return (
        f"U-net skips: block i's input x a learned scalar (from 1) added to block {n_layers - 1}-i's output, "
        f"i < {n_layers // 2}: {', '.join(pairs)}{middle}"
    )


class Transformer(nn.Module):
    """The model of a ModelConfig. Three training choices that checkpoints do not record: `backend`
    (auto | triton | torch) picks how its RMSNorms and loss run; `z_loss` adds PaLM's
    z_loss * logsumexp^2 stabilizer to the loss; `activation_checkpointing` (none | full |
    selective, see fastpt.checkpointing) trades recomputed work for activation memory."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: str = "auto",
        z_loss: float = 0.0,
        activation_checkpointing: str = "none",
        zero_init: bool = False,
    ):
        super().__init__()
        cfg.check()
        checkpointing.check(activation_checkpointing)
        self.cfg, self.backend, self.z_loss = cfg, backend, z_loss
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        value_embed = lambda i: cfg.value_embeds and has_value_embed(i, cfg.n_layers)
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, backend, activation_checkpointing, value_embed(i)) for i in range(cfg.n_layers)
        )
        learned = not cfg.parameter_free_norms
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, backend, learned)
        # nanochat's options (fastpt.nanochat_parts); None when off, so no parameter of theirs exists
        self.embed_norm = RMSNorm(cfg.dim, cfg.norm_eps, backend, learned) if cfg.embed_norm else None
        self.layer_scalars = LayerScalars(cfg.n_layers) if cfg.layer_scalars else None
        self.backout = Backout(cfg.n_layers) if cfg.backout else None
        self.smear = Smear(cfg.dim) if cfg.smear else None
        value_dim = cfg.kv_heads * cfg.head_dim
        self.value_embeds = (
            ValueEmbeddings(cfg.n_layers, cfg.vocab_size, value_dim, cfg.dim) if cfg.value_embeds else None
        )
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # U-net: one scalar per skip from block i's input to block L-1-i's output, starting at 1 (the 1-D init).
        # One block has no pair: no parameter, rather than an empty one that never gets a gradient (so no
        # optimizer state, which a resume then misses).
        skips = cfg.n_layers // 2 if cfg.unet_skips else 0
        self.skip_weights = nn.Parameter(torch.ones(skips)) if skips else None
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(zero_init)

    def reset_parameters(self, zero_init: bool = False) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layers);
        zero_init: those projections (attention wo, MLP down) at zero instead, so each block
        starts as the identity (modded-nanogpt, nanochat)."""
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        # nanochat's parts init themselves, last, so the other weights draw what they draw without them
        parts = [m for m in self.modules() if isinstance(m, OWN_INIT)]
        own = {id(p) for part in parts for p in part.parameters()}
        for name, p in self.named_parameters():
            is_residual = name.endswith(("wo.weight", "w2.weight"))
            if id(p) in own:
                continue
            if p.dim() < 2:
                nn.init.ones_(p)
            elif is_residual and zero_init:
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=residual_std if is_residual else INIT_STD)
        for part in parts:
            part.reset_parameters()

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head's (V, C) weight: the token embedding's when tied."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(
        self,
        idx: torch.Tensor,
        labels: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        reduction: str = "mean",
    ) -> LogitsOutput | LossOutput:
        """idx (B, T) -> LogitsOutput (logits (B, T, V), and the extended cache when given kv_cache);
        with labels (B, T), LossOutput (the loss and its z-loss part) instead: their mean over the
        counted targets, their sum with reduction="sum", or with reduction="none" each target's,
        flattened (B*T,) (what evals sum); of the soft-capped logits where the config caps them."""
        B, T = idx.shape
        past = kv_cache[0][0].shape[2] if kv_cache else 0
        if past + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {past + T} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[past : past + T], self.rope_sin[past : past + T]  # (T, hd/2)
        h = self.tok_embeddings(idx)  # (B, T, C)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        if self.smear is not None:  # a cache carries the last embedding after the layers' (k, v)
            embedded, before = h, kv_cache[-1][0] if kv_cache else None
            h = self.smear(h, before)
        x0, middle = h, None  # the embedding every block reads back (layer scalars); the backout's block output
        # Built once for all layers; decoding with a KV cache attends causally (one document: the prompt's).
        mask = document_mask(idx, self.cfg.doc_token) if self.cfg.attention == "document" and kv_cache is None else None
        new_cache: KVCache = []
        skips: list[torch.Tensor] = []  # U-net: the first half's block inputs, (B, T, C) each
        n_skips = 0 if self.skip_weights is None else self.skip_weights.numel()
        for i, layer in enumerate(self.layers):
            if i < n_skips:
                skips.append(h)
            # An empty list starts a cache (the prompt's prefill); None means no cache at all.
            layer_cache = None if kv_cache is None else (kv_cache[i] if kv_cache else ())
            if self.layer_scalars is not None:
                h = self.layer_scalars(i, h, x0)
            ve = None if self.value_embeds is None else self.value_embeds(i, idx)
            h, layer_cache = layer(h, cos, sin, layer_cache, mask, ve)
            new_cache.append(layer_cache)
            if i >= len(self.layers) - n_skips:  # block L-1-j takes block j's input, the last first
                h = h + self.skip_weights[len(self.layers) - 1 - i] * skips.pop()
            if self.backout is not None and i == self.backout.layer:
                middle = h
        if self.backout is not None:
            h = self.backout(h, middle)
        if self.smear is not None and kv_cache is not None:
            new_cache.append((embedded[:, -1:],))
        h = self.norm(h)  # (B, T, C)
        if labels is not None:
            # The fused kernel never materializes the (B*T, V) logits, soft-capped or not.
            loss = kernels.linear_cross_entropy(
                h.flatten(0, 1),
                self.output_weight,
                labels.flatten(),
                reduction=reduction,
                z_loss=self.z_loss,
                return_z_loss=self.z_loss > 0,
                softcap=self.cfg.logit_softcap,
                backend=self.backend,
            )
            loss, z_loss = loss if self.z_loss else (loss, loss.detach().new_zeros(()))
            return LossOutput(None, loss, z_loss)
        logits = soft_cap(F.linear(h, self.output_weight), self.cfg.logit_softcap)  # (B, T, V)
        return LogitsOutput(logits, None, new_cache if kv_cache is not None else None)

    def num_params(self) -> int:
        """Parameters, the tied embedding/head counted once."""
        return sum(p.numel() for p in self.parameters())
