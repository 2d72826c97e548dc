"""Know before you rent: a run's GPU memory planned on any machine, by running its real step over
fake tensors. The command (`python -m fastpt.train --plan`) and `--micro-batch auto` are plan.fit.

The config resolves as the run's would, then step.build_model builds the model, its compile and
DDP / FSDP wrapping, its optimizers and precision under FakeTensorMode, and step.train_step runs
two optimizer steps of it (all micro-steps, clipping and the optimizer included) inside a
memory.MemoryTrace. Shapes and dtypes are real, no byte is allocated, no data is read. Under FSDP
a fake process group lets this one process play rank 0 of N.

A fake CUDA device does not run on a CPU build of torch, so a plan for CUDA runs over fake CPU
tensors with a GPU run's choices and corrects for what differs, explicitly:
- the kernels: --kernels auto means Triton there (their registered fakes answer for them), and the
  scratch that a kernel allocates inside (gpus.scratch_table) is added while its op runs;
- attention: the CPU's flash kernel saves what CUDA's does (q, k, v, out, an fp32 logsumexp); the
  CUDA flash backward's accumulators are added as its scratch;
- sizes: the CUDA caching allocator's rounding and blocks (memory.replay), the cuBLAS workspaces;
- autocast: CPU and CUDA cast the ops of fastpt's forward alike (matmuls and attention to the
  autocast dtype on both; the norms and the loss upcast their inputs themselves), so nothing to do.
Compiled runs: plan.compiled (Inductor's partitioner, its lowering's memory rules). A deep model is
planned from two traces of it with fewer blocks, extrapolated to its depth (plan.depth).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from fastpt import distributed, muon
from fastpt.checkpoint import resumed_model
from fastpt.config import TrainConfig, check_runtime, resolve, uses_cuda_graphs
from fastpt.data.dataset import common_vocab, data_sources, default_vocab, doc_token
from fastpt.data.loader import Batch
from fastpt.hf import from_hf_config, is_hf_dir, not_hf_dir, read_json
from fastpt.kernels import api as kernels
from fastpt.plan import depth, report, timing, torch_internals
from fastpt.plan.compiled import compiling_for_plan, recompile_for_plan
from fastpt.plan.gpus import CUDA_CONTEXT, GIB, Card, cublas_workspaces, scratch_table, speed_of
from fastpt.plan.memory import Life, MemoryTrace, Peak, cuda_rounded, moment_peaks, peak_of
from fastpt.plan.progress import progress
from fastpt.plan.torch_internals import fsdp_params
from fastpt.presets import ModelConfig, model_config
from fastpt.step import build_model, train_step

# The plan's error band on the card's memory, which --micro-batch auto leaves free (fit_margin) and
# within which a plan that fits is at risk: the most a checked config was planned below its measured
# peak (PLAN_ERROR: eager 3% over the 1.4% measured, compiled 10% over 9-10%, on an H200,
# tests/planned_peaks.json's "measured"), plus what the CUDA context may take beyond its estimate
# (CONTEXT_SPREAD: 0.6 GiB at most against 0.5 GiB) on the smallest card fastpt plans for
# (SMALLEST_CARD), rounded up to a whole percent: 5% eager, 12% compiled.
PLAN_ERROR = {"eager": 0.03, "compiled": 0.10}
CONTEXT_SPREAD = 0.1 * GIB
SMALLEST_CARD = 8 * GIB


def fit_margin(compiled: bool) -> float:
    """The fraction of the card --micro-batch auto leaves free and a plan that fits may still need (above)."""
    return math.ceil(100 * (PLAN_ERROR["compiled" if compiled else "eager"] + CONTEXT_SPREAD / SMALLEST_CARD)) / 100


# ---- the run, built over fake tensors


class FakeLoader:
    """What train_step reads from a TrainLoader: a fresh (B, T) pair of int64 batches per micro-step."""

    def __init__(self, micro_batch: int, seq_len: int, vocab_size: int):
        self.shape, self.vocab_size = (micro_batch, seq_len), vocab_size
        self.device = torch.device("cpu")

    def next(self) -> Batch:
        return Batch(*(torch.randint(0, self.vocab_size, self.shape) for _ in range(2)))


def planned_config(cli: dict, config_file: str | None) -> tuple[TrainConfig, str]:
    """The run's config, resolved as the run would (for CUDA unless --device cpu), and the target."""
    target = cli.get("device") or "cuda"
    cfg = resolve(cli, config_file, target)
    if target == "cpu":
        check_runtime(cfg)  # a CPU run runs here: what this machine refuses, the plan refuses
    return cfg, target


