"""The run's settings: TrainConfig, with every default, help line, choice and valid range in one
place; their resolution and checks (the command line is fastpt.cli).

Resolution order for a run: TrainConfig defaults < the preset's batch < device profile (CPU
only) < --recipe (fastpt.recipes) < TOML file < CLI. Model shape (fastpt.presets): the preset's
ModelConfig < the shape keys given.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from fastpt import float8
from fastpt.errors import ConfigError, elsewhere, suggest
from fastpt.kernels import api as kernels
from fastpt.muon import ORTHOGONALIZERS
from fastpt.plan import gpus
from fastpt.presets import ATTENTIONS, MAX_SEQ_LEN, PRESET_BATCH, PRESETS, shape_keys
from fastpt.presets import ModelConfig as ModelConfig  # fastpt.config.ModelConfig / PRESETS: the stable API names
from fastpt.recipes import RECIPES, describe
from fastpt.settings import (
    BATCH,
    BETA,
    COUNT,
    DECAY,
    LR,
    LR_OR_DEFAULT,
    NORM_EPS,
    PLAN_WORLD,
    ROPE_THETA,
    SEED,
    SOFTCAP,
    STEPS,
    THREADS,
    UNIT,
    Interval,
    setting,
    shape,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # --dtype names
AUTO = "auto"  # micro_batch = "auto": the largest that fits the GPU, planned (fastpt/plan/fit.py)


COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead")  # torch.compile's
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the ones that add CUDA graphs


@dataclass
class TrainConfig:
    recipe: str = setting(
        "seed",
        "a named set of values, below a TOML file and flags: "
        + "; ".join(f"{name}: {describe(name)}" for name in RECIPES),
        choices=tuple(RECIPES),
    )
    # model and data
    preset: str = setting("0.04b", "model size (see --list-presets)", choices=tuple(PRESETS))
    data: str = setting(
        "",
        "folder of train_*.bin / val_*.bin shards, or a weighted mixture of such folders "
        "DIR:WEIGHT,DIR:WEIGHT (in TOML also a table); '' = the default corpus, prepared once",
    )
    packing: str = setting(
        "concat",
        "training windows: concat cuts them from the token stream; bos starts each at "
        "a document token, filled best-fit with whole documents",
        choices=("concat", "bos"),
        recipe=True,
    )
    data_format: str = setting(
        "llmc",
        "llmc: headered shards (fastpt, llm.c, modded-nanogpt); nanogpt: headerless uint16 .bin",
        choices=("llmc", "nanogpt"),
    )
    out: str = setting("runs/default", "run folder: config, metrics.jsonl, checkpoints, tokenizer")
    resume: bool = setting(
        False,
        "continue from the newest complete checkpoint in --out; without one it starts the run "
        "(the same command after a preemption), saying why, unless --out is missing and a typo of a run's "
        "folder (one edit in a name, not a sweep's next name: refused, naming that run)",
    )
    resume_require: bool = setting(
        False,
        "--resume, but stop (exit 2) rather than start over when --out holds no checkpoint (for scripts); "
        "--resume=require is the same",
    )
    resume_or_start: bool = setting(
        False,
        "--resume, but when --out holds no checkpoint start the run there whatever its name: no typo check, "
        "no guess (for scripts and sweeps)",
    )
    run_id: str = setting(
        "",
        "this run's id, kept in config.toml and in each checkpoint: --resume takes no checkpoint of another "
        "run. A new run makes its own; give it with --resume only to adopt another run's checkpoints",
    )
    threads: int = setting(
        0,
        "CPU threads for torch's operators, at most the cores this process may use (more are capped, saying so); "
        "0 = the cores not busy now (those cores minus the 1-minute load average, shared by torchrun's local "
        "ranks), at least 1",
        domain=THREADS,
    )
    init_from: str = setting(
        "",
        "a Hugging Face Llama folder to start from (continued pretraining): its shape "
        "and weights replace the preset's; without --data its tokenizer prepares the "
        "default corpus",
    )
    seq_len: int = setting(
        0, "tokens per training sequence; 0 = the model's max_seq_len", domain=Interval(0, MAX_SEQ_LEN)
    )
    attention: str = setting(
        "causal",
        "causal: a token sees every earlier token of its window; document: only "
        "earlier tokens of its own document (the data's document token starts "
        "one)",
        choices=ATTENTIONS,
        recipe=True,
    )
    # model shape, on top of the preset
    vocab_size: int | None = shape("vocabulary size (at least the data's)")
    dim: int | None = shape("model width")
    n_layers: int | None = shape("transformer blocks")
    n_heads: int | None = shape("attention heads")
    n_kv_heads: int | None = shape("key/value heads (grouped-query attention); 0 = n_heads")
    ffn_dim: int | None = shape(
        "the MLP's hidden width, either MLP's (relu2: 3/2 of the preset's SwiGLU width, its parameters)"
    )
    max_seq_len: int | None = shape("longest sequence (RoPE table)")
    rope_theta: float | None = shape("RoPE base", domain=ROPE_THETA)
    norm_eps: float | None = shape("RMSNorm epsilon", domain=NORM_EPS)
    tie_embeddings: bool | None = shape("share the LM head with the token embedding", recipe=True)
    qk_norm: bool | None = shape(
        "RMSNorm over each head's queries and keys before RoPE (as Qwen3; exports as Qwen3ForCausalLM)", recipe=True
    )
    mlp: str | None = shape(
        "the MLP: swiglu, or relu2: relu(x W1)^2 W2, by default 3/2 of the preset's ffn_dim wide, at SwiGLU's "
        "parameters (modded-nanogpt, nanochat; no Hugging Face export)",
        recipe=True,
    )
    logit_softcap: float | None = shape(
        "cap the LM head's logits at +-this by cap * tanh(logits / cap) (Gemma 2, nanochat); 0 = off "
        "(no Hugging Face export)",
        recipe=True,
        domain=SOFTCAP,
    )
    unet_skips: bool | None = shape(
        "U-net skips: block i's input joins block n_layers-1-i's output through a learned scalar "
        "(modded-nanogpt; no Hugging Face export)",
        recipe=True,
    )
    parameter_free_norms: bool | None = shape(
        "RMSNorms without a learned weight (nanochat; QK-norm's keep theirs; no Hugging Face export)", recipe=True
    )
    embed_norm: bool | None = shape(
        "an RMSNorm after the token embedding (nanochat; no Hugging Face export)", recipe=True
    )
    layer_scalars: bool | None = shape(
        "per-layer scalars: block i reads resid_i * h + x0_i * the embedding, from 1.15 and 0.2 falling with depth "
        "(modded-nanogpt, nanochat; no Hugging Face export)",
        recipe=True,
    )
    backout: bool | None = shape(
        "subtract a learned share (from 0.2) of block n_layers // 2's output before the final norm (nanochat; no "
        "Hugging Face export)",
        recipe=True,
    )
    smear: bool | None = shape(
        "smear: each token's embedding takes in x_(t-1) * a learned scalar (from 0) * a sigmoid gate of its first "
        "24 channels (nanochat; no Hugging Face export)",
        recipe=True,
    )
    value_embeds: bool | None = shape(
        "value embeddings: every other block (the last included) adds a token embedding of its own to its attention "
        "values, through a gate per key/value head (ResFormer; nanochat; no Hugging Face export)",
        recipe=True,
    )
    qk_norm_scale: float | None = shape(
        "QK-norm after RoPE: each head's queries and keys RMS-normed, no weight, times this (nanochat: 1.2); 0 = off "
        "(no Hugging Face export)",
        recipe=True,
    )
    zero_init: bool = setting(
        False, "start the output projections (attention wo, MLP down) at zero (modded-nanogpt, nanochat)", recipe=True
    )
    init: str = setting(
        "gpt2",
        "the weights' start: gpt2: N(0, 0.02), output projections scaled by 1/sqrt(2 n_layers) (--zero-init: zero); "
        "nanochat: the embedding N(0, 0.8) and untied head N(0, 0.001), q, k, v uniform at std 1/sqrt(dim), the MLP's "
        "input at 0.4 of that, output projections zero (give --embed-lr for an embedding at that scale)",
        choices=("gpt2", "nanochat"),
        recipe=True,
    )
    # optimisation: the seed's values
    max_steps: int = setting(10000, "optimizer steps", domain=COUNT)
    micro_batch: int | str = setting(
        16, "sequences per forward/backward, the preset's by default; auto: the most that fit the GPU", domain=BATCH
    )
    grad_accum: int = setting(4, "micro-batches per optimizer step, the preset's by default", domain=BATCH)
    lr: float = setting(5e-4, "peak learning rate", domain=LR)
    min_lr_ratio: float = setting(0.1, "the schedule's floor as a fraction of the peak", domain=UNIT)
    warmup_steps: int = setting(500, "linear warmup steps", domain=STEPS)
    batch_warmup_steps: int = setting(
        0,
        "batch-size warm-up: the sequences per step rise linearly from batch_warmup_start to the full batch "
        "(micro_batch x grad_accum) over these first steps (GPT-3's batch ramp); 0 = off",
        domain=STEPS,
        recipe=True,
    )
    batch_warmup_start: int = setting(
        0,
        "sequences per step (per rank) at the batch warm-up's first step; 0 = one micro-batch as configured "
        "(the preset's under micro_batch auto, which then picks no larger one)",
        domain=Interval(0, BATCH.high**2),  # at most micro_batch x grad_accum's ceilings
        recipe=True,
    )
    schedule: str = setting(
        "cosine",
        "LR after warmup: cosine to min_lr_ratio (the seed's); wsd: constant peak, "
        "then a decay to decay_floor over the last decay_fraction of the steps; "
        "linear: linear decay to min_lr_ratio from the end of warmup",
        choices=("cosine", "wsd", "linear"),
        recipe=True,
    )
    decay_fraction: float = setting(
        0.2, "wsd: the fraction of max_steps that decays", domain=Interval(0, 1, low_open=True)
    )
    decay_floor: float = setting(
        0.0, "wsd: the LR its decay ends at, as a fraction of the peak", domain=UNIT, recipe=True
    )
    decay_shape: str = setting(
        "linear",
        "wsd's decay: linear, or sqrt: floor + (peak - floor) * (1 - sqrt(progress)) (Hägele et al. 2024)",
        choices=("linear", "sqrt"),
        recipe=True,
    )
    optimizer: str = setting(
        "adamw",
        "adamw: the seed's two AdamW groups; muon: Muon for the blocks' 2-D weight "
        "matrices, AdamW for the embedding and head (--embed-lr, --head-lr) and the norms (--lr)",
        choices=("adamw", "muon"),
        recipe=True,
    )
    muon_lr: float = setting(0.02, "Muon's peak learning rate (--optimizer muon), on the same schedule", domain=LR)
    muon_momentum: float = setting(
        0.95, "Muon's (Nesterov) momentum, reached after muon_momentum_warmup steps", domain=BETA, recipe=True
    )
    muon_momentum_warmup: int = setting(
        300, "steps over which Muon's momentum rises linearly from 0.85 to muon_momentum; 0 = off", domain=STEPS
    )
    muon_weight_decay: float = setting(
        0.0,
        "Muon's decoupled weight decay: each step shrinks its matrices by lr * this",
        # wider than AdamW's: nanochat's rule (fastpt.recipes.nanochat_scaling) asks for tens at a small
        # model and batch, beside a Muon LR as many times smaller
        domain=Interval(0, 1000),
    )
    muon_momentum_end: float = setting(
        0.0,
        "Muon's momentum at the end of the LR decay, reached linearly across it from muon_momentum (nanochat: 0.90 "
        "across its warmdown); 0 = held at muon_momentum",
        domain=BETA,
        recipe=True,
    )
    muon_weight_decay_schedule: str = setting(
        "constant",
        "Muon's weight decay over the run: constant, or cosine: muon_weight_decay * (1 + cos(pi * step / "
        "max_steps)) / 2, to zero at the end (nanochat)",
        choices=("constant", "cosine"),
        recipe=True,
    )
    muon_orthogonalize: str = setting(
        "newton-schulz",
        "how Muon orthogonalizes its update: newton-schulz (5 quintic steps, Jordan's) or polar-express (Amsel et al. "
        "2025: a quintic tuned per step; nanochat)",
        choices=ORTHOGONALIZERS,
        recipe=True,
    )
    normuon: bool = setting(
        False,
        "NorMuon (Li et al. 2025; nanochat): Muon's orthogonalized update divided per row (a wide matrix's per "
        "column) by the root of its running mean square (beta2 0.9), then scaled back to its norm",
        recipe=True,
    )
    cautious_weight_decay: bool = setting(
        False,
        "Muon's weight decay only on the entries its update also moves toward zero (cautious weight decay, Chen et "
        "al. 2025; nanochat)",
        recipe=True,
    )
    embed_lr: float = setting(
        0.0,
        "--optimizer muon: the untied embedding's peak AdamW LR; 0 = 0.004 * (dim / 768) ** -0.5 "
        "(nanochat's 0.2, for its embedding at init std 1, at ours of 0.02)",
        domain=LR_OR_DEFAULT,
    )
    head_lr: float = setting(
        0.0,
        "--optimizer muon: the head's peak AdamW LR, a tied embedding's too (the head's scale, as modded-nanogpt's "
        "tied records ran it); 0 = nanochat's 0.004 * (dim / 768) ** -0.5",
        domain=LR_OR_DEFAULT,
    )
    muon_adam_beta1: float = setting(
        0.8, "--optimizer muon: beta1 of the embedding's and head's AdamW (beta2 is beta2; nanochat's 0.8)", domain=BETA
    )
    adamw_groups: str = setting(
        "shared",
        "--optimizer muon: shared: the embedding's and head's AdamW take muon_adam_beta1, beta2, eps and weight_decay; "
        "nanochat: nanochat's own per group, the head (0.8, 0.96) decayed 0.01, the embedding (0.8, 0.995) "
        "decayed 0.001, eps 1e-10",
        choices=("shared", "nanochat"),
        recipe=True,
    )
    weight_decay: float = setting(0.1, "AdamW weight decay", domain=DECAY)
    decay_rule: str = setting(
        "ndim",
        "ndim: decay tensors with >= 2 dims; strict: also spare biases, norms, embeddings",
        choices=("ndim", "strict"),
        recipe=True,
    )
    beta1: float = setting(0.9, "AdamW beta1", domain=BETA)
    beta2: float = setting(0.95, "AdamW beta2", domain=BETA)
    eps: float = setting(1e-8, "AdamW epsilon", domain=Interval(0, 1, low_open=True))  # past 1: above any gradient
    max_grad_norm: float = setting(  # a norm of a million clips nothing: 0 says so
        1.0, "clip the global gradient norm to this; 0 = no clipping", domain=Interval(0, 1e6)
    )
    z_loss: float = setting(
        0.0,
        "z-loss coefficient (PaLM, OLMo: 1e-4): adds z_loss * logsumexp^2 to the loss, logged apart as z_loss; 0 = off",
        domain=UNIT,
        recipe=True,
    )
    # speed
    dtype: str = setting("bf16", "autocast precision (fp16 uses a GradScaler, CUDA only)", choices=tuple(DTYPES))
    compile: bool = setting(False, "torch.compile the model")
    compile_mode: str = setting(
        "default",
        "torch.compile mode with --compile; reduce-overhead and max-autotune add CUDA graphs",
        choices=COMPILE_MODES,
    )
    activation_checkpointing: str = setting(
        "none",
        "recompute block activations in the backward to save memory: full = every block's whole forward, "
        "selective = each block's pointwise ops and every second matmul (torchtitan's op policy)",
        choices=("none", "full", "selective"),
    )
    float8: bool = setting(
        False, "float8 matmuls in the blocks' linear layers via torchao (CUDA, compute capability >= 8.9)"
    )
    kernels: str = setting("auto", "auto: Triton on CUDA, PyTorch elsewhere", choices=("auto", "triton", "torch"))
    device: str = setting("", "'' = cuda if available, else cpu", choices=("", "cpu", "cuda"))
    parallel: str = setting("ddp", "data parallelism under torchrun", choices=("ddp", "fsdp"))
    fsdp_reshard_grads: bool = setting(False, "FSDP: reduce-scatter every micro-step (no unsharded gradients kept)")
    profile: str = setting("", "record torch.profiler traces of steps START:END (e.g. 3:5) into OUT/profile; '' = off")
    # bookkeeping
    log_every: int = setting(10, "steps between dashboard lines / metrics records", domain=COUNT)
    eval_every: int = setting(500, "steps between validation evals", domain=COUNT)
    eval_tokens: int = setting(262144, "validation tokens per eval", domain=COUNT)
    eval_mc: str = setting(
        "",
        "multiple-choice tasks scored at every eval: a JSONL file of rows (ctx, endings, label) as "
        "mc_acc, or NAME=FILE,NAME=FILE as mc_acc/NAME and their mean mc_acc (in TOML also a table); '' = off",
        recipe=True,
    )
    eval_mc_norm: str = setting(
        "byte",
        "an MC ending's log-likelihood per: byte (lm-eval's acc_bytes), char (acc_norm), token "
        "(nanochat's CORE), none (acc)",
        choices=("byte", "char", "token", "none"),
        recipe=True,
    )
    ckpt_every: int = setting(1000, "steps between checkpoints", domain=COUNT)
    keep_checkpoints: int = setting(3, "newest checkpoints kept on disk", domain=COUNT)
    on_nonfinite: str = setting(
        "stop", "on a NaN/inf loss or gradient: stop, or skip the update", choices=("stop", "skip")
    )
    max_skips: int = setting(10, "stop after this many skipped updates in a row", domain=COUNT)
    seed: int = setting(1337, "seed for init and data order", domain=SEED)
    tensorboard: bool = setting(False, "also write TensorBoard events to OUT/tensorboard")
    wandb: str = setting("", "Weights & Biases project to log to; '' = off")
    # memory planning (fastpt/plan/planner.py; the --plan command and auto: fastpt/plan/fit.py)
    plan: bool = setting(False, "print the run's planned memory per GPU (its step over fake tensors) and exit")
    plan_json: str = setting("", "with --plan: also write the plan here as JSON")
    plan_gpu: str = setting(
        "", "the card to plan for: h100-80, h200, l4, ... (an unknown name lists them) or NGiB; '' = this machine's GPU"
    )
    plan_world_size: int = setting(
        1, "with --plan: GPUs to plan for (the per-rank peak under --parallel)", domain=PLAN_WORLD
    )
    plan_price: float = setting(
        0.0,
        "with --plan: USD per GPU-hour, to price the run's max_steps; 0 = no cost",
        domain=Interval(0, 1000),  # cards rent at $1-10 an hour; 1e308 priced a run at $inf
    )


# On a CPU the zero-config run must finish in minutes, on a loaded 2-core machine too (README,
# Quick start: measured), with a visibly falling loss: these replace the defaults there (a TOML
# file or flag still wins).
CPU_PROFILE: dict[str, Any] = dict(
    preset="tiny",
    max_steps=300,
    warmup_steps=30,
    micro_batch=16,
    grad_accum=1,
    seq_len=128,
    lr=2e-3,
    dtype="fp32",
    eval_every=100,
    eval_tokens=32768,
    ckpt_every=100,
    log_every=10,
    out="runs/cpu",
)

FIELDS = {f.name: f for f in fields(TrainConfig)}
FIELD_TYPES: dict[str, type] = {  # "int | None" -> int
    name: next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
    for name, hint in typing.get_type_hints(TrainConfig).items()
}


def coerce(key: str, value: Any, source: str) -> Any:
    """Check one key/value pair against TrainConfig and return it with the field's type."""
    if key not in FIELD_TYPES:
        raise ConfigError(f"{source}: unknown config key '{key}'{elsewhere(key) or suggest(key, FIELD_TYPES)}")
    if key == "micro_batch" and value == AUTO:
        return value
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
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    for key, sep in (("data", ":"), ("eval_mc", "=")):  # a table: [data] web = 0.8, code = 0.2
        if isinstance(raw.get(key), dict):
            raw[key] = ",".join(f"{name}{sep}{value}" for name, value in raw[key].items())
    return {k: coerce(k, v, str(path)) for k, v in raw.items()}


