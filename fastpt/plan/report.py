"""The planned step time as --plan prints it and --plan-json writes it: its parts and the clock that
bound it, tok/s, MFU (and HFU beside it), the run's wall time, GPU-hours and cost, the link assumed,
the plan's own error band, the most expensive kernels. A printed figure never rounds a nonzero value
to zero (figure); the JSON keeps full precision."""

from __future__ import annotations

from fastpt.config import TrainConfig
from fastpt.plan import published
from fastpt.plan.gpus import GPUS, SPEEDS, Speed
from fastpt.plan.timing import StepTime
from fastpt.step import micro_batches

# planned / reported step time over the held-out published configurations fastpt can express
# (plan.published, which a slow test re-plans): median and worst error, how many, on which cards.
ERROR_BAND = published.ERROR_BAND


def figure(x: float, decimals: int = 1) -> str:
    """x with `decimals` places, or two significant digits where those places would show a nonzero x as 0."""
    text = f"{x:,.{decimals}f}"
    if x != 0 and float(text.replace(",", "")) == 0:
        return f"{x:.2g}"
    return text


def count(x: float) -> str:
    """A rate such as tok/s: 1,008k from 10,000 up, else whole (336), never 0 for a nonzero one."""
    return f"{x / 1e3:,.0f}k" if x >= 1e4 else figure(x, 0)


def tokens(n: float) -> str:
    """65,536; 655.4M; 5.24B: a token count at a glance."""
    for scale, suffix, decimals in ((1e12, "T", 2), (1e9, "B", 2), (1e6, "M", 1)):
        if n >= scale:
            return f"{n / scale:,.{decimals}f}{suffix}"
    return f"{n:,.0f}"


