"""Know before you rent: a run's GPU memory planned on any machine, by running its real step over
fake tensors. `python -m fastpt.train --plan [the run's flags]`; `--micro-batch auto` uses the same.

The config resolves as the run's would, then train.build_model builds the model, its compile and
DDP / FSDP wrapping, its optimizers and precision under FakeTensorMode, and train.train_step runs
two optimizer steps of it (all micro-steps, clipping and the optimizer included) inside a
memory.MemoryTrace. Shapes and dtypes are real, no byte is allocated, no data is read. Under FSDP
a fake process group lets this one process play rank 0 of N.

A fake CUDA device does not run on a CPU build of torch, so a plan for CUDA runs over fake CPU
tensors with a GPU run's choices and corrects for what differs, explicitly:
- the kernels: --kernels auto means Triton there (their registered fakes answer for them), and the
  scratch that a kernel allocates inside (SCRATCH) is added while its op runs;
- attention: the CPU's flash kernel saves what CUDA's does (q, k, v, out, an fp32 logsumexp); the
  CUDA flash backward's accumulators are added as its scratch;
- sizes: the CUDA caching allocator's rounding and blocks (memory.replay);
- autocast: CPU and CUDA cast the ops of fastpt's forward alike (matmuls and attention to the
  autocast dtype on both; the norms and the loss upcast their inputs themselves), so nothing to do.
Compiled runs compile with Inductor's own decompositions, joint-graph passes and min-cut
partitioner (torch._inductor.compile_fx with an inner compiler that runs the partitioned graphs
op by op): the activations kept are those Inductor keeps; its fusion of pointwise ops inside a
graph is not modelled, so a compiled plan may count transients that Inductor never allocates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule

from fastpt import distributed, kernels
from fastpt.compiled_memory import compiling_for_plan, recompile_for_plan
from fastpt.config import AUTO, CPU_PROFILE, PRESET_BATCH, ModelConfig, TrainConfig, load_toml, model_config, resolve
from fastpt.data import Batch, common_vocab, data_sources, doc_token
from fastpt.errors import ConfigError
from fastpt.files import os_reason, write_atomic
from fastpt.hf import from_hf_config, is_hf_dir, read_json
from fastpt.kernels import scratch
from fastpt.memory import Life, MemoryTrace, cuda_rounded, replay, sweep

GIB = 2**30
MIB = 2**20
# The card's whole memory, as nvidia-smi's memory.total reports it (MiB).
GPUS = {
    "h100-80": ("H100 80GB", 81559),
    "h200": ("H200", 143771),
    "a100-40": ("A100 40GB", 40960),
    "a100-80": ("A100 80GB", 81920),
    "l4": ("L4", 23034),
    "4090": ("RTX 4090", 24564),
}
# What a CUDA process holds outside torch's allocator: the CUDA context with lazily loaded kernels,
# the cuBLAS / cuDNN handles and their libraries' modules: 0.3-0.6 GiB on recent drivers. An
# estimate until bench/gpu.sh measures it (nvidia-smi's used memory less torch's reserved).
CUDA_CONTEXT = GIB // 2
CUBLAS_WORKSPACE = 32 * MIB  # PyTorch's default cuBLAS workspace on Hopper, allocated through torch
FIT_MARGIN = 0.05  # --micro-batch auto leaves this fraction of the card free


@dataclass
class Card:
    name: str
    total: int  # bytes

    def __str__(self) -> str:
        return f"{self.name} ({self.total / GIB:.1f} GiB)"


def card(spec: str) -> Card | None:
    """--plan-gpu: a known card, 'NGiB' (or a bare number of GiB), or '' for this machine's GPU
    (None without one)."""
    if not spec:
        if not torch.cuda.is_available():
            return None
        return Card(torch.cuda.get_device_name(), torch.cuda.mem_get_info()[1])
    if spec.lower() in GPUS:
        name, mib = GPUS[spec.lower()]
        return Card(name, mib * MIB)
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*(?:gib|g|gb)?", spec.strip().lower()):
        return Card(f"{m[1]} GiB", int(float(m[1]) * GIB))
    raise ConfigError(f"'plan_gpu' = {spec!r} is not a card: one of {', '.join(GPUS)}, or a size such as 24GiB")


# ---- what a CUDA kernel allocates inside, beyond its outputs


def flash_backward_bytes(args: tuple, out: object) -> int:
    """CUDA flash attention's backward: an fp32 dq accumulator (rows to 128, head dim to 32) and
    softmax statistics; with GQA, dk and dv at the full head count before their sum over groups."""
    q, k = args[1], args[2]
    b, h, t, hd = q.shape
    rows, width = -(-t // 128) * 128, -(-hd // 32) * 32
    gqa = 2 * b * t * h * hd * q.dtype.itemsize if k.shape[1] != h else 0
    return b * rows * h * width * 4 + b * h * rows * 4 + gqa


def linear_cross_entropy_bytes(args: tuple, out: object) -> int:
    input, weight, compute_dtype = args[0], args[1], args[6]
    return scratch.linear_cross_entropy_bytes(input, weight, compute_dtype)


def scratch_table() -> dict:
    fastpt_ops = torch.ops.fastpt
    return {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: flash_backward_bytes,
        fastpt_ops.linear_cross_entropy.default: linear_cross_entropy_bytes,
        fastpt_ops.linear_cross_entropy_backward.default: linear_cross_entropy_bytes,
    }


# ---- the run, built over fake tensors


class FakeLoader:
    """What train_step reads from a TrainLoader: a fresh (B, T) pair of int64 batches per micro-step."""

    def __init__(self, micro_batch: int, seq_len: int, vocab_size: int):
        self.shape, self.vocab_size = (micro_batch, seq_len), vocab_size
        self.device = torch.device("cpu")

    def next(self) -> Batch:
        return Batch(*(torch.randint(0, self.vocab_size, self.shape) for _ in range(2)))


def planned_model(cfg: TrainConfig) -> ModelConfig:
    """The model the run would build, from the preset, the shape keys and --init-from's config.json;
    the vocab from --data's meta (no shard is read) or the preset."""
    base = None
    if cfg.init_from:
        if not is_hf_dir(cfg.init_from):
            raise ConfigError(f"{cfg.init_from}: not a Hugging Face model folder (no config.json)")
        path = Path(cfg.init_from) / "config.json"
        base = from_hf_config(read_json(path), str(path))
    sources = data_sources(cfg.data)
    vocab = common_vocab(sources, cfg.data_format) if sources else 0
    document = cfg.attention == "document"
    doc = (doc_token(sources[0].folder, "'attention' = 'document'") if sources else 0) if document else None
    mcfg = model_config(cfg, vocab, base, doc)
    if not mcfg.vocab_size:
        raise ConfigError(f"preset {cfg.preset!r} takes its vocab from the data: give --vocab-size N or --data DIR")
    return mcfg


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[distributed.Dist]:
    """Rank 0 of world_size over a fake process group (collectives return at once), or one process."""
    if world_size == 1:
        yield distributed.ONE_PROCESS
        return
    import torch.distributed._tools.fake_collectives  # noqa: F401  (c10d collectives on fake tensors)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield distributed.Dist(0, 0, world_size)
    finally:
        dist.destroy_process_group()