def validate(cfg: TrainConfig) -> TrainConfig:
    """Reject nonsense values with a message that names the key and the value."""
    for name, f in FIELDS.items():
        value, choices, domain = getattr(cfg, name), f.metadata["choices"], f.metadata["domain"]
        if choices and value not in choices:
            raise ConfigError(
                f"'{name}' = {value!r} is not one of {', '.join(map(repr, choices))}{suggest(value, choices)}"
            )
        if domain and value is not None and value != AUTO and value not in domain:  # None: the preset's shape
            finite = " (a finite number)" if isinstance(value, float) and not math.isfinite(value) else ""
            raise ConfigError(f"'{name}' must be {domain}{finite}, got {value!r}")
    if cfg.warmup_steps > cfg.max_steps:
        raise ConfigError(f"'warmup_steps' ({cfg.warmup_steps}) is larger than 'max_steps' ({cfg.max_steps})")
    check_batch_warmup(cfg)
    if cfg.compile_mode != "default" and not cfg.compile:
        raise ConfigError(f"'compile_mode' = {cfg.compile_mode!r} needs --compile")
    if cfg.compile_mode in CUDA_GRAPH_MODES and cfg.grad_accum > 1:
        # CUDA-graph trees hand the backward's output buffers to .grad and overwrite them on the
        # next micro-step's replay (pytorch/pytorch#169545): accumulated gradients would be wrong.
        raise ConfigError(
            f"'compile_mode' = {cfg.compile_mode!r} (CUDA graphs) needs 'grad_accum' = 1, "
            f"got {cfg.grad_accum}: raise micro_batch instead"
        )
    tied = cfg.tie_embeddings if cfg.tie_embeddings is not None else PRESETS[cfg.preset].tie_embeddings
    if cfg.init == "nanochat" and tied:
        raise ConfigError(
            "'init' = 'nanochat' needs an untied head (--no-tie-embeddings): it starts the embedding at std 0.8, "
            "the head at 0.001"
        )
    if cfg.plan_gpu:  # a train run checks it too: config.toml keeps only values that plan
        gpus.card(cfg.plan_gpu)
    for key in ("resume_require", "resume_or_start"):
        if getattr(cfg, key) and not cfg.resume:
            raise ConfigError(f"'{key}' is a kind of --resume: drop --no-resume (or resume = false)")
    if cfg.resume_require and cfg.resume_or_start:
        raise ConfigError("'resume_require' and 'resume_or_start' disagree on a folder with nothing to resume")
    if not cfg.out.strip():  # an unset shell variable: the run would fill the current folder
        raise ConfigError("'out' is empty: give the run folder (--out DIR)")
    if cfg.parallel == "fsdp" and cfg.compile_mode in CUDA_GRAPH_MODES:
        raise ConfigError(
            f"'compile_mode' = {cfg.compile_mode!r} uses CUDA graphs, which FSDP's per-step "
            "all-gathers defeat; use 'max-autotune-no-cudagraphs' or 'default'"
        )
    if cfg.parallel == "fsdp" and cfg.dtype == "fp16":
        raise ConfigError(
            "'parallel' = 'fsdp' supports bf16 and fp32, not fp16: the fp16 GradScaler "
            "would check only this rank's gradient shards for overflow"
        )
    if cfg.schedule == "wsd" and wsd_decay_steps(cfg) <= 0:
        raise ConfigError(
            f"'schedule' = 'wsd' never decays: 'decay_fraction' {cfg.decay_fraction} of 'max_steps' {cfg.max_steps} "
            f"(after 'warmup_steps' {cfg.warmup_steps}) rounds to 0 steps; raise decay_fraction or max_steps"
        )
    profile_steps(cfg)
    if not cfg.init_from:  # a shape that cannot work fails now, not after the data is prepared
        dataclasses.replace(PRESETS[cfg.preset], **shape_keys(cfg)).check()
    return cfg