def duration(seconds: float) -> str:
    """41.3s, 14m44s, 3h05m, 2d03h."""
    if seconds < 59.5:
        return f"{figure(seconds)}s"
    s = round(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {prefix}{unit}"
    return f"{figure(x, 0)} {unit}"


def run_tokens(cfg: TrainConfig, seq_len: int, world_size: int) -> int:
    """Tokens the whole run trains: max_steps steps of every rank's micro-batches (a batch warm-up's
    ramp trains fewer)."""
    return micro_batches(cfg, cfg.max_steps) * cfg.micro_batch * seq_len * world_size


def tokens_text(cfg: TrainConfig, seq_len: int, world_size: int) -> str:
    """'10,000 steps x 65,536 tokens = 655.4M tokens'."""
    total = tokens(run_tokens(cfg, seq_len, world_size))
    if cfg.batch_warmup_steps:
        return (  # as the run's summary says it (metrics.summary)
            f"{cfg.max_steps:,} steps = {total} tokens (a batch warm-up from {cfg.batch_warmup_start} to "
            f"{cfg.micro_batch * cfg.grad_accum} sequences per rank over the first {cfg.batch_warmup_steps:,})"
        )
    per_step = cfg.micro_batch * seq_len * cfg.grad_accum * world_size
    return f"{cfg.max_steps:,} steps x {per_step:,} tokens = {total} tokens"


def run_seconds(step: StepTime, cfg: TrainConfig) -> float:
    """max_steps planned steps, less the forward and backward of the micro-batches a batch warm-up
    leaves out of its first steps (their optimizer step and gradient sync cost the same)."""
    left_out = cfg.max_steps * cfg.grad_accum - micro_batches(cfg, cfg.max_steps)
    per_micro = (step.parts["forward"] + step.parts["backward"]) / cfg.grad_accum
    return step.seconds * cfg.max_steps - per_micro * left_out


def gpu_hours(step: StepTime, cfg: TrainConfig) -> float:
    return run_seconds(step, cfg) * step.world_size / 3600


def run_line(step: StepTime, speed: Speed, cfg: TrainConfig) -> str:
    """The run's wall time, GPU-hours and cost, the link assumed, and how far to trust them."""
    hours, price = gpu_hours(step, cfg), cfg.plan_price
    cost = f" = ${figure(hours * price, 2)} at ${figure(price, 2)} per GPU-hour" if price else ""
    link = f"; link assumed: {speed.link}, {speed.link_gbs:g} GB/s per direction" if step.world_size > 1 else ""
    ramp = (
        f" (the first {cfg.batch_warmup_steps:,} ramping {cfg.batch_warmup_start} -> "
        f"{cfg.micro_batch * cfg.grad_accum} sequences per rank: "
        f"{figure(run_seconds(step, cfg) / cfg.max_steps * 1e3)} ms a step on average)"
        if cfg.batch_warmup_steps
        else ""
    )
    return (
        f"  {cfg.max_steps:,} steps{ramp} = {duration(run_seconds(step, cfg))} on {step.world_size} GPU"
        f"{'s' if step.world_size > 1 else ''} = {figure(hours, 2)} GPU-hours{cost}{link}; {error_band(speed)}"
    )


def measured_on(speed: Speed) -> bool:
    """Whether a published run of the error band (plan.published) ran on this card."""
    return any(speed is SPEEDS[key] for key in ERROR_BAND.cards)


def error_band(speed: Speed) -> str:
    """The plan's error against the published runs, and whether any of them ran on this card."""
    band = ERROR_BAND
    cards = ", ".join(GPUS[key][0] for key in band.cards)
    line = (
        f"the plan's error against {band.configurations} independent published runs on {cards}, none of them "
        f"used to set its constants: median {band.median:.0%}, worst {band.worst:.0%} (docs/performance.md)"
    )
    if not measured_on(speed):
        name = next(GPUS[key][0] for key, s in SPEEDS.items() if s is speed)
        line += f"; none of them on the {name}: less certain there"
    return line


def describe(step: StepTime, card_name: str, speed: Speed, cfg: TrainConfig, fits: bool = True) -> list[str]:
    """The step's lines of --plan (module docstring), its 8 most expensive kernels last; a run that
    does not fit its card is not priced."""
    p = {k: figure(v * 1e3) for k, v in step.parts.items()}
    per_gpu = f" ({count(step.tok_s_per_gpu)} per GPU)" if step.world_size > 1 else ""
    lines = [
        f"step on {card_name}: {figure(step.seconds * 1e3)} ms (forward {p['forward']}, backward {p['backward']}, "
        f"optimizer {p['optimizer']}, communication {p['communication']} exposed, overhead {p['overhead']}; "
        f"{step.bound}-bound) -> {count(step.tok_s)} tok/s{per_gpu}, MFU {figure(step.mfu, 2)} "
        f"(HFU {figure(step.hfu, 2)})",
        run_line(step, speed, cfg) if fits else f"  not priced: the run does not fit {card_name}; {error_band(speed)}",
        f"  {step.launches:,} launches ({'compiled' if cfg.compile else 'eager'}), "
        f"CPU side {figure(step.cpu_seconds * 1e3)} ms; the 8 most expensive kernels:",
    ]
    for k in step.kernels[:8]:
        lines.append(
            f"  {figure(k.seconds * 1e6, 0):>9} µs  {k.count:>4} x  {k.label} ({k.phase}): {si(k.flops, 'FLOP')}, "
            f"{si(k.bytes, 'B')}, {k.bound}"
        )
    return lines


def to_json(step: StepTime, cfg: TrainConfig, speed: Speed, fits: bool = True) -> dict:
    """The keys --plan-json adds, unrounded; the run's time and cost null where it does not fit."""
    run = {
        "run_s": run_seconds(step, cfg),
        "gpu_hours": gpu_hours(step, cfg),
        **({"cost_usd": gpu_hours(step, cfg) * cfg.plan_price} if cfg.plan_price else {}),
    }
    return {
        "step_ms": step.seconds * 1e3,
        "tok_s": step.tok_s,
        "tok_s_per_gpu": step.tok_s_per_gpu,
        "mfu": step.mfu,
        "hfu": step.hfu,
        "bound": step.bound,
        "cpu_ms": step.cpu_seconds * 1e3,
        "time_parts": {k: v * 1e3 for k, v in step.parts.items()},
        "launches": step.launches,
        **(run if fits else dict.fromkeys(run)),
        "error_band": {
            "median": ERROR_BAND.median,
            "worst": ERROR_BAND.worst,
            "runs": ERROR_BAND.configurations,
            "cards": [GPUS[key][0] for key in ERROR_BAND.cards],
            "measured_on_this_card": measured_on(speed),
        },
        "kernels": [
            {
                "name": k.label,
                "phase": k.phase,
                "count": k.count,
                "flops": k.flops,
                "bytes": k.bytes,
                "bound": k.bound,
                "us": k.seconds * 1e6,
            }
            for k in step.kernels[:8]
        ],
    }