def as_planned(cfg: TrainConfig, target: str) -> TrainConfig:
    """The config the planner builds: a GPU run's kernels choice ('auto' is Triton there)."""
    return dataclasses.replace(cfg, kernels="triton" if target == "cuda" and cfg.kernels == "auto" else cfg.kernels)


@dataclass
class Plan:
    """A planned step: the peak per GPU (or the CPU run's allocator peak) and where it goes."""

    cfg: TrainConfig
    target: str  # cuda | cpu
    world_size: int
    seq_len: int
    params: int
    peak: int  # bytes: what torch.cuda.max_memory_allocated would report (CPU: the allocator's peak)
    parts: dict[str, int]  # at the peak
    blocks: int  # the caching allocator's blocks beyond the requests, at the peak
    largest: tuple[int, str, tuple[int, ...]] | None  # the largest transient then: bytes, op, shape
    where: str
    reserved: int  # max_memory_reserved (0 on a CPU)
    card: Card | None
    seconds: float = 0.0

    @property
    def card_bytes(self) -> int:
        """What the card must hold: the allocator's reserve and the CUDA context."""
        return self.reserved + CUDA_CONTEXT if self.target == "cuda" else self.peak

    def fits(self, margin: float = 0.0) -> bool | None:
        return None if self.card is None else self.card_bytes <= self.card.total * (1 - margin)


@dataclass
class SimpleData:
    """The part of train.Data that build_model reads."""

    model_config: ModelConfig
    init_weights: None = None


