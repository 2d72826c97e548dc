"""How long a planned step takes on a card, from the same traced step as its memory plan.

`KernelTrace` rides along with the MemoryTrace and records, per op of the step, what it asks of a
GPU (plan.flops): eager, every aten op is a launch (views free); compiled, every kernel Inductor's
lowering realizes (plan.compiled: its inlined pointwise ops cost nothing of their own, a realized
kernel reads the buffers it inlines and writes its output), plus its extern kernels (matmuls,
attention, fastpt's Triton ops). `step_time` prices each kernel on a card (gpus.Speed) and runs
them on a timeline of three clocks, one per side of the machine:

- CPU: an eager op costs EAGER_FORWARD_US from Python (the forward, the optimizer) or
  EAGER_BACKWARD_US in the autograd engine (a view VIEW_OP_US), a compiled kernel COMPILED_KERNEL_US
  of Inductor's launcher (CUDA_GRAPH_KERNEL_US under CUDA graphs) and each call of a compiled graph
  GRAPH_CALL_US; a kernel starts no earlier than its launch, so a launch-bound step is as long as
  its CPU side;
- compute stream: matmuls at FLOPs / (peak x measured share x tile and wave quantization over the
  SMs x a K ramp), attention at FLOPs / (peak x ATTENTION_SHARE), everything else at bytes /
  (bandwidth x measured copy share); each launch adds KERNEL_US;
- communication stream: a ring collective moves (N-1)/N of its bytes (twice for an all-reduce)
  over the link at COMM_EFF, plus (N-1) x RING_STEP_US; it starts when its inputs are ready, and
  the kernels reading its output wait for it. DDP's buckets (one process planned) are all-reduced
  as the syncing backward reaches them (by its FLOPs); the optimizer waits for every collective.

Muon's Newton-Schulz matmuls (the optimizer's only matmuls) are priced in the dtype they run in on
the target (fastpt.muon.ns_dtype), and a DDP plan cuts them to one rank's share and adds Muon's
all-gathers (KernelLog.with_muon). MFU is the model's FLOPs per token over the step, whatever
kernels run; HFU counts the kernels' own FLOPs.

The trace runs at most two micro-steps (planner.step_config): the first is repeated grad_accum - 1
times, the second (which syncs) once. Constants and their sources: docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from fastpt.plan.compiled import base, is_kernel, nbytes, op_name
from fastpt.plan.flops import Cost, op_cost, tensors
from fastpt.plan.gpus import Speed
from fastpt.plan.memory import MemoryTrace, storages

# The host's time per launch, each from a published measurement (docs/performance.md, "The constants")
EAGER_FORWARD_US = 9.0  # an aten op called from Python: argument parsing, dispatcher, autograd's node, the launch
EAGER_BACKWARD_US = 5.0  # an op the autograd engine runs (C++): dispatcher and cudaLaunchKernel, no Python
VIEW_OP_US = 2.0  # a view: dispatch, no kernel
COMPILED_KERNEL_US = 7.0  # Inductor's launcher (CachingAutotuner.run) for one Triton or extern kernel
GRAPH_CALL_US = 30.0  # one call of a compiled graph: guards, AOTAutograd's and Inductor's wrappers
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
    reads: tuple[int, ...] = ()  # storages, by KernelTrace's serial number (an address is reused once freed)
    writes: tuple[int, ...] = ()
    step: int = 0


class KernelTrace(TorchDispatchMode):
    """Records every op the MemoryTrace `mem` sees (entered outside it), as an Op."""

    supports_higher_order_operators = True

    def __init__(self, mem: MemoryTrace, cuda_graphs: bool = False, ns_dtype: torch.dtype | None = None):
        super().__init__()
        from torch.distributed.tensor import DTensor  # here, not at the top: ~1 s of fastpt.train's start-up

        self._dtensor = DTensor  # once per trace, not once per op
        self.mem, self.cuda_graphs, self.ns_dtype = mem, cuda_graphs, ns_dtype
        self.ops: list[Op] = []
        self._step, self._micro, self._last, self._in_optimizer, self._hooks = -1, 1, "forward", False, ()
        self._graph_calls = 0  # of mem.graph_calls, those already priced
        # Each storage's serial number: a new buffer at a freed one's address (which the allocator's
        # free lists hand out by chance, as a print between ops can change) is a new storage, not one
        # that the freed one's last writer still holds up.
        self._serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next_serial = itertools.count()

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
        phase = self._phase()
        if in_graph:
            cpu = 0.0 if cost.kind == "free" else CUDA_GRAPH_KERNEL_US if self.cuda_graphs else COMPILED_KERNEL_US
        else:
            cpu = VIEW_OP_US if cost.kind == "free" else EAGER_BACKWARD_US if phase == "backward" else EAGER_FORWARD_US
        calls, self._graph_calls = self.mem.graph_calls - self._graph_calls, self.mem.graph_calls
        if phase == "optimizer" and cost.kind == "matmul":  # no optimizer but Muon multiplies matrices
            cost, label = newton_schulz(cost, self.ns_dtype), f"Newton-Schulz: {label}"
        reads, writes = self._storages((args, kwargs)), self._storages(out)
        if cost.kind == "comm":  # in-place collectives write their output argument
            writes += reads
        host = cpu * cost.launches + calls * GRAPH_CALL_US  # a graph's wrappers run before its first op
        self.ops.append(Op(label, phase, self._micro, cost, host, reads, writes, self._step))

    def _storages(self, tree: object) -> tuple[int, ...]:
        serial = lambda st: self._serials.setdefault(st, next(self._next_serial))
        return tuple(serial(st) for t in tensors(tree) for st in storages(t))


def newton_schulz(cost: Cost, dtype: torch.dtype | None) -> Cost:
    """A Newton-Schulz matmul as it runs on the target (fastpt.muon.ns_dtype: bf16 on CUDA), where
    the CPU trace ran it in fp32: its FLOPs at that dtype's rate, its bytes at its width."""
    if dtype is None or cost.dtype is None or dtype == cost.dtype:
        return cost
    width = dtype.itemsize / cost.dtype.itemsize
    return dataclasses.replace(cost, dtype=dtype, bytes=int(cost.bytes * width))


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
    flops_per_token: float  # the model's (ModelConfig.flops_per_token: MFU's numerator), not the kernels'
    ddp_buckets: list[int] = field(default_factory=list)  # bytes, in the order the backward fills them
    muon_groups: list[tuple[int, int]] = field(default_factory=list)  # DDP: Muon's matrices (count, bytes each)
    # A deep DDP plan's shallow traces: each shape's traced count of matrices -> its count at the model's
    # depth, whose rank's share (a ceiling, no line through two depths) both traces are priced at.
    muon_depth: dict[int, int] = field(default_factory=dict)

    def sequence(self) -> list[Op]:
        """The run's whole step: the first micro-step grad_accum - 1 times, the syncing one, then the
        clipping and the optimizer."""
        micro = [[o for o in self.ops if o.micro == m and o.phase != "optimizer"] for m in (1, self.micro_steps)]
        rest = [o for o in self.ops if o.micro > self.micro_steps or o.phase == "optimizer"]
        for o in rest:  # the clipping after the last backward belongs with the optimizer
            o.phase = "optimizer"
        last = self.with_ddp(micro[1])
        barrier = Op("wait for the collectives", "backward", 0, Cost("barrier"), 0.0)
        return micro[0] * (self.grad_accum - 1) + last + [barrier] + self.with_muon(rest)

    def with_muon(self, ops: list[Op]) -> list[Op]:
        """A DDP plan's Muon on one of N ranks (the trace ran one process, which orthogonalizes every
        matrix): each shape's Newton-Schulz batch of n matrices cut to the rank's ceil(n / N), then one
        all-gather per shape of N shares, which the parameters' update waits for (fastpt.muon)."""
        if self.world_size == 1 or not self.muon_groups:
            return ops
        at_depth = lambda n: self.muon_depth.get(n, n)
        out = [mine(op, self.world_size, at_depth) if op.label.startswith("Newton-Schulz") else op for op in ops]
        last = max(i for i, op in enumerate(out) if op.label.startswith("Newton-Schulz"))
        done = out[last].writes  # the gathers start once Newton-Schulz is done (its last batch's output)
        gathers = [
            Op(
                "Muon all-gather",
                "optimizer",
                0,
                Cost("comm", comm="all-gather", comm_bytes=nbytes * ranks),
                EAGER_FORWARD_US,
                done,
            )
            for n, nbytes in self.muon_groups
            for ranks in [-(-at_depth(n) // self.world_size) * self.world_size]
        ]
        barrier = Op("wait for Muon's all-gathers", "optimizer", 0, Cost("barrier"), 0.0)
        return out[: last + 1] + gathers + [barrier] + out[last + 1 :]

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
                out.append(Op("DDP bucket copy", "backward", op.micro, Cost("memory", 2 * n), EAGER_BACKWARD_US))
                out.append(
                    Op(
                        "DDP all-reduce",
                        "backward",
                        op.micro,
                        Cost("comm", comm="all-reduce", comm_bytes=2 * n),
                        EAGER_BACKWARD_US,
                    )
                )
        return out


def mine(op: Op, world_size: int, at_depth: Callable[[int], int] = lambda n: n) -> Op:
    """A batched Newton-Schulz matmul of n matrices cut to one rank's ceil(n / world_size), n the
    batch's count at the model's depth (at_depth: a shallow trace's batch holds fewer)."""
    ((m, n, k, batch),) = op.cost.matmuls
    share = -(-at_depth(batch) // world_size)
    cost = dataclasses.replace(
        op.cost, matmuls=[(m, n, k, share)], flops=op.cost.flops * share / batch, bytes=op.cost.bytes * share // batch
    )
    return dataclasses.replace(op, cost=cost)


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
    mfu: float  # the model's FLOPs per token (ModelConfig.flops_per_token) x tokens / time / bf16 peak
    hfu: float  # every matmul and attention FLOP the kernels do (recompute, Newton-Schulz included) / time / peak
    launches: int
    cpu_seconds: float
    bound: str  # the clock with the most work, which the others wait for: CPU | GPU | communication
    kernels: list[Kernel]
    work: dict[str, float] = field(default_factory=dict)  # seconds of work per clock (CPU, GPU, communication)

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
    peak = peak_flops(speed, torch.bfloat16) * total
    mfu = log.flops_per_token * log.tokens / log.world_size / peak
    hfu = sum(op.cost.flops for op in ops) / peak
    launches = sum(op.cost.launches for op in ops if op.cost.kind not in ("free", "sync", "barrier"))
    kernels = top_kernels(ops, priced)
    # the clock with the most work bounds the step: the others wait for it (the stream idles for a
    # CPU that launches too slowly: `overhead`; the optimizer for collectives: `communication`)
    work = {
        "CPU": cpu,
        "GPU": sum(busy.values()),
        "communication": sum(t for op, t in zip(ops, seconds) if op.cost.kind == "comm"),
    }
    bound = max(work, key=work.get)
    return StepTime(total, parts, log.tokens, log.world_size, mfu, hfu, launches, cpu, bound, kernels, work)


def extrapolated(a: StepTime, b: StepTime, k: float) -> StepTime:
    """The step k times as far past a as b is (the same run with more blocks, plan.planner.extrapolated):
    its time, parts, launches, each clock's work and each kernel's count and time on the line through
    a's and b's, MFU and HFU from their FLOPs' lines. A kernel only b has (one whose shape grows with
    the depth, as Muon's batch of a shape's matrices) is b's."""
    line = lambda x, y: x + (y - x) * k
    seconds = line(a.seconds, b.seconds)
    work = {c: line(a.work[c], b.work[c]) for c in b.work}
    kernels = []
    for kb in b.kernels:
        ka = next((x for x in a.kernels if (x.label, x.phase) == (kb.label, kb.phase)), None)
        count, t = (round(line(ka.count, kb.count)), line(ka.seconds, kb.seconds)) if ka else (kb.count, kb.seconds)
        kernels.append(dataclasses.replace(kb, count=count, seconds=t))
    return StepTime(
        seconds,
        {p: line(a.parts[p], b.parts[p]) for p in b.parts},
        b.tokens,
        b.world_size,
        line(a.mfu * a.seconds, b.mfu * b.seconds) / seconds,
        line(a.hfu * a.seconds, b.hfu * b.seconds) / seconds,
        round(line(a.launches, b.launches)),
        line(a.cpu_seconds, b.cpu_seconds),
        max(work, key=work.get),
        sorted(kernels, key=lambda kernel: -kernel.seconds),
        work,
    )


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
