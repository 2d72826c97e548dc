"""The model shapes: ModelConfig (the architecture, checked), the preset ladder with each preset's
default batch, and model_config: a run's preset with its shape keys, fitted to its data."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any, Protocol

from fastpt.errors import ConfigError
from fastpt.settings import NORM_EPS, ROPE_THETA, SOFTCAP

MAX_PARAMS = 10**11  # 100B: far beyond a small-model engine's one node, yet a bound before allocating
MAX_SEQ_LEN = 2**20
ATTENTIONS = ("causal", "document")
MLPS = ("swiglu", "relu2")
QK_NORM_SCALE_MAX = 100.0  # unit-RMS queries and keys times this: past ~10 the softmax is one-hot anyway


@dataclass
class ModelConfig:
    """The architecture: nothing here is a runtime choice (kernels, compile, dtype are not)."""

    vocab_size: int = 32000  # 0 = take it from the data's meta.json / shard header
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 0  # 0 = same as n_heads (no GQA)
    ffn_dim: int = 1408  # the MLP's hidden width, SwiGLU's or relu2's
    max_seq_len: int = 1024
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = True  # the LM head shares the token embedding's weight
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3's q_norm / k_norm)
    mlp: str = "swiglu"  # or relu2: relu(x W1)^2 W2 (modded-nanogpt, nanochat), two matrices to SwiGLU's three
    logit_softcap: float = 0.0  # > 0: the LM head's logits are cap * tanh(logits / cap) (Gemma 2, nanochat)
    unet_skips: bool = False  # block i's input joins block L-1-i's output, by a learned scalar (modded-nanogpt)
    # nanochat's (fastpt.nanochat_parts): norms without a learned weight, a norm after the embedding,
    # per-layer scalars on the residual stream and the embedding, the middle block's output backed out
    parameter_free_norms: bool = False
    embed_norm: bool = False
    layer_scalars: bool = False
    backout: bool = False
    smear: bool = False  # each token's embedding takes a gated share of the previous one's (nanochat)
    value_embeds: bool = False  # a gated value embedding in every other block, the last included (nanochat)
    qk_norm_scale: float = 0.0  # > 0: queries and keys RMS-normed after RoPE, no weight, times this (nanochat's 1.2)
    # A training-time mask, not a shape: "document" lets a token see only earlier tokens of its own
    # document, which doc_token (the data's meta.json eot_id) starts. Export is a causal Llama either way.
    attention: str = "causal"
    doc_token: int | None = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameters of the model this config builds (the tied head counted once)."""
        d, hd = self.dim, self.head_dim
        attention = d * self.n_heads * hd * 2 + d * self.kv_heads * hd * 2  # wq, wo; wk, wv
        mlp = (3 if self.mlp == "swiglu" else 2) * d * self.ffn_dim
        norm = 0 if self.parameter_free_norms else d
        block = attention + mlp + 2 * norm + (2 * hd if self.qk_norm else 0)  # + norms
        head = 0 if self.tie_embeddings else self.vocab_size * d
        skips = self.n_layers // 2 if self.unet_skips else 0
        nanochat = norm * self.embed_norm + 2 * self.n_layers * self.layer_scalars + self.backout
        nanochat += (min(24, d) + 1) * self.smear
        if self.value_embeds:  # a table and a gate (12 channels to each KV head) in every other block
            blocks = (self.n_layers + 1) // 2
            nanochat += blocks * (self.vocab_size * self.kv_heads * hd + min(12, d) * self.kv_heads)
        return self.vocab_size * d + self.n_layers * block + norm + head + skips + nanochat

    def flops_per_token(self, seq_len: int) -> float:
        """MFU's numerator, the model's training FLOPs (forward and backward) per token whatever kernels
        run: 6 x its parameters less a lookup-only (untied) input embedding, a gather with no matmul
        (a tied one is the head's matrix, counted once), plus causal attention's scores and their
        use, 6 x layers x dim x seq_len (half of PaLM's non-causal 12 L d T: a causal kernel skips the
        masked half). The dashboard, --plan and `python -m bench` all call this."""
        lookup = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return 6 * (self.num_params() - lookup) + 6 * self.n_layers * self.dim * seq_len

    def to_dict(self) -> dict[str, Any]:
        """The config as checkpoints store it: its fields and the format they are in (CONFIG_FORMAT)."""
        return {**dataclasses.asdict(self), "format": CONFIG_FORMAT}

    @classmethod
    def from_dict(cls, saved: dict) -> ModelConfig:
        """A config as checkpoints store it (a field it lacks takes its default), an older format's
        in this one's terms (CONFIG_FORMAT); a field or format this fastpt does not know is one
        line, not a guess at what the model was."""
        saved = dict(saved)
        version = saved.pop("format", 1)
        if version not in (1, CONFIG_FORMAT):
            raise ConfigError(f"the checkpoint's model config is in format {version!r}; this fastpt reads 1 and 2")
        if unknown := sorted(set(saved) - set(MODEL_FIELDS)):
            known = ", ".join(unknown)
            raise ConfigError(f"the checkpoint's model config has fields this fastpt does not know: {known}")
        cfg = cls(**saved)
        if version == 1 and cfg.mlp == "relu2":
            cfg.ffn_dim = 3 * cfg.ffn_dim // 2  # format 1's relu2 was 3/2 of ffn_dim wide
        return cfg

    def check(self) -> ModelConfig:
        """One line naming the field for a shape the model cannot have."""
        for key in ("dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"'{key}' must be > 0, got {getattr(self, key)}")
        for key, zero in (("n_kv_heads", "n_heads"), ("vocab_size", "the data's")):
            if getattr(self, key) < 0:
                raise ConfigError(f"'{key}' must be >= 0 (0 = {zero}), got {getattr(self, key)}")
        if self.dim % self.n_heads:
            raise ConfigError(f"'dim' = {self.dim} is not divisible by 'n_heads' = {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"'n_heads' = {self.n_heads} is not divisible by 'n_kv_heads' = {self.kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(
                f"head dim {self.head_dim} (dim {self.dim} / n_heads {self.n_heads}) must be even for RoPE"
            )
        for key, domain in (("norm_eps", NORM_EPS), ("rope_theta", ROPE_THETA)):
            if getattr(self, key) not in domain:
                raise ConfigError(f"'{key}' must be {domain} (a finite number), got {getattr(self, key)}")
        if self.max_seq_len > MAX_SEQ_LEN:
            raise ConfigError(f"'max_seq_len' = {self.max_seq_len:,} is beyond {MAX_SEQ_LEN:,}")
        if self.mlp not in MLPS:
            raise ConfigError(f"'mlp' = {self.mlp!r} is not one of {', '.join(map(repr, MLPS))}")
        if self.logit_softcap not in SOFTCAP:
            raise ConfigError(f"'logit_softcap' must be {SOFTCAP}, got {self.logit_softcap}")
        if not (0 <= self.qk_norm_scale <= QK_NORM_SCALE_MAX and math.isfinite(self.qk_norm_scale)):
            scale, most = self.qk_norm_scale, QK_NORM_SCALE_MAX
            raise ConfigError(f"'qk_norm_scale' must be in [0, {most:g}] (0 = off), got {scale}")
        if self.qk_norm and self.qk_norm_scale:
            raise ConfigError("'qk_norm' (before RoPE) and 'qk_norm_scale' (after RoPE) are two QK-norms: pick one")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"'attention' = {self.attention!r} is not one of {', '.join(map(repr, ATTENTIONS))}")
        if self.attention == "document" and not (
            isinstance(self.doc_token, int) and 0 <= self.doc_token < (self.vocab_size or math.inf)
        ):
            raise ConfigError(
                f"'attention' = 'document' needs a document token id below the vocab "
                f"({self.vocab_size}), got doc_token {self.doc_token!r}"
            )
        if self.num_params() > MAX_PARAMS:  # a typo (an extra zero or two), not a model to allocate
            raise ConfigError(
                f"this shape has {self.num_params():,} parameters, beyond fastpt's {MAX_PARAMS:,}: "
                "check 'dim', 'n_layers', 'ffn_dim' and 'vocab_size'"
            )
        return self


# The model config's format in checkpoints. 1 (unmarked, the first format): ffn_dim was SwiGLU's width
# and relu2's MLP 3/2 of it wide; 2: ffn_dim is the hidden width of either MLP.
CONFIG_FORMAT = 2
MODEL_FIELDS = tuple(f.name for f in fields(ModelConfig))
SHAPE_FIELDS = tuple(k for k in MODEL_FIELDS if k not in ("attention", "doc_token"))  # the TrainConfig shape keys


def upgraded_run(run: dict[str, Any], saved: dict) -> dict[str, Any]:
    """A run's config.toml values in this format's terms, given its checkpoint's model config `saved`:
    a format-1 relu2 run's ffn_dim was SwiGLU's width (its MLP 3/2 of it), and is now the MLP's own.
    Only a value still in format 1's terms (the checkpoint's own) changes, so an upgraded config.toml,
    written before the run's first format-2 checkpoint, stays as it is."""
    old_relu2 = saved.get("format", 1) == 1 and saved.get("mlp") == "relu2"
    if old_relu2 and "ffn_dim" in saved and run.get("ffn_dim") == saved["ffn_dim"]:
        return {**run, "ffn_dim": ModelConfig.from_dict(saved).ffn_dim}
    return run


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=0, dim=128, n_layers=2, n_heads=4, ffn_dim=352, max_seq_len=256),
    "0.04b": ModelConfig(),
    "0.1b": ModelConfig(dim=768, n_layers=12, n_heads=12, ffn_dim=2048),
    "0.35b": ModelConfig(dim=1024, n_layers=24, n_heads=16, ffn_dim=2816, max_seq_len=2048),
    # TinyLlama-1.1B's architecture exactly: GQA with 4 KV heads, untied head, eps 1e-5.
    "1b": ModelConfig(
        dim=2048,
        n_layers=22,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=5632,
        max_seq_len=2048,
        norm_eps=1e-5,
        tie_embeddings=False,
    ),
}
# (micro_batch, grad_accum) per preset: the seed's 16 x 4 for 0.04b; sized to fit one 80 GB GPU
# in bf16 with --compile (the larger ones unmeasured until a GPU run says otherwise).
PRESET_BATCH: dict[str, tuple[int, int]] = {
    "tiny": (16, 1),
    "0.04b": (16, 4),
    "0.1b": (16, 4),
    "0.35b": (16, 4),
    "1b": (8, 8),
}