def trace(cfg: TrainConfig, target: str, world_size: int) -> Plan:
    """Two optimizer steps of the run over fake tensors, traced; the peak and its parts."""
    t0 = time.perf_counter()
    mcfg = planned_model(cfg)
    seq_len = cfg.seq_len or mcfg.max_seq_len
    cuda = target == "cuda"
    mem = MemoryTrace(cuda_rounded if cuda else int, scratch_table() if cuda else {}, FSDP_LABELS)
    if cuda:  # allocated through torch's allocator at the first matmul, kept for the process
        mem.lives.append(Life(CUBLAS_WORKSPACE, 0, "cuBLAS workspace", (), "before", kind="cuBLAS workspace"))
    gc.collect()
    gc.disable()  # storages die when their last reference goes, as on a GPU, not when a cycle is collected
    compiling = compiling_for_plan() if cfg.compile else contextlib.nullcontext()
    try:
        with fake_world(world_size) as d, FakeTensorMode(allow_non_fake_inputs=True), kernels.tracing_only(), compiling:
            from fastpt.train import build_model

            net = build_model(as_planned(cfg, target), SimpleData(mcfg), torch.device("cpu"), d)
            recompile_for_plan(net.raw, target)
            run_steps(net, FakeLoader(cfg.micro_batch, seq_len, mcfg.vocab_size), cfg, d, mem)
            params = net.raw.num_params()
    finally:
        gc.enable()
    return summarize(cfg, target, world_size, seq_len, params, mem, time.perf_counter() - t0)


def fsdp_params(model: torch.nn.Module) -> Iterator:
    """FSDP2's records of every sharded parameter (its private FSDPParam objects); none without FSDP."""
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        yield from group.fsdp_params if group else ()


def gathered(args: tuple, kwargs: dict, out: object) -> list:
    """FSDP2 copies each all-gathered parameter out of the flat buffer into these."""
    return [(t, "all-gathered parameters") for t in kwargs["out"]]


FSDP_LABELS = {torch.ops.fsdp.split_with_sizes_copy.default: gathered}


def run_steps(net, loader: FakeLoader, cfg: TrainConfig, d: distributed.Dist, mem: MemoryTrace) -> None:
    """Two steps of train.train_step in the trace; after each, its gradients and optimizer state named.
    Two: the second holds the optimizer state that the first creates. Each of at most two micro-steps:
    a third and later ones repeat the second's memory (the gradients exist, the last one syncs)."""
    from fastpt.train import train_step

    micro_steps = min(cfg.grad_accum, 2)
    mem.add(list(net.raw.parameters()) + list(net.raw.buffers()), "parameters")
    # FSDP keeps each parameter's gradient unsharded, in fp32, across the micro-steps that do not sync.
    unsharded = lambda *_: mem.label(
        (fp.unsharded_accumulated_grad for fp in fsdp_params(net.raw)), "unsharded gradients"
    )
    with mem, net.raw.register_forward_pre_hook(unsharded):
        for _ in range(2):
            mem.begin_step()
            train_step(net.model, net.optimizers, net.scaler, loader, micro_steps, net.autocast, cfg.max_grad_norm, d)
            mem.label((p.grad for p in net.raw.parameters()), "gradients")
            states = (v for opt in net.optimizers for state in opt.state.values() for v in state.values())
            mem.label(states, "optimizer state")


def summarize(
    cfg: TrainConfig, target: str, world_size: int, seq_len: int, params: int, mem: MemoryTrace, seconds: float
) -> Plan:
    """The peak (on CUDA through the caching allocator's replay) and what was alive then."""
    if target == "cuda":
        allocator = replay(mem.lives)
        peak, event, reserved = allocator.peak_allocated, allocator.peak_event, allocator.peak_reserved
    else:
        (peak, event), reserved = sweep(mem.lives), 0
    snap = mem.at(event)
    largest = snap.largest and (snap.largest.nbytes, snap.largest.op, snap.largest.shape)
    where = clip_phase(snap.where, cfg.grad_accum)
    blocks = peak - sum(snap.parts.values())
    return Plan(
        cfg, target, world_size, seq_len, params, peak, snap.parts, blocks, largest, where, reserved, None, seconds
    )


def clip_phase(where: str, grad_accum: int) -> str:
    """A 'forward' after the last micro-step's backward is the clipping and loss reduction."""
    m = re.search(r"micro-step (\d+), forward", where)
    if m and int(m[1]) > grad_accum:
        return where[: m.start()] + "after the backward (clipping)"
    return where