def configured_micro_batch(cfg: TrainConfig) -> int:
    """The micro-batch the config asks for: its own, or the preset's (the CPU profile's) when it says auto."""
    if cfg.micro_batch != AUTO:
        return cfg.micro_batch
    return CPU_PROFILE["micro_batch"] if cfg.device == "cpu" else PRESET_BATCH.get(cfg.preset, (16, 0))[0]


def check_batch_warmup(cfg: TrainConfig) -> None:
    """A batch warm-up ramps within the run, from whole micro-batches to more sequences than it starts with."""
    if not cfg.batch_warmup_steps:
        if cfg.batch_warmup_start:
            raise ConfigError("'batch_warmup_start' needs 'batch_warmup_steps' (the steps the batch ramps over)")
        return
    if cfg.batch_warmup_steps > cfg.max_steps:
        raise ConfigError(
            f"'batch_warmup_steps' ({cfg.batch_warmup_steps:,}) is larger than 'max_steps' ({cfg.max_steps:,})"
        )
    micro = configured_micro_batch(cfg)
    start, full = cfg.batch_warmup_start or micro, micro * cfg.grad_accum
    if start >= full:
        raise ConfigError(
            f"'batch_warmup_steps' ramps the batch from 'batch_warmup_start' = {start} sequences up to "
            f"micro_batch x grad_accum = {micro} x {cfg.grad_accum} = {full}: nothing to ramp; raise grad_accum"
        )
    if cfg.micro_batch != AUTO and start < micro:
        raise ConfigError(
            f"'batch_warmup_start' = {start} sequences is less than one micro-batch ('micro_batch' = {micro}): "
            "a step trains whole micro-batches"
        )