def describe_presets() -> str:
    """One line per preset: shape, parameters, default batch."""
    lines = []
    for name, m in PRESETS.items():
        params = f"{m.num_params():,} params" if m.vocab_size else "vocab from the data"
        kv = f", {m.kv_heads} kv heads" if m.kv_heads != m.n_heads else ""
        tied = "tied" if m.tie_embeddings else "untied"
        micro, accum = PRESET_BATCH[name]
        lines.append(
            f"  {name:6} {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads{kv}, ffn {m.ffn_dim}, "
            f"vocab {m.vocab_size or 'data'}, seq {m.max_seq_len}, {tied}: {params}; "
            f"batch {micro} x {accum} accum"
        )
    return "\n".join(lines)


# ---- a run's model: the preset with its shape keys, fitted to the data


class RunShape(Protocol):
    """What a run's config (fastpt.config.TrainConfig, which builds on this module) tells of its
    model: the preset, the run's lengths and attention; its shape keys (SHAPE_FIELDS) are read by name."""

    preset: str
    seq_len: int
    attention: str
    init_from: str


def shape_keys(cfg: RunShape) -> dict[str, Any]:
    """The model shape keys given (by TOML or flags) on top of the preset."""
    return {k: getattr(cfg, k) for k in SHAPE_FIELDS if getattr(cfg, k) is not None}


