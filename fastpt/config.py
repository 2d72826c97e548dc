"""Configs as dataclasses, with every default in one place.

Resolution order for a run: TrainConfig defaults < device profile (CPU only) < TOML file < CLI.
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A user's config mistake; the CLI prints it as one line and exits non-zero."""


@dataclass
class ModelConfig:
    vocab_size: int = 32000  # 0 = take it from the data's meta.json / shard header
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 0  # 0 = same as n_heads (no GQA)
    ffn_dim: int = 1408
    max_seq_len: int = 1024
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    kernels: str = "auto"  # auto | triton | torch

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS: dict[str, ModelConfig] = {
    "0.04b": ModelConfig(),
    "tiny": ModelConfig(vocab_size=0, dim=128, n_layers=2, n_heads=4, ffn_dim=352, max_seq_len=256),
}


@dataclass
class TrainConfig:
    # model and data
    preset: str = "0.04b"
    data: str = ""  # folder of train_*.bin / val_*.bin; "" = the default corpus (prepared once)
    data_format: str = "llmc"  # llmc (headered shards) | nanogpt (headerless uint16 train.bin/val.bin)
    out: str = "runs/default"
    resume: bool = False
    seq_len: int = 0  # 0 = the preset's max_seq_len
    # optimisation: the seed's values
    max_steps: int = 10000
    micro_batch: int = 16
    grad_accum: int = 4
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 500
    weight_decay: float = 0.1
    decay_rule: str = "ndim"  # ndim | strict
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    # speed
    dtype: str = "bf16"  # bf16 | fp16 | fp32
    compile: bool = False
    kernels: str = "auto"  # auto | triton | torch
    device: str = ""  # "" = cuda if available, else cpu
    parallel: str = "ddp"  # ddp | fsdp (under torchrun)
    # bookkeeping
    log_every: int = 10
    eval_every: int = 500
    eval_tokens: int = 262144
    ckpt_every: int = 1000
    keep_checkpoints: int = 3
    on_nonfinite: str = "stop"  # stop | skip
    max_skips: int = 10
    seed: int = 1337
    tensorboard: bool = False
    wandb: str = ""  # project name; "" = off


# One line per TrainConfig field for `python -m fastpt.train --help` (tests check none is missing).
HELP: dict[str, str] = {
    "preset": "model size",
    "data": "folder of train_*.bin / val_*.bin shards; '' = the default corpus, prepared once",
    "data_format": "llmc: headered shards (fastpt, llm.c, modded-nanogpt); nanogpt: headerless uint16 .bin",
    "out": "run folder: config, metrics.jsonl, checkpoints, tokenizer",
    "resume": "continue from the newest complete checkpoint in --out",
    "seq_len": "tokens per training sequence; 0 = the preset's max_seq_len",
    "max_steps": "optimizer steps",
    "micro_batch": "sequences per forward/backward",
    "grad_accum": "micro-batches per optimizer step",
    "lr": "peak learning rate",
    "min_lr_ratio": "cosine floor as a fraction of the peak",
    "warmup_steps": "linear warmup steps",
    "weight_decay": "AdamW weight decay",
    "decay_rule": "ndim: decay tensors with >= 2 dims; strict: also spare biases, norms, embeddings",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "eps": "AdamW epsilon",
    "max_grad_norm": "clip the global gradient norm to this",
    "dtype": "autocast precision (fp16 uses a GradScaler, CUDA only)",
    "compile": "torch.compile the model",
    "kernels": "auto: Triton on CUDA, PyTorch elsewhere",
    "device": "'' = cuda if available, else cpu",
    "parallel": "data parallelism under torchrun",
    "log_every": "steps between dashboard lines / metrics records",
    "eval_every": "steps between validation evals",
    "eval_tokens": "validation tokens per eval",
    "ckpt_every": "steps between checkpoints",
    "keep_checkpoints": "newest checkpoints kept on disk",
    "on_nonfinite": "on a NaN/inf loss or gradient: stop, or skip the update",
    "max_skips": "stop after this many skipped updates in a row",
    "seed": "seed for init and data order",
    "tensorboard": "also write TensorBoard events to OUT/tensorboard",
    "wandb": "Weights & Biases project to log to; '' = off",
}