def wsd_decay_steps(cfg: TrainConfig) -> int:
    """The steps --schedule wsd decays over: the last decay_fraction of max_steps, after warmup."""
    return cfg.max_steps - max(cfg.warmup_steps, cfg.max_steps - round(cfg.decay_fraction * cfg.max_steps))


def uses_cuda_graphs(cfg: TrainConfig) -> bool:
    """Whether the run's compiled model records CUDA graphs (then each forward marks its step)."""
    return cfg.compile and cfg.compile_mode in CUDA_GRAPH_MODES


def begin_cuda_graph_step(cfg: TrainConfig) -> None:
    """torch.compiler.cudagraph_mark_step_begin where the run records CUDA graphs (they may reuse their
    buffers from one step to the next); nowhere else, since the call imports Inductor's compiler
    (some 1.8 CPU s of a short CPU run)."""
    if uses_cuda_graphs(cfg):
        torch.compiler.cudagraph_mark_step_begin()


def profile_steps(cfg: TrainConfig) -> tuple[int, int] | None:
    """The steps START:END (1-based, both included) that --profile records; None when off."""
    if not cfg.profile:
        return None
    start, sep, end = cfg.profile.partition(":")
    if not (sep and start.strip().isdecimal() and end.strip().isdecimal()):
        raise ConfigError(f"'profile' = {cfg.profile!r} is not START:END (steps, e.g. 3:5)")
    start, end = int(start), int(end)
    if not 1 <= start <= end <= cfg.max_steps:
        raise ConfigError(f"'profile' = {cfg.profile!r} must satisfy 1 <= START <= END <= max_steps ({cfg.max_steps})")
    return start, end