def model_config(
    cfg: RunShape, data_vocab: int, base: ModelConfig | None = None, doc_token: int | None = None
) -> ModelConfig:
    """The preset (or `base`, a model to start from, whose shape the keys may not change) with the
    shape keys given on top; its vocab widened to the data's when the data needs more (e.g. GPT-2
    ids in FineWeb shards; `tiny` always takes the data's), and long enough for the run's seq_len.
    `doc_token` is the data's document token (None: it has none), which --attention document needs."""
    overrides = shape_keys(cfg)
    if base is not None:
        for k, v in overrides.items():
            if k != "max_seq_len" and v != getattr(base, k):
                raise ConfigError(f"'{k}' = {v!r} disagrees with the model of --init-from ({getattr(base, k)!r})")
        if data_vocab > base.vocab_size:
            raise ConfigError(
                f"the data's vocab ({data_vocab}) is larger than the vocab of --init-from "
                f"{cfg.init_from} ({base.vocab_size}): prepare the data with its tokenizer"
            )
    m = dataclasses.replace(base or PRESETS[cfg.preset], **overrides)
    if m.mlp == "relu2" and "ffn_dim" not in overrides and base is None:
        m.ffn_dim = 3 * m.ffn_dim // 2  # the preset's SwiGLU width: relu2's two matrices at its parameters
    if "vocab_size" in overrides and 0 < m.vocab_size < data_vocab:
        raise ConfigError(f"'vocab_size' = {m.vocab_size} is smaller than the data's vocab ({data_vocab})")
    m.vocab_size = max(m.vocab_size, data_vocab)
    if "max_seq_len" in overrides and cfg.seq_len > m.max_seq_len:
        raise ConfigError(f"'seq_len' = {cfg.seq_len} is longer than 'max_seq_len' = {m.max_seq_len}")
    m.max_seq_len = max(m.max_seq_len, cfg.seq_len)
    m.attention, m.doc_token = cfg.attention, doc_token if cfg.attention == "document" else None
    return m.check()
