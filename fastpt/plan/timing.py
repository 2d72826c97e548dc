"""How long a planned step takes on a card, from the same traced step as its memory plan.

`KernelTrace` rides along with the MemoryTrace and records, per op of the step, what it asks of a
GPU (plan.flops): eager, every aten op is a launch (views free); compiled, every kernel Inductor's
lowering realizes (plan.compiled: its inlined pointwise ops cost nothing of their own, a realized
kernel reads the buffers it inlines and writes its output), plus its extern kernels (matmuls,
attention, fastpt's Triton ops). `step_time` prices each kernel on a card (gpus.Speed) and runs
them on a timeline of three clocks, one per side of the machine:

- CPU: each eager op costs EAGER_OP_US of dispatch (a view VIEW_OP_US), each compiled kernel
  COMPILED_KERNEL_US of Inductor's launcher (CUDA_GRAPH_KERNEL_US under CUDA graphs); a kernel
  starts no earlier than its launch, so a launch-bound step is as long as its CPU side;
- compute stream: matmuls at FLOPs / (peak x measured share x tile and wave quantization over the
  SMs x a K ramp), attention at FLOPs / (peak x ATTENTION_SHARE), everything else at bytes /
  (bandwidth x measured copy share); each launch adds KERNEL_US;
- communication stream: a ring collective moves (N-1)/N of its bytes (twice for an all-reduce)
  over the link at COMM_EFF, plus (N-1) x RING_STEP_US; it starts when its inputs are ready, and
  the kernels reading its output wait for it. DDP's buckets (one process planned) are all-reduced
  as the syncing backward reaches them (by its FLOPs); the optimizer waits for every collective.

The trace runs at most two micro-steps (planner.step_config): the first is repeated grad_accum - 1
times, the second (which syncs) once. Constants and their sources: docs/performance.md.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from fastpt.plan.compiled import base, is_kernel, nbytes, op_name
from fastpt.plan.flops import Cost, op_cost, tensors
from fastpt.plan.gpus import Speed
from fastpt.plan.memory import MemoryTrace, storages

EAGER_OP_US = 8.0  # Python + autograd + dispatcher + cudaLaunchKernel per eager aten op
VIEW_OP_US = 2.0  # a view: dispatch, no kernel
COMPILED_KERNEL_US = 4.0  # Inductor's wrapper launching one Triton or extern kernel
CUDA_GRAPH_KERNEL_US = 0.5  # a kernel replayed inside a CUDA graph
KERNEL_US = 2.0  # GPU time every launch takes on top of its work (launch latency, ramp, tail)
ATTENTION_SHARE = {False: 0.60, True: 0.45}  # flash attention forward / backward, of a matmul's share
TILES = ((128, 256, 1.0), (128, 128, 0.92), (64, 128, 0.75))  # cuBLAS tiles, relative efficiency
SPLIT_K_MIN = 1024  # split-K gives each split at least this much of K
K_RAMP = 64  # a matmul's inner dimension K reaches K / (K + K_RAMP) of the share (of K = 8192's)
COMM_EFF = 0.80  # NCCL's bus bandwidth of the link's
RING_STEP_US = 6.0  # latency per ring step
PARTS = ("forward", "backward", "optimizer")


@dataclass(slots=True)
class Op:
    """One launch (or view, or collective) of the traced step."""

    label: str
    phase: str  # forward | backward | optimizer
    micro: int  # micro-step, 1-based; after the last one's backward: the clipping
    cost: Cost
    cpu_us: float
    reads: tuple[int, ...] = ()  # storages (their StorageImpl addresses)
    writes: tuple[int, ...] = ()
    step: int = 0


class KernelTrace(TorchDispatchMode):
    """Records every op the MemoryTrace `mem` sees (entered outside it), as an Op."""

    supports_higher_order_operators = True

    def __init__(self, mem: MemoryTrace, cuda_graphs: bool = False):
        super().__init__()
        from torch.distributed.tensor import DTensor  # here, not at the top: ~1 s of fastpt.train's start-up

        self._dtensor = DTensor  # once per trace, not once per op
        self.mem, self.cuda_graphs = mem, cuda_graphs
        self.ops: list[Op] = []
        self._step, self._micro, self._last, self._in_optimizer, self._hooks = -1, 1, "forward", False, ()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __enter__(self) -> KernelTrace:
        self._hooks = (
            register_optimizer_step_pre_hook(lambda *_: setattr(self, "_in_optimizer", True)),
            register_optimizer_step_post_hook(lambda *_: setattr(self, "_in_optimizer", False)),
        )
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is self._dtensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload) and not (self.mem.paused or self.mem.fusing):
            self._record(func, args, kwargs, out)
        return out

    def _phase(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        step = len(self.mem.steps)
        if step != self._step:
            self._step, self._micro = step, 1
        elif phase == "forward" and self._last == "backward":
            self._micro += 1
        self._last = phase
        return phase

    def _record(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> None:
        lowered = getattr(self.mem, "lowered", None)  # (Lowering, node) of the compiled graph running
        node = lowered[1] if lowered else None
        in_graph = node is not None and node.op == "call_function" and node.target is func
        if in_graph and is_kernel(node):
            cost, label = graph_kernel(lowered[0], node), fused_label(lowered[0], node)
        else:
            cost, label = op_cost(func, args, kwargs, out), short_name(func, cost_shape(func, args))
            if cost.kind == "attention":  # the CPU's flash op stands for CUDA's
                label = "flash attention" + (" backward" if cost.backward else "")
        if in_graph:
            cpu = 0.0 if cost.kind == "free" else CUDA_GRAPH_KERNEL_US if self.cuda_graphs else COMPILED_KERNEL_US
        else:
            cpu = VIEW_OP_US if cost.kind == "free" else EAGER_OP_US
        phase = self._phase()
        reads = tuple(st._cdata for t in tensors((args, kwargs)) for st in storages(t))
        writes = tuple(st._cdata for t in tensors(out) for st in storages(t))
        if cost.kind == "comm":  # in-place collectives write their output argument
            writes += reads
        self.ops.append(Op(label, phase, self._micro, cost, cpu * cost.launches, reads, writes, self._step))


def cost_shape(func: torch._ops.OpOverload, args: tuple) -> str:
    shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2][:2]
    return " x ".join("x".join(map(str, s)) for s in shapes)


def short_name(func: torch._ops.OpOverload, shape: str) -> str:
    name = f"{func.namespace}.{func._overloadpacket.__name__}"
    return f"{name} {shape}" if shape and func._overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm") else name


def graph_kernel(lowering, node: torch.fx.Node) -> Cost:
    """A kernel of Inductor's: the buffers it reads (its inlined ops' inputs) and its output."""
    moved = sum(nb[0] for r in lowering.reads[node] if isinstance(r, torch.fx.Node) and (nb := nbytes(r)))
    out = nbytes(node)
    return Cost("memory", moved + (out[0] if out else 0))


def fused_label(lowering, node: torch.fx.Node) -> str:
    """'triton: mul, add, rsqrt -> mean': the ops a realized kernel inlines, and its own."""
    seen, stack, names = set(), list(node.all_input_nodes), []
    while stack:
        n = base(stack.pop())
        if isinstance(n, torch.fx.Node) and n in lowering.fused and n not in seen:
            seen.add(n)
            names.append(op_name(n))
            stack += n.all_input_nodes
    inlined = ", ".join(dict.fromkeys(reversed(names[-4:])))
    return f"triton: {inlined} -> {op_name(node)}" if inlined else f"triton: {op_name(node)}"


@dataclass
class KernelLog:
    """The traced step's ops and what a step of the run repeats of them."""

    ops: list[Op]  # the last traced optimizer step's
    micro_steps: int  # traced (at most two)
    grad_accum: int  # the run's
    world_size: int
    tokens: int  # per optimizer step, all GPUs
    ddp_buckets: list[int] = field(default_factory=list)  # bytes, in the order the backward fills them

    def sequence(self) -> list[Op]:
        """The run's whole step: the first micro-step grad_accum - 1 times, the syncing one, then the
        clipping and the optimizer."""
        micro = [[o for o in self.ops if o.micro == m and o.phase != "optimizer"] for m in (1, self.micro_steps)]
        rest = [o for o in self.ops if o.micro > self.micro_steps or o.phase == "optimizer"]
        for o in rest:  # the clipping after the last backward belongs with the optimizer
            o.phase = "optimizer"
        last = self.with_ddp(micro[1])
        barrier = Op("wait for the collectives", "backward", 0, Cost("barrier"), 0.0)
        return micro[0] * (self.grad_accum - 1) + last + [barrier] + rest

    def with_ddp(self, ops: list[Op]) -> list[Op]:
        """DDP's bucket copies and all-reduces, placed where the backward has done their share of
        its FLOPs (a bucket is all-reduced once its last gradient is made)."""
        if self.world_size == 1 or not self.ddp_buckets:
            return ops
        total, flops, out, filled, queue = sum(self.ddp_buckets), 0.0, [], 0, list(self.ddp_buckets)
        backward = sum(o.cost.flops for o in ops if o.phase == "backward") or 1.0
        for op in ops:
            out.append(op)
            flops += op.cost.flops if op.phase == "backward" else 0.0
            while queue and (filled + queue[0]) / total <= flops / backward + 1e-9:
                n = queue.pop(0)
                filled += n
                out.append(Op("DDP bucket copy", "backward", op.micro, Cost("memory", 2 * n), EAGER_OP_US))
                out.append(
                    Op(
                        "DDP all-reduce",
                        "backward",
                        op.micro,
                        Cost("comm", comm="all-reduce", comm_bytes=2 * n),
                        EAGER_OP_US,
                    )
                )
        return out