# ---- the report


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def describe(plan: Plan) -> list[str]:
    """The plan as it prints: the run, the peak and its parts, what the card needs, the verdict."""
    cfg, cuda = plan.cfg, plan.target == "cuda"
    kernels_used = as_planned(cfg, plan.target).kernels
    ranks = f"{plan.world_size} ranks ({cfg.parallel})" if plan.world_size > 1 else "1 GPU" if cuda else "1 process"
    lines = [
        f"plan for {'CUDA' if cuda else 'a CPU'} | preset {cfg.preset} | params {plan.params:,} | dtype {cfg.dtype} | "
        f"compile {cfg.compile} | AC {cfg.activation_checkpointing} | kernels {cfg.kernels}"
        + (f" ({kernels_used})" if kernels_used != cfg.kernels else "")
        + f" | {cfg.micro_batch} x {plan.seq_len} x {cfg.grad_accum} accum x {ranks}",
        f"peak {'per GPU' if cuda else 'of the CPU allocator'}: {gib(plan.peak)} "
        f"({'torch.cuda.max_memory_allocated' if cuda else 'allocated tensors'}), at {plan.where}",
    ]
    notes = {"activations": "kept for the backward", "transient": ""}
    if plan.largest:
        nbytes, op, shape = plan.largest
        notes["transient"] = f"largest {gib(nbytes)}: {op} {list(shape)}"
    for part, nbytes in plan.parts.items():
        lines.append(f"  {part:<23} {gib(nbytes):>10}  {notes.get(part, '')}".rstrip())
    if cuda:
        lines.append(
            f"  {'allocator blocks':<23} {gib(plan.blocks):>10}  the caching allocator's blocks beyond the requests"
        )
        lines.append(
            f"the card needs {gib(plan.card_bytes)}: {gib(plan.reserved)} reserved by the caching allocator "
            f"(its segments, replayed) + {gib(CUDA_CONTEXT)} CUDA context (an estimate)"
        )
    if plan.card is not None:
        verdict = "fits" if plan.fits() else "does NOT fit"
        spare = plan.card.total - plan.card_bytes
        lines.append(f"{verdict} {plan.card}: {gib(abs(spare))} {'to spare' if spare >= 0 else 'short'}")
    lines.append(f"planned in {plan.seconds:.1f} s")
    return lines


def to_json(plan: Plan) -> dict:
    out = {
        "peak_gib": plan.peak / GIB,
        "parts_gib": {k: v / GIB for k, v in plan.parts.items()},
        "largest_transient": plan.largest
        and {"gib": plan.largest[0] / GIB, "op": plan.largest[1], "shape": list(plan.largest[2])},
        "at": plan.where,
        "micro_batch": plan.cfg.micro_batch,
        "grad_accum": plan.cfg.grad_accum,
        "seq_len": plan.seq_len,
        "world_size": plan.world_size,
        "device": plan.target,
        "params": plan.params,
        "seconds": plan.seconds,
    }
    if plan.target == "cuda":
        out.update(
            allocator_blocks_gib=plan.blocks / GIB,
            reserved_gib=plan.reserved / GIB,
            cuda_context_gib=CUDA_CONTEXT / GIB,
            card_gib=plan.card_bytes / GIB,
        )
    if plan.card is not None:
        out.update(gpu=plan.card.name, gpu_gib=plan.card.total / GIB, fits=plan.fits())
    return out


# ---- --micro-batch auto


def config_sequences(cfg: TrainConfig) -> int:
    """Sequences per optimizer step and rank that the config asks for: its micro-batch (the preset's,
    or the CPU profile's, when it says auto) x grad_accum."""
    micro = cfg.micro_batch
    if micro == AUTO:
        micro = CPU_PROFILE["micro_batch"] if cfg.device == "cpu" else PRESET_BATCH.get(cfg.preset, (16, 0))[0]
    return micro * cfg.grad_accum


