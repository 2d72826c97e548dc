"""What would fit instead: for a run that does not fit its card, the levers searched together, not
one at a time: activation checkpointing (none, selective, full), FSDP over more GPUs of the card,
and the micro-batch (the same global batch in more micro-steps), and a larger card as it is.

Each combination's need is estimated from the plans traced so far (a plan's need is a line in its
micro-batch: what grows with it, its activations and transient, and the rest; FSDP over N divides
the parameters, gradients and optimizer state by N; checkpointing keeps a known share of the
activations), and its GPU-hours from their step times (checkpointing recomputes the forward, or
half of it). The cheapest combination estimated to fit is traced (planner.trace: never a
configuration traced before); if it fits, it is the answer, priced; if not, its trace corrects the
estimate and the next is tried; after the first, no trace is started that would end past twice the
plan's own time.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from fastpt.config import TrainConfig
from fastpt.plan import report
from fastpt.plan.gpus import GIB, GPUS, MIB, speed_of
from fastpt.plan.memory import Peak
from fastpt.plan.planner import Plan, fit_margin, gib, planned_model, trace
from fastpt.plan.progress import progress
from fastpt.plan.timing import COMM_EFF, StepTime

AC_MODES = ("none", "selective", "full")
SHARDED_GPUS = (2, 4, 8)  # FSDP over one host's GPUs
STATE = ("parameters", "gradients", "optimizer state")
BUDGET = 2.0  # the search takes at most this many times the plan's own time
# The room an estimate across checkpointing or GPUs must leave (a share of what it allocates) before
# its option is traced (what each keeps is itself estimated; a trace costs as much as the plan, and the
# budget holds two). Along the micro-batch the line holds within a percent or two: none.
DOUBT = 0.10


@dataclass(frozen=True)
class Option:
    """A combination of the levers: checkpointing, GPUs (FSDP beyond the plan's), micro-batch x accum."""

    ac: str
    world_size: int
    micro_batch: int
    grad_accum: int

    def flags(self, plan: Plan) -> str:
        cfg, said = plan.cfg, []
        if self.ac != cfg.activation_checkpointing:
            said.append(f"--activation-checkpointing {self.ac}")
        if self.world_size != plan.world_size:
            said.append(f"--parallel fsdp over {self.world_size} GPUs")
        if (self.micro_batch, self.grad_accum) != (cfg.micro_batch, cfg.grad_accum):
            said.append(f"--micro-batch {self.micro_batch} --grad-accum {self.grad_accum}")
        return ", ".join(said)


def configured(plan: Plan, option: Option) -> tuple:
    """The config and the ranks of an option."""
    change = dict(activation_checkpointing=option.ac, micro_batch=option.micro_batch, grad_accum=option.grad_accum)
    if option.world_size != plan.world_size:
        change["parallel"] = "fsdp"
    return dataclasses.replace(plan.cfg, **change), option.world_size


def recompute(step: StepTime | None, ac: str) -> float:
    """The GPU time of a step with checkpointing `ac`, relative to one without: the forward again
    (full) or half of it (selective), from a step's own forward and backward."""
    if step is None:
        return {"none": 1.0, "selective": 7 / 6, "full": 4 / 3}[ac]
    f, b = step.parts["forward"], step.parts["backward"]
    return 1 + {"none": 0.0, "selective": 0.5, "full": 1.0}[ac] * f / (f + b)


def kept(ac: str, layers: int) -> float:
    """The share of a step's activations that checkpointing `ac` keeps: all; selective (half the
    blocks) a half; full, one block's recomputed and every block's input (about a tenth of a block's)."""
    return {"none": 1.0, "selective": 0.5, "full": 1 / layers + 0.1}[ac]


def alike(a: Option, b: Option) -> bool:
    """Two options a line through micro-batches joins: the same checkpointing and GPUs, and both
    accumulating or neither (a first micro-step's gradients are there in the second's forward)."""
    return (a.ac, a.world_size, a.grad_accum > 1) == (b.ac, b.world_size, b.grad_accum > 1)


class Estimate:
    """A combination's need and GPU-seconds per token, from the traced plans nearest it."""

    def __init__(self, plan: Plan, layers: int):
        self.layers, self.world_size = layers, plan.world_size
        self.traced: list[tuple[Option, Plan]] = [(Option(*option_of(plan)), plan)]
        self.steps: dict[int, StepTime | None] = {}  # each plan's step time, priced once

    def step(self, plan: Plan) -> StepTime | None:
        if id(plan) not in self.steps:
            self.steps[id(plan)] = plan.step_time()
        return self.steps[id(plan)]

    def probe(self, option: Option) -> tuple[Option, Plan]:
        """The traced plan nearest the option: of its checkpointing and GPUs (at the nearest
        micro-batch), else of its checkpointing, else of its GPUs, else the run's."""
        same = lambda o: (o.ac, o.world_size) == (option.ac, option.world_size)
        for test in (same, lambda o: o.ac == option.ac, lambda o: o.world_size == option.world_size):
            near = [(o, p) for o, p in self.traced if test(o)]
            if near:
                return min(near, key=lambda op: abs(op[0].micro_batch - option.micro_batch))
        return self.traced[0]

    def need(self, option: Option) -> float:
        """Bytes on each card (what the card must hold) at the option: on the line through two plans
        of its checkpointing and GPUs at other micro-batches, else from the nearest plan (scaled)."""
        same = {o.micro_batch: p for o, p in self.traced if alike(o, option)}
        if len(same) >= 2:
            m1, m2 = sorted(same, key=lambda m: abs(m - option.micro_batch))[:2]
            b1, b2 = same[m1].card_bytes, same[m2].card_bytes
            return b1 + (b2 - b1) * (option.micro_batch - m1) / (m2 - m1)
        o, p = self.probe(option)
        ratio = option.micro_batch / o.micro_batch
        # the caching allocator's reserve beyond the peak grows with the micro-batch (its blocks are as
        # large as the requests); the CUDA context does not
        spare = max(0, p.peak.reserved - p.peak.bytes) if p.peak.reserved else 0
        context = p.card_bytes - (p.peak.reserved or p.peak.bytes)
        moments = list(p.moments.values()) or [p.peak]  # where the step peaks may move (the optimizer's)
        return max(self.allocated(peak, (o, p), option) for peak in moments) + spare * ratio + context

    def doubt(self, option: Option) -> float:
        """How far the estimate may fall short, as a share of what it allocates: DOUBT from a plan of
        other checkpointing or GPUs, none along the micro-batch."""
        o, _ = self.probe(option)
        return 0.0 if (o.ac, o.world_size) == (option.ac, option.world_size) else DOUBT

    def cautious_need(self, option: Option) -> float:
        """The need with its doubt added (the CUDA context, a constant, is not in doubt)."""
        run = self.traced[0][1]
        context = run.card_bytes - (run.peak.reserved or run.peak.bytes)
        need = self.need(option)
        return need + self.doubt(option) * (need - context)

    def allocated(self, peak: Peak, probe: tuple[Option, Plan], option: Option) -> float:
        """One moment's allocation, traced at o, at the option: its activations by what checkpointing
        keeps and, with the transient, by the micro-batch (but autocast's low-precision copies of the
        weights, which FSDP's bf16 parameters make needless); its state sharded over the option's GPUs."""
        (o, p), parts = probe, peak.parts
        copies = p.params * 2 if p.cfg.dtype in ("bf16", "fp16") else 0
        acts = parts.get("activations", 0)
        traced_copies = 0 if self.sharded(p.cfg, o) else min(acts, copies)
        per_sequence = (acts - traced_copies) / o.micro_batch
        acts_then = (0 if self.sharded(p.cfg, option) else min(acts, copies)) + per_sequence * option.micro_batch
        growing = parts.get("transient", 0) * option.micro_batch / o.micro_batch
        growing += acts_then * kept(option.ac, self.layers) / kept(o.ac, self.layers)
        state = sum(parts.get(k, 0) for k in STATE)
        if o.grad_accum == 1 and option.grad_accum > 1 and not parts.get("gradients"):
            state += parts.get("parameters", 0)  # the gradients, as large as the (fp32) parameters
        fixed = peak.bytes - acts - parts.get("transient", 0) - state
        sharded = state * o.world_size / option.world_size if option.world_size > 1 else state
        if option.world_size > o.world_size and o.world_size == 1 and option.grad_accum > 1:
            sharded += parts.get("parameters", 0)  # FSDP keeps the unsharded fp32 gradients across micro-steps
        return fixed + sharded + growing

    def sharded(self, cfg: TrainConfig, option: Option) -> bool:
        """Whether the option runs FSDP: over more GPUs than the run's, or the run's own FSDP."""
        return option.world_size > 1 and (option.world_size != self.world_size or cfg.parallel == "fsdp")

    def gpu_seconds_per_token(self, option: Option) -> float:
        """The nearest plan's GPU-seconds per token, with the option's recompute and, for FSDP over
        more GPUs than that plan's, its collectives unhidden (a slow link's cost shows)."""
        o, p = self.probe(option)
        step, speed = self.step(p), p.card and speed_of(p.card)
        if step is None:
            return recompute(step, option.ac)
        per_token = step.seconds * p.world_size / step.tokens * recompute(step, option.ac) / recompute(step, o.ac)
        if option.world_size > o.world_size:
            n, params = option.world_size, p.params
            moved = (2 * 2 * params * option.grad_accum + 4 * params) * (n - 1) / n  # bf16 gathers, fp32 reduce
            tokens = option.micro_batch * p.seq_len * option.grad_accum * n
            per_token += moved / (speed.link_gbs * 1e9 * COMM_EFF) * n / tokens
        return per_token


def options(plan: Plan) -> list[Option]:
    """Every combination: stronger checkpointing, more GPUs (FSDP) on CUDA, each with the global batch
    of the plan in micro-steps that hold it exactly (over N GPUs, each rank's share rounded up)."""
    cfg = plan.cfg
    acs = AC_MODES[AC_MODES.index(cfg.activation_checkpointing) :]
    gpus = [plan.world_size] + [n for n in SHARDED_GPUS if plan.target == "cuda" and n > plan.world_size]
    global_batch = cfg.micro_batch * cfg.grad_accum * plan.world_size
    out = []
    for n in gpus:
        per_rank = -(-global_batch // n)
        micro = [m for m in range(per_rank, 0, -1) if per_rank % m == 0]  # the batch kept exactly
        out += [Option(ac, n, m, per_rank // m) for ac in acs for m in micro]
    return out


@dataclass
class Found:
    """The search's answer: the option that fits (its plan), or None; what it planned and estimated."""

    option: Option | None
    plan: Plan | None
    planned: int
    estimated: int
    seconds: float


def search(plan: Plan) -> Found:
    """The cheapest option (GPU-seconds per token, then fewer GPUs, then larger micro-batches) whose
    plan fits with fit_margin free: the options estimated to fit traced in the order the estimates
    rank them, each trace correcting them, until none estimated to fit ranks above the cheapest that
    fits, or a trace would end past the budget (module docstring)."""
    margin = fit_margin(plan.cfg.compile)
    limit = plan.card.usable * (1 - margin)
    estimate = Estimate(plan, plan.depths[-1] if plan.depths else planned_model(plan.cfg).n_layers)
    every = [o for o in options(plan) if o != Option(*option_of(plan))]
    rank = lambda o: (estimate.gpu_seconds_per_token(o), o.world_size, -o.micro_batch)
    start, budget, tried, best = time.process_time(), BUDGET * plan.seconds, set(), None
    while True:
        fitting = [o for o in every if o not in tried and estimate.cautious_need(o) <= limit]
        better = [o for o in fitting if best is None or rank(o) < rank(best[0])]
        if not better:
            break
        option = min(better, key=rank)
        # a trace costs about the plan's (FSDP's twice): after the first, none is started that would end
        # past the budget
        if tried and time.process_time() - start + plan.seconds * (1 + (option.world_size > 1)) > budget:
            break
        progress.task(f"what would fit: {option.flags(plan)}")
        cfg, world_size = configured(plan, option)
        other = trace(cfg, plan.target, world_size)
        other.card = plan.card
        estimate.traced.append((option, other))
        tried.add(option)
        if other.fits(margin):
            best = option, other
    planned, seconds = len(estimate.traced) - 1, time.process_time() - start
    return Found(*(best or (None, None)), planned, len(every), seconds)


def option_of(plan: Plan) -> tuple:
    return plan.cfg.activation_checkpointing, plan.world_size, plan.cfg.micro_batch, plan.cfg.grad_accum


def next_steps(plan: Plan) -> list[str]:
    """For a plan that does not fit its card: the cheapest combination of the levers that does
    (search), priced, and on CUDA the smallest named card that holds the plan as it is. [] when
    the plan fits."""
    if plan.fits() is not False:
        return []
    margin, found = fit_margin(plan.cfg.compile), search(plan)
    planned = f"{found.planned} of {found.estimated} combinations planned"
    tried = f"{planned}, the rest estimated, in {found.seconds:.1f} CPU s"
    if found.option is None:
        lines = [f"  next: no combination of checkpointing, GPUs and micro-batch fits {plan.card} ({tried})"]
    else:
        other, n = found.plan, found.option.world_size
        step = other.step_time()
        cost = f"; {step.seconds * 1e3:,.1f} ms a step" if step else ""
        lines = [
            f"  next: {found.option.flags(plan)} fits ({gib(other.card_bytes)} planned{' per GPU' if n > 1 else ''}"
            f"{cost}; the cheapest in GPU-hours of {tried})",
            *[f"  {line.strip()}" for line in priced(other)],
        ]
    if plan.target == "cuda":
        need = plan.card_bytes / (1 - margin)
        bigger = sorted((mib, name) for name, mib in GPUS.values() if mib * MIB >= need and mib * MIB > plan.card.total)
        which = f"the {bigger[0][1]}, {bigger[0][0] * MIB / GIB:.1f} GiB" if bigger else "none that fastpt knows"
        lines.append(f"  or a card with {gib(need)} (the plan and {margin:.0%} free): {which}")
    return lines


def priced(plan: Plan) -> list[str]:
    """The fitting option's run: its wall time, GPU-hours and cost (report.run_line)."""
    step, speed = plan.step_time(), plan.card and speed_of(plan.card)
    return [report.run_line(step, speed, plan.cfg)] if step and speed else []