def planned_model(cfg: TrainConfig) -> ModelConfig:
    """The model the run would build, from the preset, the shape keys and --init-from's config.json;
    the vocab from --data's meta (no shard is read), else the one the default corpus would have."""
    base = resumed_model(cfg.out, cfg.resume) if cfg.init_from else None  # the init folder may be gone
    if cfg.init_from and base is None:
        if not is_hf_dir(cfg.init_from):
            raise not_hf_dir(cfg.init_from)
        path = Path(cfg.init_from) / "config.json"
        base = from_hf_config(read_json(path), str(path))
    sources = data_sources(cfg.data)
    vocab = common_vocab(sources, cfg.data_format) if sources else 0 if base else default_vocab(cfg)
    document = cfg.attention == "document"
    doc = (doc_token(sources[0].folder, "'attention' = 'document'") if sources else 0) if document else None
    return model_config(cfg, vocab, base, doc)


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[distributed.Dist]:
    """Rank 0 of world_size over a fake process group (collectives return at once), or one process."""
    if world_size == 1:
        yield distributed.ONE_PROCESS
        return
    dist.init_process_group("fake", store=torch_internals.fake_store(), rank=0, world_size=world_size)
    try:
        yield distributed.Dist(0, 0, world_size)
    finally:
        dist.destroy_process_group()


def step_config(cfg: TrainConfig) -> TrainConfig:
    """The config a planned step runs: at most two micro-steps, since a third and later ones repeat
    the second's memory (the gradients exist, the last one syncs)."""
    return dataclasses.replace(cfg, grad_accum=min(cfg.grad_accum, 2))


def as_planned(cfg: TrainConfig, target: str) -> TrainConfig:
    """The config the planner builds: a GPU run's kernels choice ('auto' is Triton there)."""
    return dataclasses.replace(cfg, kernels="triton" if target == "cuda" and cfg.kernels == "auto" else cfg.kernels)


@dataclass
class Plan:
    """A planned run: its peak per GPU (or the CPU run's allocator peak), against a card."""

    cfg: TrainConfig
    target: str  # cuda | cpu
    world_size: int
    seq_len: int
    params: int
    peak: Peak
    card: Card | None = None
    seconds: float = 0.0
    trace: MemoryTrace | None = field(default=None, repr=False)  # every storage's life, for a closer look
    kernels: timing.KernelLog | None = field(default=None, repr=False)  # every launch, for the step time
    # a deep model's plan (extrapolated): the kernels of its two shallower traces, and how far past the first
    extrapolation: tuple[timing.KernelLog, timing.KernelLog, float] | None = field(default=None, repr=False)
    depths: tuple[int, ...] = ()  # extrapolated: the blocks of the two traces, and the model's
    moments: dict[str, Peak] = field(default_factory=dict, repr=False)  # a trace's peak at each moment (where)

    def step_time(self) -> timing.StepTime | None:
        """The step's time on the card (None for a CPU run, or a card without a known speed)."""
        speed = self.card and self.target == "cuda" and speed_of(self.card)
        if not (speed and self.kernels):
            return None
        if self.extrapolation:
            a, b, k = self.extrapolation
            return timing.extrapolated(timing.step_time(a, speed), timing.step_time(b, speed), k)
        return timing.step_time(self.kernels, speed)

    @property
    def card_bytes(self) -> int:
        """What the card must hold: the allocator's reserve and the CUDA context."""
        return self.peak.reserved + CUDA_CONTEXT if self.target == "cuda" else self.peak.bytes

    def fits(self, margin: float = 0.0) -> bool | None:
        return None if self.card is None else self.card_bytes <= self.card.usable * (1 - margin)


