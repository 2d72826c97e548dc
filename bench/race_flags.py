"""The race's flags: its recipes, its command line checked before anything runs (one line, exit 2,
on a bad value), and the fastpt.train flags of each run (model, schedule fitted to its budget, LRs)."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import tempfile
from pathlib import Path

from fastpt.data.shards import MAX_VOCAB
from fastpt.errors import FastptError
from fastpt.recipes import CANDIDATES, nanochat_scaling
from fastpt.recipes import RECIPES as FASTPT_RECIPES
from fastpt.settings import SEED

RECIPES: dict[str, list[str]] = {  # name -> the fastpt.train flags it adds to the seed recipe
    "seed": [],
    "wsd": ["--schedule", "wsd"],  # linear to 0
    "wsd-sqrt": ["--schedule", "wsd", "--decay-shape", "sqrt"],
    "muon": ["--optimizer", "muon"],  # with its per-group defaults: embed/head LRs, betas, momentum warmup
    "muon-plain": shlex.split(
        "--optimizer muon --muon-momentum-warmup 0 --muon-adam-beta1 0.9 --head-lr {lr} --embed-lr {lr}"
    ),
    "qk-norm": ["--qk-norm"],
    "zero-init": ["--zero-init"],
    "untied": ["--no-tie-embeddings"],
    "bos": ["--packing", "bos"],
    "modern": ["--recipe", "modern"],
    "nanochat": ["--recipe", "nanochat"],  # at nanochat's batch and horizon rules: SCALED
    "relu2": ["--mlp", "relu2"],
    "softcap": ["--logit-softcap", "15"],
    "unet": ["--unet-skips"],
    # the same 16 sequences a step, as 4 micro-batches of 4, of which the first steps take fewer
    "batch-warmup": shlex.split("--micro-batch 4 --grad-accum 4 --batch-warmup-steps 50"),
    **{f"modern-{name}": ["--recipe", f"modern-{name}"] for name in CANDIDATES},
}
# a recipe the sweep skips runs at the best multiplier of its base (the seed's by default); modern's
# candidates at modern's
BASE = {"wsd-sqrt": "wsd", "muon-plain": "muon", **{f"modern-{name}": "modern" for name in CANDIDATES}}
SWEPT = "seed,wsd,muon,modern"
# recipes whose LRs and Muon weight decay follow their own rules for the run's batch and tokens:
# name -> (tokens per step, run tokens) -> (LR factor, weight decay)
SCALED = {"nanochat": nanochat_scaling}
LR_FLAGS = {"lr": "--lr", "embed": "--embed-lr", "head": "--head-lr", "muon": "--muon-lr"}
FITTED = ("--max-steps", "--warmup-steps")  # the race sets these per run; --muon-momentum-warmup may only be 0
MODEL = "--preset tiny --dim 64 --n-layers 3 --n-heads 4 --ffn-dim 176 --seq-len 128 --micro-batch 16"
EVALS = 5  # evals per run (the last, at its final step, is the one that counts)
CHECK_STEPS = 1000  # the run length flags are checked at before a corpus's own is known


class UsageError(FastptError):
    """A bad race command line or recipe: one line, exit 2."""


# ---- the command line, checked before anything runs


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own complaints: one line too, not usage + error
        raise UsageError(message)


def numbers(flag: str, text: str, low: float = 0.0, high: float = math.inf) -> list[float]:
    """A comma-separated list of finite numbers in (low, high]; else one line naming the flag and value."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: not a comma-separated list of numbers") from None
    if not all(math.isfinite(v) and low < v <= high for v in values):  # NaN fails too
        raise UsageError(
            f"{flag} {text!r}: every value must be > {low:g}"
            + (f" and <= {high:g}" if high < math.inf else " and finite")
        )
    return values