def split(sequences: int, most: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) for `sequences` per step with micro-batches of at most `most`: the
    fewest micro-steps, then the smallest micro-batch that covers the sequences with them."""
    accum = -(-sequences // most)
    return -(-sequences // accum), accum


def fit_micro_batch(cfg: TrainConfig, target: str, world_size: int, gpu: Card | None) -> tuple[Plan, str]:
    """The largest micro-batch whose plan fits the card with FIT_MARGIN free, grad_accum adjusted to
    keep the config's sequences per step (or the nearest above); the plan at it, and what it chose.
    The card's need is about linear in the micro-batch: two plans place the first guess."""
    if gpu is None:
        raise ConfigError("'micro_batch' = 'auto' needs a card to fit and this machine has no GPU: give --plan-gpu")
    sequences, limit = config_sequences(cfg), gpu.total * (1 - FIT_MARGIN)

    def plan_at(micro: int) -> Plan:
        micro, accum = split(sequences, micro)
        p = trace(dataclasses.replace(cfg, micro_batch=micro, grad_accum=accum), target, world_size)
        p.card = gpu
        return p

    one = plan_at(1)
    if not one.fits(FIT_MARGIN):
        raise ConfigError(
            f"'micro_batch' = 'auto': even micro-batch 1 does not fit {gpu} ({gib(one.card_bytes)} planned, "
            f"peak {gib(one.peak)}): use --activation-checkpointing full, or --parallel fsdp over more GPUs"
        )
    best, most = one, sequences
    if sequences > 1:
        probe = plan_at(min(sequences, 4))
        per_sequence = max(1, (probe.card_bytes - one.card_bytes) / (probe.cfg.micro_batch - 1))
        most = max(1, min(sequences, 1 + int((limit - one.card_bytes) / per_sequence)))
        best = probe if probe.fits(FIT_MARGIN) else one
    while most > best.cfg.micro_batch:
        p = plan_at(most)
        if p.fits(FIT_MARGIN):
            best = p
            break
        most = split(sequences, most)[0] - 1
    micro, accum = best.cfg.micro_batch, best.cfg.grad_accum
    exact = "" if micro * accum == sequences else f", the nearest above the config's {sequences}"
    why = (
        f"micro-batch auto: {micro} x {accum} accum = {micro * accum} sequences/step{exact}; the largest that "
        f"fits {gpu} with {FIT_MARGIN:.0%} free ({gib(best.card_bytes)} planned)"
    )
    return best, why


# ---- the command


def requested(cli: dict, config_file: str | None) -> bool:
    """--plan on the command line, or plan = true in the TOML file."""
    if "plan" in cli:
        return bool(cli["plan"])
    return bool(config_file and load_toml(config_file).get("plan"))


def machine_card() -> Card:
    """This machine's memory, the card of a plan for a CPU run."""
    return Card("this machine's memory", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def planned_config(cli: dict, config_file: str | None) -> tuple[TrainConfig, str]:
    """The run's config, resolved as the run would (for CUDA unless --device cpu), and the target."""
    target = cli.get("device") or "cuda"
    cfg = resolve(cli, config_file, target)
    if target == "cpu":
        from fastpt.train import check_runtime

        check_runtime(cfg)  # a CPU run runs here: what this machine refuses, the plan refuses
    if cfg.float8:
        raise ConfigError("--plan does not model --float8 (torchao's float8 tensors have no fake CPU kernels)")
    return cfg, target


def main(cli: dict, config_file: str | None) -> int:
    """python -m fastpt.train --plan ...: print the plan (and --plan-json it); trains nothing."""
    cfg, target = planned_config(cli, config_file)
    gpu = card(cfg.plan_gpu) if target == "cuda" else machine_card()
    why = ""
    if cfg.micro_batch == AUTO:
        plan, why = fit_micro_batch(cfg, target, cfg.plan_world_size, gpu)
    else:
        plan = trace(cfg, target, cfg.plan_world_size)
        plan.card = gpu
    lines = describe(plan) + ([why] if why else [])
    print("\n".join(lines), flush=True)
    if cfg.plan_json:
        text = json.dumps(to_json(plan) | ({"chosen": why} if why else {}), indent=2) + "\n"
        try:
            write_atomic(Path(cfg.plan_json), lambda f: f.write(text.encode()))
        except OSError as e:
            raise ConfigError(f"'plan_json' = {cfg.plan_json!r}: cannot write it ({os_reason(e)})") from None
    return 0


def auto_micro_batch(cfg: TrainConfig) -> tuple[TrainConfig, str]:
    """A run's --micro-batch auto, before it starts: the config with the chosen micro-batch and
    grad_accum, and the line that says why (unchanged and '' without auto)."""
    if cfg.micro_batch != AUTO:
        return cfg, ""
    gpu = card(cfg.plan_gpu) if cfg.device == "cuda" else machine_card()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    plan, why = fit_micro_batch(cfg, cfg.device, world_size, gpu)
    return dataclasses.replace(cfg, micro_batch=plan.cfg.micro_batch, grad_accum=plan.cfg.grad_accum), why