@contextlib.contextmanager
def fake_run(
    target: str, world_size: int = 1, compile: bool = False, gpu: str = ""
) -> Iterator[tuple[distributed.Dist, MemoryTrace]]:
    """Where a planned step is built and run: fake tensors (no byte allocated), fastpt's Triton ops
    traced through their fakes, a fake process group for rank 0 of world_size, torch.compile's
    caches off; the garbage collector off, so storages die when their last reference goes, as on a
    GPU. Yields the process and an empty trace with the target's allocator rounding and scratch,
    and on CUDA the cuBLAS workspaces of the card `gpu` (--plan-gpu) names."""
    cuda = target == "cuda"
    mem = MemoryTrace(cuda_rounded if cuda else int, scratch_table() if cuda else {}, fsdp_labels(world_size))
    for nbytes in cublas_workspaces(gpu) if cuda else ():  # through torch's allocator, kept for the process
        mem.lives.append(Life(nbytes, 0, "cuBLAS workspace", (), "before", kind="cuBLAS workspace"))
    gc.collect(1)  # the young garbage (a full collection takes a second; older garbage touches no trace)
    gc.disable()
    try:
        with (
            fake_world(world_size) as d,
            FakeTensorMode(allow_non_fake_inputs=True),  # a compiled AC graph hands back a real RNG state
            kernels.tracing_only(),
            compiling_for_plan() if compile else contextlib.nullcontext(),
        ):
            yield d, mem
    finally:
        gc.enable()


def trace_steps(
    mem: MemoryTrace, step: Callable[[], object], model: torch.nn.Module, optimizers: list, target: str
) -> None:
    """Two calls of step() (an optimizer step) in the trace, what the model compiles recompiled for
    the plan first; after each, its gradients and optimizer state named. Two: the second holds the
    optimizer state that the first creates."""
    recompile_for_plan(model, target)
    mem.add(list(model.parameters()) + list(model.buffers()), "parameters")
    # FSDP keeps each parameter's gradient unsharded, in fp32, across the micro-steps that do not sync.
    unsharded = lambda *_: mem.label(
        (fp.unsharded_accumulated_grad for fp in fsdp_params(model)), "unsharded gradients"
    )
    with mem, model.register_forward_pre_hook(unsharded):
        for _ in range(2):
            mem.begin_step()
            step()
            mem.label((p.grad for p in model.parameters()), "gradients")
            mem.label(
                (v for opt in optimizers for state in opt.state.values() for v in state.values()), "optimizer state"
            )


TRACED: dict[str, Plan] = {}  # this process's recent traces, by what they trace (traced_key)
TRACES_KEPT = 16


def traced_key(cfg: TrainConfig, target: str, world_size: int) -> str:
    """What a trace depends on: the config a step runs (step_config: at most two micro-steps), less
    what only prices or reports the run; the target and the ranks."""
    same = dataclasses.replace(step_config(cfg), max_steps=1, plan_price=0.0, plan_json="", plan_world_size=1)
    return f"{target} x {world_size}: {same!r}"


def trace(cfg: TrainConfig, target: str, world_size: int) -> Plan:
    """The run's plan: its model traced whole (trace_model), or for a deep one (traced_layers) the
    same model with fewer blocks traced twice and the plan extrapolated to its depth (extrapolated;
    tests/test_plan.py holds it to the whole trace). A configuration this process traced already is
    not traced again: its plan is the earlier one's, for this run (for_run)."""
    key = traced_key(cfg, target, world_size)
    if key not in TRACED:
        while len(TRACED) >= TRACES_KEPT:
            del TRACED[next(iter(TRACED))]
        TRACED[key] = traced(cfg, target, world_size)
    return for_run(TRACED[key], cfg)