def check_args(args: argparse.Namespace) -> None:
    """Every flag's value, before a recipe is parsed, a corpus prepared or a package looked for."""
    if not (math.isfinite(args.tokens_per_param) and args.tokens_per_param > 0):
        raise UsageError(f"--tokens-per-param {args.tokens_per_param:g}: must be a positive number")
    numbers("--multipliers", args.multipliers)
    budgets = numbers("--budgets", args.budgets, high=1.0)
    if budgets != sorted(set(budgets)) or budgets[-1] != 1.0:
        raise UsageError(f"--budgets {args.budgets!r}: fractions of the budget, ascending, ending at 1 (the full one)")
    least = {
        "--seeds": 1,
        "--widen": 0,
        "--speed-rounds": 0,
        "--speed-steps": 1,
        "--eval-tokens": 1,
        "--threads": 1,
        "--jobs": 1,
    }
    for flag, low in least.items():
        if (value := getattr(args, flag[2:].replace("-", "_"))) < low:
            raise UsageError(f"{flag} {value}: must be at least {low}")
    for flag, value in (
        ("--warmup-fraction", args.warmup_fraction),
        ("--momentum-warmup-fraction", args.momentum_warmup_fraction),
    ):
        if not 0 <= value < 1:
            raise UsageError(f"{flag} {value:g}: must be in [0, 1)")
    if not 257 <= args.vocab_size <= MAX_VOCAB:  # what fastpt.prepare trains a BPE at
        raise UsageError(f"--vocab-size {args.vocab_size}: must be in [257, {MAX_VOCAB}] (256 bytes + end-of-text)")
    highest = int(SEED.high) - (args.seeds - 1)  # every seed of the race is one NumPy takes
    if highest < 0:
        raise UsageError(f"--seeds {args.seeds}: more than NumPy's {int(SEED.high) + 1} seeds")
    if not 0 <= args.seed <= highest:
        raise UsageError(f"--seed {args.seed}: must be in [0, {highest}] with --seeds {args.seeds}")
    for spec in args.corpora.split(","):
        if spec not in ("default", "shakespeare") and not (Path(spec) / "meta.json").is_file():
            raise UsageError(f"--corpora: {spec!r} is not 'default', 'shakespeare' or a prepared folder (no meta.json)")
    check_fitted("--train-args", shlex.split(args.train_args))
    given_multipliers(args)
    names = {*RECIPES, *(spec.partition("=")[0] for spec in args.recipe)}
    if unknown := [name for name in args.sweep.split(",") if name not in names]:
        raise UsageError(f"--sweep: unknown recipe {unknown[0]!r} (RECIPES: {', '.join(RECIPES)}, or a --recipe)")
    if args.device == "cuda" and not torch_sees_cuda():
        raise UsageError("--device cuda: torch sees no CUDA device")
    for flag, folder in (("--work", args.work), ("--save", args.save)):
        if folder:
            writable(flag, Path(folder))
    for spec in dict.fromkeys(args.corpora.split(",")):
        budget_steps(args, *seed_size(args, corpus_vocab(spec, args.vocab_size)))


def torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def writable(flag: str, folder: Path) -> None:
    """`folder` can be made and written: a file can be made in its nearest existing ancestor. Tried,
    with a nameless temporary file (a refused race leaves nothing behind): os.access tells root that
    /proc and /sys are writable, where nothing can be made."""
    there = next(p for p in (folder, *folder.parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError:
        raise UsageError(
            f"--{flag[2:]} {str(folder)!r}: cannot write there ({str(there)!r} is not a writable folder)"
        ) from None


def corpus_vocab(spec: str, vocab_size: int) -> int:
    """A corpus's vocab: --vocab-size for those the race prepares, a prepared folder's own."""
    return vocab_size if spec in ("default", "shakespeare") else folder_vocab(Path(spec))


def folder_vocab(data: Path) -> int:
    return json.loads((data / "meta.json").read_text())["vocab_size"]


def seed_size(args: argparse.Namespace, vocab: int) -> tuple[int, int]:
    """The seed model's parameter count at `vocab`, and the tokens of one of its steps."""
    from fastpt.presets import model_config

    cfg = resolve(common_flags(args, CHECK_STEPS), args.device)
    return model_config(cfg, vocab).num_params(), cfg.seq_len * cfg.micro_batch * cfg.grad_accum


def budget_steps(args: argparse.Namespace, params: int, per_step: int) -> tuple[int, list[tuple[float, int]]]:
    """The full budget's steps and each --budgets fraction's (fraction, steps); one line when the
    budget, or a fraction of it, is less than one step."""
    full = args.tokens_per_param * params / per_step
    if full < 1:
        raise UsageError(
            f"--tokens-per-param {args.tokens_per_param:g}: the full budget is {full:.3g} steps "
            f"({params:,} params, {per_step:,} tokens a step); it must be at least one"
        )
    fractions = numbers("--budgets", args.budgets, high=1.0)
    if short := [f for f in fractions if f * full < 1]:
        raise UsageError(
            f"--budgets {short[0]:g}: {short[0] * full:.3g} of the budget's {full:.3g} steps rounds to 0 steps; "
            "raise it or --tokens-per-param"
        )
    steps = math.ceil(full)
    return steps, [(f, math.ceil(f * steps)) for f in fractions]


def given_multipliers(args: argparse.Namespace) -> dict[str, float]:
    """--multiplier NAME=M: recipes whose LR multiplier is given, not swept (one line on a bad one)."""
    given = {}
    for spec in args.multiplier:
        name, sep, value = spec.partition("=")
        if not (sep and name):
            raise UsageError(f"--multiplier {spec!r} is not NAME=M")
        values = numbers(f"--multiplier {name}", value)
        if len(values) != 1:
            raise UsageError(f"--multiplier {name} {value!r}: one number")
        given[name] = values[0]
    return given


def check_fitted(source: str, flags: list[str]) -> None:
    """The race fits each run's length and warmups to its budget: flags may not fix them."""
    for i, f in enumerate(flags):
        name, _, value = f.partition("=")
        value = value or (flags[i + 1] if i + 1 < len(flags) else "")
        if name in FITTED or (name == "--muon-momentum-warmup" and value != "0"):
            raise UsageError(
                f"{source} sets {name}: the race fits it to each budget "
                "(--budgets, --warmup-fraction, --momentum-warmup-fraction)"
            )


def recipes(args: argparse.Namespace) -> dict[str, list[str]]:
    """The named RECIPES, then the --recipe ones; the seed recipe first. A flag value `{lr}` is the
    seed's peak LR (muon-plain's embedding and head LRs)."""
    chosen = {}
    for name in args.recipes.split(","):
        if name not in RECIPES:
            raise UsageError(f"unknown recipe {name!r} (RECIPES: {', '.join(RECIPES)})")
        chosen[name] = RECIPES[name]
    for spec in args.recipe:
        name, sep, flags = spec.partition("=")
        if not (sep and name):
            raise UsageError(f"--recipe {spec!r} is not NAME=FLAGS")
        chosen[name] = shlex.split(flags)
        check_fitted(f"recipe {name!r}", chosen[name])
    if unknown := set(given_multipliers(args)) - set(chosen):
        raise UsageError(f"--multiplier names {', '.join(sorted(unknown))}: not a recipe of this race")
    if args.baseline not in chosen:
        raise UsageError(f"--baseline {args.baseline!r}: not a recipe of this race ({', '.join(chosen)})")
    if next(iter(chosen), None) != "seed":
        raise UsageError("the seed recipe runs first (--recipes seed,...)")
    seed = resolve(common_flags(args, CHECK_STEPS), args.device)
    chosen = {name: [f.replace("{lr}", str(seed.lr)) for f in flags] for name, flags in chosen.items()}
    return {name: flags + relu2_width(flags, args, seed.ffn_dim) for name, flags in chosen.items()}


def relu2_width(flags: list[str], args: argparse.Namespace, swiglu: int | None) -> list[str]:
    """A recipe that makes the MLP relu2 without a width of its own races at the seed's parameters:
    3/2 of the --model's --ffn-dim (SwiGLU's width; fastpt takes --ffn-dim as relu2's own). Without
    one in --model fastpt derives the same from the preset. A bad recipe is left to check_recipes."""
    if swiglu is None or "--ffn-dim" in flags:
        return []
    try:
        relu2 = resolve(common_flags(args, CHECK_STEPS) + flags, args.device).mlp == "relu2"
    except FastptError:
        return []
    return ["--ffn-dim", str(3 * swiglu // 2)] if relu2 else []


def resolve(flags: list[str], device: str):
    """fastpt.train's own parse of these flags: the TrainConfig it would run (no training)."""
    from fastpt import cli, config

    cli_values, config_file = cli.parse_args(flags)
    return config.resolve(cli_values, config_file, device or config.pick_device(cli_values))


def check_recipes(chosen: dict[str, list[str]], args: argparse.Namespace, steps: int = CHECK_STEPS) -> None:
    """Every recipe's flags through fastpt's parser at this run length (before any corpus is prepared,
    a typical one; before a corpus's first run, its smallest budget's); the first bad one is one line."""
    for name, flags in chosen.items():
        try:
            resolve(common_flags(args, steps) + flags, args.device)
        except FastptError as e:
            raise UsageError(f"recipe {name!r} ({' '.join(flags)}): {e}") from None


def schedule(args: argparse.Namespace, steps: int) -> list[str]:
    """A run's length and warmups, fitted to it: the same fractions of its steps at every budget
    (fastpt derives WSD's decay from --max-steps and --decay-fraction, cosine's from both)."""
    warmup, momentum = (round(f * steps) for f in (args.warmup_fraction, args.momentum_warmup_fraction))
    return ["--max-steps", str(steps), "--warmup-steps", str(warmup), "--muon-momentum-warmup", str(momentum)]


def common_flags(args: argparse.Namespace, steps: int) -> list[str]:
    """What every run of this length shares: the model, batch, schedule, eval cadence, --train-args."""
    every = str(max(1, steps // EVALS))
    flags = [*shlex.split(args.model), *schedule(args, steps), "--eval-every", every, "--log-every", every]
    flags += ["--eval-tokens", str(args.eval_tokens), "--ckpt-every", str(10**9)]
    return flags + (["--device", args.device] if args.device else []) + shlex.split(args.train_args)


def own_flags(flags: list[str], base: list[str]) -> list[str]:
    """A recipe's flags beyond a baseline's: those after the baseline's own, and where it names a
    fastpt recipe built on the baseline's (`--recipe modern-unet` on `--recipe modern`), the settings
    that recipe adds, as flags (`--unet-skips`)."""
    if flags[: len(base)] == base:
        return flags[len(base) :]
    if not (flags[:1] == base[:1] == ["--recipe"] and len(flags) > 1 and len(base) == 2):
        return flags
    mine, theirs = FASTPT_RECIPES.get(flags[1]), FASTPT_RECIPES.get(base[1])
    if mine is None or theirs is None or any(k not in mine or mine[k] != v for k, v in theirs.items()):
        return flags
    return [f for k, v in mine.items() if k not in theirs for f in setting_flags(k, v)] + flags[2:]


def setting_flags(key: str, value: object) -> list[str]:
    """fastpt.train's flags for one setting: `--unet-skips` for unet_skips True, `--mlp relu2`."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, f"{value:g}" if isinstance(value, float) else str(value)]


# ---- the LR flags


def lr_flags(flags: list[str], multiplier: float, args: argparse.Namespace, vocab: int) -> tuple[list[str], dict]:
    """The flags that set every peak LR of this recipe to `multiplier` x its own, and those LRs."""
    from fastpt.optim import peak_lrs
    from fastpt.presets import model_config

    cfg = resolve(common_flags(args, CHECK_STEPS) + flags, args.device)
    m = model_config(cfg, vocab)
    lrs = {k: v * multiplier for k, v in peak_lrs(cfg, m.dim, m.tie_embeddings).items()}
    return [x for k, v in lrs.items() for x in (LR_FLAGS[k], f"{v:.6g}")], lrs