# On a CPU the zero-config run must finish in minutes: these replace the defaults there
# (a TOML file or flag still wins).
CPU_PROFILE: dict[str, Any] = dict(
    preset="tiny", max_steps=1000, warmup_steps=50, micro_batch=16, grad_accum=1,
    seq_len=128, lr=2e-3, dtype="fp32", eval_every=250, eval_tokens=32768, ckpt_every=250,
    log_every=10, out="runs/cpu",
)

CHOICES: dict[str, tuple[str, ...]] = {
    "preset": tuple(PRESETS),
    "data_format": ("llmc", "nanogpt"),
    "decay_rule": ("ndim", "strict"),
    "dtype": ("bf16", "fp16", "fp32"),
    "kernels": ("auto", "triton", "torch"),
    "device": ("", "cpu", "cuda"),
    "parallel": ("ddp", "fsdp"),
    "on_nonfinite": ("stop", "skip"),
}
POSITIVE = ("max_steps", "micro_batch", "grad_accum", "lr", "log_every", "eval_every",
            "eval_tokens", "ckpt_every", "keep_checkpoints", "max_skips")
NON_NEGATIVE = ("seq_len", "warmup_steps", "weight_decay", "min_lr_ratio", "max_grad_norm", "eps")

FIELD_TYPES: dict[str, type] = {f.name: type(f.default) for f in fields(TrainConfig)}


def suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def coerce(key: str, value: Any, source: str) -> Any:
    """Check one key/value pair against TrainConfig and return it with the field's type."""
    if key not in FIELD_TYPES:
        raise ConfigError(f"{source}: unknown config key '{key}'{suggest(key, FIELD_TYPES)}")
    want = FIELD_TYPES[key]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: '{key}' must be {want.__name__}, got {value!r}")
    return value


def load_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return {k: coerce(k, v, str(path)) for k, v in raw.items()}


def validate(cfg: TrainConfig) -> TrainConfig:
    """Reject nonsense values with a message that names the key and the value."""
    for key, allowed in CHOICES.items():
        value = getattr(cfg, key)
        if value not in allowed:
            raise ConfigError(f"'{key}' = {value!r} is not one of {', '.join(repr(a) for a in allowed)}")
    for key in POSITIVE:
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"'{key}' must be > 0, got {getattr(cfg, key)!r}")
    for key in NON_NEGATIVE:
        if getattr(cfg, key) < 0:
            raise ConfigError(f"'{key}' must be >= 0, got {getattr(cfg, key)!r}")
    if cfg.min_lr_ratio > 1:
        raise ConfigError(f"'min_lr_ratio' must be in [0, 1], got {cfg.min_lr_ratio!r}")
    if cfg.warmup_steps > cfg.max_steps:
        raise ConfigError(f"'warmup_steps' ({cfg.warmup_steps}) is larger than 'max_steps' ({cfg.max_steps})")
    return cfg


def resolve(cli: dict[str, Any], config_file: str | None, device: str) -> TrainConfig:
    """Merge defaults, the CPU profile, the TOML file and the CLI (later wins), then validate."""
    merged: dict[str, Any] = {}
    file_values = load_toml(config_file) if config_file else {}
    if device == "cpu":
        merged.update(CPU_PROFILE)
    merged.update(file_values)
    merged.update({k: coerce(k, v, "command line") for k, v in cli.items()})
    merged["device"] = device
    cfg = TrainConfig(**merged)
    if "warmup_steps" not in file_values and "warmup_steps" not in cli and cfg.warmup_steps > cfg.max_steps:
        cfg.warmup_steps = cfg.max_steps // 10  # a default warmup adapts to a short run
    return validate(cfg)


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML (flat keys), loadable again with --config."""
    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return repr(v)
    return "".join(f"{k} = {fmt(v)}\n" for k, v in dataclasses.asdict(cfg).items())


def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    """The preset, its vocab widened to the data's when the data needs more (e.g. GPT-2 ids in
    FineWeb shards; `tiny` always takes the data's), and long enough for the run's seq_len."""
    m = dataclasses.replace(PRESETS[cfg.preset], kernels=cfg.kernels)
    m.vocab_size = max(m.vocab_size, vocab_size)
    if cfg.seq_len > m.max_seq_len:
        m.max_seq_len = cfg.seq_len
    return m