def for_run(plan: Plan, cfg: TrainConfig) -> Plan:
    """A traced plan for a run whose config differs from the traced one's only in what the trace does
    not depend on (traced_key): the run's step (grad_accum micro-steps, its tokens), no card yet."""
    run = lambda log: log and dataclasses.replace(log, grad_accum=cfg.grad_accum, tokens=tokens_per_step(cfg, plan))
    shallow = plan.extrapolation
    extrapolation = shallow and (run(shallow[0]), run(shallow[1]), shallow[2])
    return dataclasses.replace(plan, cfg=cfg, card=None, kernels=run(plan.kernels), extrapolation=extrapolation)


def tokens_per_step(cfg: TrainConfig, plan: Plan) -> int:
    return cfg.micro_batch * plan.seq_len * cfg.grad_accum * plan.world_size


def traced(cfg: TrainConfig, target: str, world_size: int) -> Plan:
    """trace's plan, traced."""
    mcfg = planned_model(cfg)
    pair = depth.traced_layers(cfg, mcfg)
    batch = f"{cfg.micro_batch} x {cfg.seq_len or mcfg.max_seq_len} x {cfg.grad_accum} accum"
    if pair is None:
        progress.say(f"tracing two optimizer steps of its {mcfg.n_layers} blocks at {batch}")
        return trace_model(cfg, target, world_size, mcfg)
    plans = []
    for n in pair:
        progress.say(f"tracing two optimizer steps of {n} of its {mcfg.n_layers} identical blocks at {batch}")
        plans.append(trace_model(cfg, target, world_size, dataclasses.replace(mcfg, n_layers=n), moments=True))
    plan = extrapolated(*plans, (mcfg.n_layers - pair[0]) / (pair[1] - pair[0]))
    plan.depths = (*pair, mcfg.n_layers)
    return plan


def trace_model(cfg: TrainConfig, target: str, world_size: int, mcfg: ModelConfig, moments: bool = False) -> Plan:
    """Two optimizer steps of the run with the model mcfg over fake tensors, traced, each of at most
    two micro-steps: a third and later ones repeat the second's memory (the gradients exist, the last
    one syncs). `moments`: the plan keeps the peak of every moment of the step too (Plan.moments)."""

    t0 = time.process_time()  # CPU seconds: what a plan costs, whatever else the machine runs
    seq_len = cfg.seq_len or mcfg.max_seq_len
    micro_steps = step_config(cfg).grad_accum
    ddp = world_size > 1 and cfg.parallel == "ddp"  # DDP's C++ reducer cannot hold fake tensors: one process
    with fake_run(target, 1 if ddp else world_size, cfg.compile, cfg.plan_gpu) as (d, mem):
        net = build_model(as_planned(cfg, target), mcfg, torch.device("cpu"), d)
        if ddp:
            mem.lives += ddp_buckets(net.raw, mem.round_to)
        loader = FakeLoader(cfg.micro_batch, seq_len, mcfg.vocab_size)
        step = lambda: train_step(net, loader, step_config(cfg), d)
        with timing.KernelTrace(mem, uses_cuda_graphs(cfg), muon.ns_dtype(torch.device(target))) as timed:
            trace_steps(mem, step, net.raw, net.optimizers, target)
        params, flops_per_token = net.raw.num_params(), net.raw.cfg.flops_per_token(seq_len)
        groups = muon_groups(net.optimizers, muon.ns_dtype(torch.device(target))) if ddp else []
    for life in mem.lives if ddp else ():  # gradient_as_bucket_view: the gradients are the buckets' views
        life.nbytes = 0 if life.kind == "gradients" else life.nbytes
    peaks = moment_peaks(mem, target, micro_steps) if moments else {}
    peak = max(peaks.values(), key=lambda p: p.bytes) if peaks else peak_of(mem, target, micro_steps)
    plan = Plan(cfg, target, world_size, seq_len, params, peak, None, time.process_time() - t0, mem)
    plan.moments = peaks
    buckets = [life.shape[0] for life in mem.lives if life.kind == "DDP gradient buckets"]
    plan.kernels = kernel_log(timed, plan, buckets, flops_per_token, groups)
    return plan