def pick_device(cli: dict) -> str:
    return cli.get("device", "") or ("cuda" if torch.cuda.is_available() else "cpu")


def check_runtime(cfg: TrainConfig) -> None:
    """Choices the config allows but this machine cannot run: every device check is here."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'device' = 'cuda' but torch sees no CUDA device")
    if cfg.dtype == "fp16" and cfg.device != "cuda":
        raise ConfigError(f"'dtype' = 'fp16' needs a CUDA device (got {cfg.device}); use bf16 or fp32")
    if cfg.dtype == "bf16" and cfg.device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"'dtype' = 'bf16' is not supported on {torch.cuda.get_device_name()}; use fp16 or fp32")
    if cfg.kernels == "triton" and not kernels.available():
        raise ConfigError(
            "'kernels' = 'triton' cannot run here: it needs Triton and a CUDA device "
            "(or TRITON_INTERPRET=1 on a CPU, slowly); use 'auto'"
        )
    if cfg.float8:
        float8.check(torch.device(cfg.device))


def resolve(cli: dict[str, Any], config_file: str | None, device: str, run: dict | None = None) -> TrainConfig:
    """Merge defaults, the preset's batch, the CPU profile, the recipe, a resumed `run`'s config.toml
    (cli.resumed_run), the TOML file and the CLI (later wins), then validate."""
    file_values = load_toml(config_file) if config_file else {}
    flags = {k: coerce(k, v, "command line") for k, v in cli.items()}
    given = {**(run or {}), **resume_implied(file_values), **resume_implied(flags)}
    merged: dict[str, Any] = dict(CPU_PROFILE) if device == "cpu" else {}
    merged.update(recipe_values(given.get("recipe", FIELDS["recipe"].default)))
    merged.update(given)
    preset = merged.get("preset", FIELDS["preset"].default)
    if preset in PRESET_BATCH and device != "cpu":
        micro_batch, grad_accum = PRESET_BATCH[preset]
        merged.setdefault("micro_batch", micro_batch)
        merged.setdefault("grad_accum", grad_accum)
    merged["device"] = device
    cfg = TrainConfig(**merged)
    if "warmup_steps" not in given and cfg.warmup_steps > cfg.max_steps:
        cfg.warmup_steps = cfg.max_steps // 10  # a default warmup adapts to a short run
    if cfg.batch_warmup_steps and not cfg.batch_warmup_start:  # fixed now: --micro-batch auto must keep it
        cfg.batch_warmup_start = configured_micro_batch(cfg)
    return validate(cfg)


def resume_implied(values: dict[str, Any]) -> dict[str, Any]:
    """Flags (or a TOML file's keys) with --resume-require or --resume-or-start and no word of --resume:
    each is a kind of --resume, and alone means it too."""
    if "resume" not in values and (values.get("resume_require") or values.get("resume_or_start")):
        return {**values, "resume": True}
    return values


def recipe_values(name: str) -> dict[str, Any]:
    """What --recipe `name` sets; an unknown name is one line with the closest one."""
    if name not in RECIPES:
        raise ConfigError(f"'recipe' = {name!r} is not one of {', '.join(map(repr, RECIPES))}{suggest(name, RECIPES)}")
    return RECIPES[name]


def to_toml(cfg: TrainConfig) -> str:
    """The config as TOML (flat keys; unset shape keys left out), loadable again with --config."""

    fmt = lambda v: json.dumps(v) if isinstance(v, bool | str) else repr(v)  # TOML's true and "..." are JSON's
    comment = f"# recipe {cfg.recipe}: {describe(cfg.recipe)}; the keys below are the resolved values\n"
    return comment + "".join(f"{k} = {fmt(v)}\n" for k, v in dataclasses.asdict(cfg).items() if v is not None)
