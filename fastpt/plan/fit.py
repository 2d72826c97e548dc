"""Fit a run to a card: --micro-batch auto's choice (the largest micro-batch whose plan fits with a
derived margin free, grad_accum the rest) and the --plan command, over planner's traced plans.
`python -m fastpt.train --plan [the run's flags]`; `--micro-batch auto` before a run starts."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from fastpt.config import AUTO, TrainConfig, configured_micro_batch, load_toml
from fastpt.errors import ConfigError
from fastpt.files import check_output, os_reason, write_output
from fastpt.kernels import scratch
from fastpt.plan.gpus import Card, card, machine_card
from fastpt.plan.planner import (
    Plan,
    describe,
    fit_margin,
    gib,
    planned_config,
    planned_model,
    to_json,
    trace,
    unmodelled,
    verdict,
)
from fastpt.plan.progress import progress
from fastpt.plan.search import next_steps

# --micro-batch auto leaves a fraction of the card free: the plan's error band and the CUDA
# context's spread (planner.fit_margin), 5% eager, 12% compiled.
FIT_MARGIN = fit_margin(compiled=False)


# ---- --micro-batch auto


def config_sequences(cfg: TrainConfig) -> int:
    """Sequences per optimizer step and rank that the config asks for: its micro-batch (the preset's,
    or the CPU profile's, when it says auto) x grad_accum."""
    return configured_micro_batch(cfg) * cfg.grad_accum


def fit_micro_batch(cfg: TrainConfig, target: str, world_size: int, gpu: Card | None) -> tuple[Plan, str]:
    """The largest micro-batch whose plan fits the card with fit_margin free that divides the
    config's sequences per step (grad_accum then keeps them exactly), or when every such divisor is
    under half the largest that fits, that one with the nearest above; the plan at it, and what it
    chose. Under a batch warm-up none larger than its first step's sequences (it trains whole
    micro-batches). The card's need is about linear in the micro-batch: a plan at 4 places the first
    guess (guess_accum), then the number of micro-steps moves by one until the fit is tight."""
    if gpu is None:
        raise ConfigError("'micro_batch' = 'auto' needs a card to fit and this machine has no GPU: give --plan-gpu")
    sequences = config_sequences(cfg)
    most = cfg.batch_warmup_start if cfg.batch_warmup_steps else sequences
    plans: dict[int, Plan] = {}

    def plan_at(micro: int) -> Plan:  # the plan at `micro`, with the fewest micro-steps that hold the sequences
        if micro not in plans:
            accum = -(-sequences // micro)
            plans[micro] = trace(dataclasses.replace(cfg, micro_batch=micro, grad_accum=accum), target, world_size)
            plans[micro].card = gpu
        return plans[micro]

    margin = fit_margin(cfg.compile)
    fits = lambda micro: plan_at(micro).fits(margin)
    # One micro-batch per number of micro-steps: the fewest sequences each that hold the step's.
    candidates = sorted(m for m in {-(-sequences // accum) for accum in range(1, sequences + 1)} if m <= most)
    accum = guess_accum(plan_at(min(sequences, 4)), sequences, gpu.usable * (1 - margin))
    i = candidates.index(-(-sequences // max(accum, -(-sequences // most))))
    if i > 0 or fits(1):  # a guess of 1 is checked before a larger micro-batch is planned
        while i + 1 < len(candidates) and fits(candidates[i + 1]):
            i += 1
        while i > 0 and not fits(candidates[i]):
            i -= 1
    if not fits(candidates[i]):  # i == 0: micro-batch 1
        one = plan_at(1)
        raise ConfigError(
            f"'micro_batch' = 'auto': even micro-batch 1 does not fit {gpu} ({gib(one.card_bytes)} planned, "
            f"peak {gib(one.peak.bytes)}): use --activation-checkpointing full, or --parallel fsdp over more GPUs"
        )
    largest = candidates[i]
    micro = exact_micro_batch(largest, sequences)
    best = plan_at(micro) if fits(micro) else plan_at(largest)
    capped = most < sequences and largest == candidates[-1]  # the warm-up's first step, not the card, set it
    return best, chosen_line(best, sequences, largest, world_size, most if capped else 0)


def reshards(cfg: TrainConfig, world_size: int) -> bool | None:
    """Whether FSDP reduce-scatters at every micro-step (None when the choice does not apply: no
    FSDP, one rank, or one micro-step)."""
    return cfg.fsdp_reshard_grads if cfg.parallel == "fsdp" and world_size > 1 and cfg.grad_accum > 1 else None


def fit_micro_batch_fsdp(cfg: TrainConfig, target: str, world_size: int, gpu: Card | None) -> tuple[Plan, str]:
    """fit_micro_batch; under FSDP with accumulation, when keeping the unsharded gradients across
    micro-steps leaves not even micro-batch 1 fitting, reduce-scattering at every one instead."""
    try:
        return fit_micro_batch(cfg, target, world_size, gpu)
    except ConfigError:
        accumulates = config_sequences(cfg) > 1  # micro-batch 1 takes that many micro-steps
        if not (cfg.parallel == "fsdp" and world_size > 1 and accumulates and not cfg.fsdp_reshard_grads):
            raise
    plan, why = fit_micro_batch(dataclasses.replace(cfg, fsdp_reshard_grads=True), target, world_size, gpu)
    return (
        plan,
        why + "; with --fsdp-reshard-grads (reduce-scatter every micro-step): the unsharded gradients do not fit",
    )


def other_gradient_sync(plan: Plan) -> list[str]:
    """Under FSDP with accumulation, the peak with the other gradient sync: a line (else none)."""
    now = reshards(plan.cfg, plan.world_size)
    if now is None:
        return []
    progress.task("the other gradient sync (--fsdp-reshard-grads)" if not now else "the other gradient sync")
    other = trace(dataclasses.replace(plan.cfg, fsdp_reshard_grads=not now), plan.target, plan.world_size)
    how = "reduce-scattering at every micro-step (--fsdp-reshard-grads)" if not now else "only at the last micro-step"
    return [f"{how}: peak {gib(other.peak.bytes)}, the card needs {gib(other.card_bytes)}"]


def fallback_extra(cfg: TrainConfig) -> int:
    """At most what the PyTorch fallback needs beyond fastpt's kernels: every norm keeping an fp32 copy
    of its input and of its product for the backward (the kernel keeps its statistics), and the loss's
    chunks (a product, its fp32 copy, tanh's, the gradient) with fp32 gradients of its input and
    weight. A bound: a plan with that much to spare fits on the fallback without a trace of its own."""
    mcfg = planned_model(cfg)
    rows = cfg.micro_batch * (cfg.seq_len or mcfg.max_seq_len)
    qk = (mcfg.dim + mcfg.kv_heads * mcfg.head_dim) if (mcfg.qk_norm or mcfg.qk_norm_scale) else 0
    normed = mcfg.n_layers * (2 * mcfg.dim + qk) + mcfg.dim * (2 if mcfg.embed_norm else 1)
    return 2 * 4 * rows * normed + 4 * scratch.CHUNK_BYTES + 4 * (mcfg.vocab_size + rows) * mcfg.dim


def fallback(plan: Plan) -> list[str]:
    """A run that fits on fastpt's kernels by --kernels auto: whether the PyTorch fallback that a kernel
    failing its self-check switches the run to (fastpt.selfcheck) fits too, a line. Traced only when
    the plan's room is within fallback_extra's bound."""
    if not (plan.target == "cuda" and plan.cfg.kernels == "auto" and plan.fits()):
        return []
    extra = fallback_extra(plan.cfg)
    if plan.card_bytes + extra <= plan.card.usable:
        return [f"if a kernel fails its self-check, the PyTorch fallback fits too (it needs at most {gib(extra)} more)"]
    progress.task("the PyTorch fallback, if a kernel fails its self-check")
    other = trace(dataclasses.replace(plan.cfg, kernels="torch"), plan.target, plan.world_size)
    other.card = plan.card
    return [f"if a kernel fails its self-check, the PyTorch fallback needs {gib(other.card_bytes)}: {verdict(other)}"]


def exact_micro_batch(largest: int, sequences: int) -> int:
    """The largest divisor of `sequences` up to `largest` (the step keeps its sequences exactly);
    `largest` itself when that divisor is under half of it (more than twice the micro-steps)."""
    divisor = max(d for d in range(1, largest + 1) if sequences % d == 0)
    return divisor if 2 * divisor >= largest else largest


def chosen_line(best: Plan, sequences: int, largest: int, world_size: int, ramp_start: int = 0) -> str:
    """What --micro-batch auto chose and what set it: the card, the sequences per step, or (ramp_start)
    the batch warm-up's first step."""
    micro, accum, gpu = best.cfg.micro_batch, best.cfg.grad_accum, best.card
    per_rank = f" per rank (global batch {micro * accum * world_size} sequences)" if world_size > 1 else ""
    line = f"micro-batch auto: {micro} x {accum} accum = {micro * accum} sequences/step{per_rank}"
    if micro * accum != sequences:
        line += f", the nearest above the config's {sequences} (no divisor of it near {largest} fits)"
    if ramp_start:
        return line + (
            f"; the batch warm-up's first step ({ramp_start} sequences, --batch-warmup-start) set the limit: "
            f"a step trains whole micro-batches ({gpu}: {gib(best.card_bytes)} planned)"
        )
    if micro == sequences:
        spare = gpu.usable - best.card_bytes
        return line + f"; the sequences per step set the limit, not {gpu} ({gib(spare)} to spare)"
    which = f"the largest divisor of {sequences} that fits" if micro != largest else "the largest that fits"
    line += f"; {which} {gpu} with {fit_margin(best.cfg.compile):.0%} free ({gib(best.card_bytes)} planned)"
    return line + (f"; {largest} fits too, with more sequences per step" if micro != largest else "")


def guess_accum(probe: Plan, sequences: int, limit: float) -> int:
    """The fewest micro-steps whose micro-batch one plan's line puts under the limit: its activations
    and transient grow with the micro-batch, the rest of what the card needs (parameters, gradients,
    optimizer state, context) does not. Part of what it counts as growing is fixed (autocast's copies
    of the weights), so the guess errs low, the cheaper side: a guess one candidate low takes as few
    plans as the right one (it fits, the next does not), one too high takes one more."""
    growing = probe.peak.parts["activations"] + probe.peak.parts["transient"]
    per_sequence = max(1.0, growing / probe.cfg.micro_batch)
    most = max(1, min(sequences, int((limit - (probe.card_bytes - growing)) / per_sequence)))
    return -(-sequences // most)


# ---- the command


def requested(cli: dict, config_file: str | None) -> bool:
    """--plan on the command line, or plan = true in the TOML file."""
    if "plan" in cli:
        return bool(cli["plan"])
    return bool(config_file and load_toml(config_file).get("plan"))


def main(cli: dict, config_file: str | None) -> int:
    """python -m fastpt.train --plan ...: print the plan (and --plan-json it); trains nothing."""
    cfg, target = planned_config(cli, config_file)
    if cfg.plan_json and not Path(cfg.plan_json).parent.is_dir():  # said now, not after planning
        raise ConfigError(
            f"'plan_json' = {cfg.plan_json!r}: no folder {str(Path(cfg.plan_json).parent)!r} to write it in"
        )
    if cfg.plan_json:
        check_output(cfg.plan_json, "--plan-json")
    gpu = card(cfg.plan_gpu) if target == "cuda" else machine_card()
    why = ""
    with progress.running():
        if cfg.micro_batch == AUTO:
            progress.task("micro-batch auto")
            plan, why = fit_micro_batch_fsdp(cfg, target, cfg.plan_world_size, gpu)
        else:
            plan = trace(cfg, target, cfg.plan_world_size)
            plan.card = gpu
        lines = describe(plan, next_steps(plan)) + ([why] if why else []) + other_gradient_sync(plan) + fallback(plan)
    print("\n".join(lines), flush=True)
    if warning := unmodelled(plan):
        print(warning, file=sys.stderr, flush=True)
    if cfg.plan_json:
        text = json.dumps(to_json(plan) | ({"chosen": why} if why else {}), indent=2) + "\n"
        try:
            write_output(cfg.plan_json, lambda f: f.write(text.encode()), "--plan-json")
        except BrokenPipeError:  # `--plan-json /dev/stdout | head`: the reader has what it wanted (run_command)
            raise
        except OSError as e:
            raise ConfigError(f"'plan_json' = {cfg.plan_json!r}: cannot write it ({os_reason(e)})") from None
    return 0


def auto_micro_batch(cfg: TrainConfig, kernels: str | None = None) -> tuple[TrainConfig, str]:
    """A run's --micro-batch auto, before it starts: the config with the chosen micro-batch and
    grad_accum, and the line that says why (unchanged and '' without auto). `kernels`, the backend
    in effect (the reference's after a kernel failed its check: its loss materializes the logits),
    is what the plan traces; the config keeps the --kernels asked for."""
    if cfg.micro_batch != AUTO:
        return cfg, ""
    gpu = card(cfg.plan_gpu) if cfg.device == "cuda" else machine_card()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    planned = dataclasses.replace(cfg, kernels=kernels or cfg.kernels)
    with progress.running():
        progress.task("micro-batch auto")
        plan, why = fit_micro_batch_fsdp(planned, cfg.device, world_size, gpu)
    if warning := unmodelled(plan):
        print(warning, file=sys.stderr, flush=True)
    chosen = dict(micro_batch=plan.cfg.micro_batch, grad_accum=plan.cfg.grad_accum)
    return dataclasses.replace(cfg, **chosen, fsdp_reshard_grads=plan.cfg.fsdp_reshard_grads), why