def extrapolated(a: Plan, b: Plan, k: float) -> Plan:
    """The plan of the model k times as many blocks deeper than a's as b's is: the peak of each moment
    of the step on its line through a's and b's, the highest of them its peak (depth.extrapolated_peak:
    where the step peaks may move with the depth, from the optimizer to the forward); the parameters
    on their line; the step time in Plan.step_time."""
    line = lambda x, y: x + (y - x) * k
    common = [where for where in b.moments if where in a.moments]
    where = max(common, key=lambda w: line(a.moments[w].bytes, b.moments[w].bytes))
    fragmentation = depth.fragmentation(a.peak, b.peak)
    moments = {w: depth.extrapolated_peak(a.moments[w], b.moments[w], k, fragmentation) for w in common}
    plan = Plan(b.cfg, b.target, b.world_size, b.seq_len, round(line(a.params, b.params)), moments[where], b.card)
    plan.moments = moments
    plan.seconds, plan.trace = a.seconds + b.seconds, b.trace
    plan.kernels, plan.extrapolation = b.kernels, muon_at_depth(a.kernels, b.kernels, k)
    return plan


def muon_at_depth(a: timing.KernelLog, b: timing.KernelLog, k: float) -> tuple:
    """The two shallow logs of a deep DDP plan with Muon, each to be priced with the rank's share of
    the deep model's matrices (each shape's count on its line through a's and b's): the share is a
    ceiling, which no line through two depths gives (24 blocks over 8 ranks take 3 matrices a shape;
    3 and 4 blocks take 1 each). (a, b, k) as they were otherwise."""
    if not a.muon_groups:
        return a, b, k
    pairs = [(na, nb) for (na, _), (nb, _) in zip(a.muon_groups, b.muon_groups, strict=True)]
    deep = [round(na + (nb - na) * k) for na, nb in pairs]
    at_a, at_b = ({pair[i]: n for pair, n in zip(pairs, deep)} for i in (0, 1))
    return dataclasses.replace(a, muon_depth=at_a), dataclasses.replace(b, muon_depth=at_b), k


def muon_groups(optimizers: list, dtype: torch.dtype) -> list[tuple[int, int]]:
    """Muon's matrices by shape, as fastpt.muon.orthogonalize batches them: (how many, bytes each in
    Newton-Schulz's dtype). A DDP plan traces one process, which orthogonalizes every matrix; on N
    ranks each does its share of each group and all-gathers the rest (timing.KernelLog.with_muon)."""
    shapes: dict[tuple[int, ...], int] = {}
    for opt in optimizers:
        if isinstance(opt, muon.Muon):
            for p in (p for group in opt.param_groups for p in group["params"]):
                shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
    return [(n, math.prod(shape) * dtype.itemsize) for shape, n in shapes.items()]


def kernel_log(
    timed: timing.KernelTrace,
    plan: Plan,
    ddp_buckets: list[int],
    flops_per_token: float,
    matrices: list[tuple[int, int]],
) -> timing.KernelLog:
    """The last traced step's launches, and what the run's step repeats of them."""
    step = max(op.step for op in timed.ops)
    last = [op for op in timed.ops if op.step == step]
    tokens = tokens_per_step(plan.cfg, plan)
    micro_steps = step_config(plan.cfg).grad_accum
    return timing.KernelLog(
        last, micro_steps, plan.cfg.grad_accum, plan.world_size, tokens, flops_per_token, ddp_buckets, matrices
    )