@dataclass
class Kernel:
    """One kernel of the run's step, priced: its FLOPs, bytes, what bounds it, its time."""

    label: str
    phase: str
    count: int
    flops: float
    bytes: int
    bound: str  # compute | memory | launch | communication
    seconds: float  # all its launches in a step


@dataclass
class StepTime:
    seconds: float
    parts: dict[str, float]  # forward, backward, optimizer, communication (exposed), overhead
    tokens: int
    world_size: int
    mfu: float
    launches: int
    cpu_seconds: float
    kernels: list[Kernel]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tok_s_per_gpu(self) -> float:
        return self.tok_s / self.world_size


def peak_flops(speed: Speed, dtype: torch.dtype | None) -> float:
    tflops = speed.fp32_tflops if dtype == torch.float32 else speed.bf16_tflops
    return tflops * 1e12


def matmul_seconds(speed: Speed, mm: tuple[int, int, int, int], dtype: torch.dtype | None) -> float:
    """2 M N K batch / (peak x share x the best tile's filled fraction of its last wave x K ramp)."""
    m, n, k, batch = mm
    ramp = (k / (k + K_RAMP)) / (8192 / (8192 + K_RAMP))
    best = math.inf
    for tm, tn, share in TILES:
        tiles = -(-m // tm) * -(-n // tn) * batch
        split = max(1, min(speed.sms // tiles, k // SPLIT_K_MIN))  # split-K fills the SMs a few tiles leave idle
        waves = -(-tiles * split // speed.sms)
        filled = m * n * batch * split / (waves * speed.sms * tm * tn)
        best = min(
            best, 2.0 * m * n * k * batch / (peak_flops(speed, dtype) * speed.matmul_eff * share * filled * ramp)
        )
    return best


def kernel_seconds(speed: Speed, cost: Cost, world_size: int) -> tuple[float, str]:
    """One op's GPU time on the card (its stream's), and what bounds it."""
    if cost.kind == "comm":
        if world_size == 1:
            return 0.0, "communication"
        ring = (world_size - 1) / world_size * cost.comm_bytes / (speed.link_gbs * 1e9 * COMM_EFF)
        return ring + (world_size - 1) * RING_STEP_US * 1e-6, "communication"
    if cost.kind in ("free", "sync", "barrier"):
        return 0.0, "launch"
    memory = cost.bytes / (speed.hbm_gbs * 1e9 * speed.copy_eff)
    compute = sum(matmul_seconds(speed, mm, cost.dtype) for mm in cost.matmuls)
    if cost.kind == "attention":
        compute = cost.flops / (peak_flops(speed, cost.dtype) * speed.matmul_eff * ATTENTION_SHARE[cost.backward])
    work = compute + memory if cost.serial else max(compute, memory)
    floor = cost.launches * KERNEL_US * 1e-6
    bound = "launch" if floor > work else "compute" if compute >= memory else "memory"
    return work + floor, bound


def simulate(ops: list[Op], seconds: list[float]) -> tuple[float, dict[str, float], float]:
    """The step on its three clocks: its end, the compute stream's busy time by part, the CPU's time."""
    cpu = gpu = comm = 0.0
    ready: dict[int, float] = {}
    busy: dict[str, float] = defaultdict(float)
    for op, t in zip(ops, seconds, strict=True):
        cpu += op.cpu_us * 1e-6
        kind = op.cost.kind
        if kind == "sync":
            cpu = max(cpu, gpu, comm)
            continue
        if kind == "barrier":
            gpu = max(gpu, comm)
            continue
        if kind == "free":
            continue
        start = max([cpu] + [ready.get(r, 0.0) for r in op.reads])
        if kind == "comm":
            comm = end = max(start, comm) + t
        else:
            gpu = end = max(start, gpu) + t
            busy[op.phase] += t
        for w in op.writes:
            ready[w] = end
    return max(cpu, gpu, comm), busy, cpu


def step_time(log: KernelLog, speed: Speed) -> StepTime:
    """The run's step on the card (module docstring)."""
    ops = log.sequence()
    priced = [kernel_seconds(speed, op.cost, log.world_size) for op in ops]
    seconds = [t for t, _ in priced]
    total, busy, cpu = simulate(ops, seconds)
    alone, _, _ = simulate(ops, [0.0 if op.cost.kind == "comm" else t for op, t in zip(ops, seconds, strict=True)])
    parts = {p: busy.get(p, 0.0) for p in PARTS}
    parts["communication"] = total - alone
    parts["overhead"] = alone - sum(busy.values())
    forward = sum(op.cost.flops for op in ops if op.phase == "forward")
    mfu = 3 * forward / total / peak_flops(speed, torch.bfloat16)
    launches = sum(op.cost.launches for op in ops if op.cost.kind not in ("free", "sync", "barrier"))
    return StepTime(total, parts, log.tokens, log.world_size, mfu, launches, cpu, top_kernels(ops, priced))


def top_kernels(ops: list[Op], priced: list[tuple[float, str]]) -> list[Kernel]:
    """The step's kernels grouped by name and phase, most time first."""
    groups: dict[tuple[str, str], Kernel] = {}
    for op, (t, bound) in zip(ops, priced, strict=True):
        if op.cost.kind in ("free", "sync", "barrier"):
            continue
        k = groups.setdefault(
            (op.label, op.phase), Kernel(op.label, op.phase, 0, op.cost.flops, op.cost.bytes, bound, 0.0)
        )
        k.count += 1
        k.seconds += t
    return sorted(groups.values(), key=lambda k: -k.seconds)


# ---- the report


def duration(seconds: float) -> str:
    """14m44s, 3h05m, 2d03h."""
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
    return f"{x:.0f} {unit}"


def describe(step: StepTime, card_name: str, max_steps: int, compiled: bool, top: int = 8) -> list[str]:
    """The step's lines of --plan: its time and parts, tok/s, MFU, the run's wall time, its kernels."""
    p = {k: v * 1e3 for k, v in step.parts.items()}
    tok = f"{step.tok_s / 1e3:,.0f}k" if step.tok_s >= 1e3 else f"{step.tok_s:,.0f}"
    per_gpu = f" ({step.tok_s_per_gpu / 1e3:,.0f}k per GPU)" if step.world_size > 1 else ""
    lines = [
        f"step on {card_name}: {step.seconds * 1e3:.1f} ms (forward {p['forward']:.1f}, backward {p['backward']:.1f}, "
        f"optimizer {p['optimizer']:.1f}, communication {p['communication']:.1f} exposed, overhead "
        f"{p['overhead']:.1f}) -> {tok} tok/s{per_gpu}, MFU {step.mfu:.2f}; {max_steps:,} steps = "
        f"{duration(step.seconds * max_steps)}",
        f"  {step.launches:,} launches ({'compiled' if compiled else 'eager'}), "
        f"CPU side {step.cpu_seconds * 1e3:.1f} ms; "
        f"the {top} most expensive kernels:",
    ]
    for k in step.kernels[:top]:
        lines.append(
            f"  {k.seconds * 1e6:>9,.0f} µs  {k.count:>4} x  {k.label} ({k.phase}): {si(k.flops, 'FLOP')}, "
            f"{si(k.bytes, 'B')}, {k.bound}"
        )
    return lines


def to_json(step: StepTime, top: int = 8) -> dict:
    """The keys --plan-json adds."""
    return {
        "step_ms": step.seconds * 1e3,
        "tok_s": step.tok_s,
        "tok_s_per_gpu": step.tok_s_per_gpu,
        "mfu": step.mfu,
        "time_parts": {k: v * 1e3 for k, v in step.parts.items()},
        "launches": step.launches,
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
            for k in step.kernels[:top]
        ],
    }