DDP_BUCKET_BYTES = (2**20, 25 * 2**20)  # DDP's first bucket, then bucket_cap_mb's default


def ddp_buckets(model: torch.nn.Module, round_to: Callable[[int], int]) -> list[Life]:
    """The gradient buckets a DDP rank holds for the whole run (the reducer allocates them when DDP is
    built; with gradient_as_bucket_view, fastpt's, the gradients are views into them, so trace drops
    their own storages), the parameters in reverse order, as DDP fills them."""
    buckets, size = [], 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        size += p.numel() * p.element_size()
        if size >= DDP_BUCKET_BYTES[bool(buckets)]:
            buckets.append(size)
            size = 0
    buckets += [size] if size else []
    return [Life(round_to(n), 0, "DDP gradient bucket", (n,), "before", kind="DDP gradient buckets") for n in buckets]


def gathered(args: tuple, kwargs: dict, out: object) -> list:
    """FSDP2 copies each all-gathered parameter out of the flat buffer into these."""
    return [(t, "all-gathered parameters") for t in kwargs["out"]]


def fsdp_labels(world_size: int) -> dict:
    """What FSDP2's ops tell of their tensors. Its ops exist once torch.distributed.fsdp is imported
    (~1 s, kept out of fastpt.train's start-up), which a one-process plan never needs."""
    return {torch_internals.fsdp_split_copy(): gathered} if world_size > 1 else {}


# ---- the report


def gib(nbytes: int) -> str:
    return f"{report.figure(nbytes / GIB, 2)} GiB"


def command_seconds() -> float | None:
    """Seconds since this process started (Linux: /proc), imports and every plan included."""
    try:
        start_ticks = float(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    return time.time() - boot - start_ticks / os.sysconf("SC_CLK_TCK")


def unmodelled(plan: Plan) -> str:
    """The warning line for what this run holds beyond the plan's model ('' when nothing applies)."""
    cfg, what = plan.cfg, []
    if plan.target == "cuda" and cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune"):
        what.append(f"the CUDA graphs' memory pools ({cfg.compile_mode})")
    if plan.target == "cuda" and plan.world_size > 1:
        what.append("NCCL's buffers")
        if cfg.parallel == "fsdp":
            what.append("the caching allocator's separate pools of FSDP's all-gather and reduce-scatter streams")
    if not what:
        return ""
    return f"fastpt: warning: the plan does not model {', '.join(what)}: leave room beyond it"


def verdict(plan: Plan) -> str:
    """Whether the run fits its card: with room to spare beyond the plan's error band (fit_margin),
    at risk within it, or not at all."""
    spare = plan.card.usable - plan.card_bytes
    if spare < 0:
        return f"does NOT fit {plan.card}: {gib(-spare)} short"
    margin = fit_margin(plan.cfg.compile) if plan.target == "cuda" else 0.0
    if not plan.fits(margin):
        mode = "compiled" if plan.cfg.compile else "eager"
        return (
            f"fits {plan.card}, but at risk: {gib(spare)} to spare, within the plan's error band "
            f"({margin:.0%} of the card {mode}: {gib(margin * plan.card.usable)})"
        )
    return f"fits {plan.card}: {gib(spare)} to spare"


def describe(plan: Plan, advice: list[str] | None = None) -> list[str]:
    """The plan as it prints: the run, the peak and its parts, what the card needs, the verdict (and
    after it `advice`: what would fit instead), the step time."""
    cfg, cuda, peak = plan.cfg, plan.target == "cuda", plan.peak
    kernels_used = as_planned(cfg, plan.target).kernels
    ranks = f"{plan.world_size} ranks ({cfg.parallel})" if plan.world_size > 1 else "1 GPU" if cuda else "1 process"
    lines = [
        f"plan for {'CUDA' if cuda else 'a CPU run'} | preset {cfg.preset} | params {plan.params:,} | "
        f"dtype {cfg.dtype} | compile {cfg.compile} | AC {cfg.activation_checkpointing} | kernels {cfg.kernels}"
        + (f" ({kernels_used})" if kernels_used != cfg.kernels else "")
        + f" | {cfg.micro_batch} x {plan.seq_len} x {cfg.grad_accum} accum x {ranks}"
        + f" | {report.tokens_text(cfg, plan.seq_len, plan.world_size)}",
        f"peak {'per GPU' if cuda else 'of the CPU allocator'}: {gib(peak.bytes)} "
        f"({'torch.cuda.max_memory_allocated' if cuda else 'tensors allocated'}), at {peak.where}",
    ]
    notes = {"activations": "kept for the backward"}
    if peak.largest:
        nbytes, op, shape = peak.largest
        notes["transient"] = f"largest {gib(nbytes)}: {op}" + (f" {list(shape)}" if shape else "")
    if cuda:
        notes["allocator blocks"] = "the caching allocator's blocks beyond the requests"
    for part, nbytes in {**peak.parts, **({"allocator blocks": peak.blocks} if cuda else {})}.items():
        lines.append(f"  {part:<23} {gib(nbytes):>10}  {notes.get(part, '')}".rstrip())
    if cuda:
        lines.append(
            f"the card needs {gib(plan.card_bytes)}: {gib(peak.reserved)} reserved by the caching allocator "
            f"(its segments, replayed) + {gib(CUDA_CONTEXT)} CUDA context (an estimate)"
        )
    if plan.card is not None:
        lines += [verdict(plan), *(advice or [])]
    if cuda and plan.card is not None:
        step = plan.step_time()
        lines += (
            report.describe(step, plan.card.name, speed_of(plan.card), cfg, plan.fits() is not False)
            if step
            else [f"step time: {plan.card} has no known speed; give one of the named --plan-gpu cards to plan it"]
        )
    took = command_seconds()
    how = ", from {} and {} of its {} blocks (the rest extrapolated)".format(*plan.depths) if plan.depths else ""
    lines.append(
        f"planned in {plan.seconds:.1f} CPU s{how}" + (f" (the whole command so far: {took:.1f} s)" if took else "")
    )
    return lines


def to_json(plan: Plan) -> dict:
    """The plan as --plan-json writes it (sizes in GiB)."""
    peak = plan.peak
    out = {
        "peak_gib": peak.bytes / GIB,
        "parts_gib": {k: v / GIB for k, v in peak.parts.items()},
        "largest_transient": peak.largest
        and {"gib": peak.largest[0] / GIB, "op": peak.largest[1], "shape": list(peak.largest[2])},
        "at": peak.where,
        "micro_batch": plan.cfg.micro_batch,
        "grad_accum": plan.cfg.grad_accum,
        "seq_len": plan.seq_len,
        "world_size": plan.world_size,
        "device": plan.target,
        "params": plan.params,
        "seconds": plan.seconds,
        "tokens": report.run_tokens(plan.cfg, plan.seq_len, plan.world_size),
    }
    if plan.target == "cuda":
        out.update(
            allocator_blocks_gib=peak.blocks / GIB,
            reserved_gib=peak.reserved / GIB,
            cuda_context_gib=CUDA_CONTEXT / GIB,
            card_gib=plan.card_bytes / GIB,
        )
    if plan.card is not None:
        out.update(gpu=plan.card.name, gpu_gib=plan.card.total / GIB, fits=plan.fits())
        if plan.card.free is not None:
            out.update(gpu_free_gib=plan.card.free / GIB)
    if step := plan.step_time():
        out.update(report.to_json(step, plan.cfg, speed_of(plan.card), plan.fits() is not False))
    return out
