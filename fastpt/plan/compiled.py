"""The memory of an Inductor-compiled step, on fake tensors: torch.compile with Inductor's own
decompositions, joint-graph passes and min-cut partitioner (so the activations kept for the backward
are those Inductor keeps), its code generation replaced by running the partitioned graphs op by op
in a memory.MemoryTrace, with three rules of Inductor's that decide what its code allocates:

- inlining (its lowering's realize rules, config.py there): a pointwise value read only by other
  pointwise ops and reductions is computed inside their kernels and never stored, unless several ops
  read it and it reads many buffers or inlines many ops (on a CPU also: one with exp, log, sigmoid);
- in-place kernels: a kernel writes its output over an input of the same size and dtype that dies
  there (a saved activation in the backward included, never a parameter);
- buffer reuse: a freed buffer is kept for the next allocation of its size and dtype, which takes it
  (so it stays allocated until then).

Not modelled: the scheduler's further fusions and reordering; the expected error is a few percent
of the peak (measured on CPU against the real compiled step, README "Memory planning").
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from fastpt.plan.memory import Life, MemoryTrace, active_trace
from fastpt.plan.torch_internals import realize_thresholds

HEAVY_OPS = {"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"}  # on a CPU, stored when read by several
FUSED_PRODUCERS = {"full", "scalar_tensor", "iota", "gather", "cat"}  # computed inside their readers too
EXTERN_WITH_OUT = {"mm", "addmm", "bmm", "baddbmm"}  # extern kernels writing into buffers Inductor allocates


def op_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    returns = schema.returns if schema else ()
    return bool(returns and returns[0].alias_info and not returns[0].alias_info.is_write)


def inlinable(node: torch.fx.Node) -> bool:
    """Ops Inductor can compute inside their readers' kernels: pointwise math, casts, constants, gathers."""
    return node.op == "call_function" and (
        torch.Tag.pointwise in getattr(node.target, "tags", ()) or op_name(node) in FUSED_PRODUCERS
    )


def is_kernel(node: torch.fx.Node) -> bool:
    """A value Inductor's own code computes (and allocates): pointwise ops and reductions."""
    return inlinable(node) or torch.Tag.reduction in getattr(node.target, "tags", ())


def readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ops that read node, through views."""
    out = []
    for user in node.users:
        out += readers(user) if is_view(user) else [user]
    return out


def base(node: object) -> object:
    """The value a chain of views reads."""
    while isinstance(node, torch.fx.Node) and is_view(node):
        node = node.args[0]
    return node


def nbytes(node: torch.fx.Node) -> tuple[int, torch.dtype] | None:
    val = node.meta.get("val")
    return (val.numel() * val.element_size(), val.dtype) if isinstance(val, torch.Tensor) else None


class Lowering:
    """What Inductor's code for one partitioned graph allocates, decided from the graph alone."""

    def __init__(self, gm: torch.fx.GraphModule, target: str, backward: bool):
        self.thresholds = realize_thresholds(target)
        self.fused: set[torch.fx.Node] = set()
        self.inplace: dict[torch.fx.Node, torch.fx.Node] = {}  # output -> the input it overwrites
        self.reads: dict[torch.fx.Node, set] = {}
        ops: dict[torch.fx.Node, int] = {}
        heavy: dict[torch.fx.Node, bool] = {}
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        for node in gm.graph.nodes:
            if not is_kernel(node):
                continue
            inputs = [base(a) for a in node.all_input_nodes]
            inner = [a for a in inputs if a in self.fused]
            ops[node] = 1 + sum(ops[a] for a in inner)
            self.reads[node] = set().union(*(self.reads[a] for a in inner), (a for a in inputs if a not in self.fused))
            heavy[node] = op_name(node) in HEAVY_OPS or any(heavy[a] for a in inner)
            if inlinable(node) and self._inlined(node, ops[node], heavy[node], target):
                self.fused.add(node)
        for node in self.reads:
            if node not in self.fused:
                victim = self._overwritable(node, order, backward)
                if victim is not None:
                    self.inplace[node] = victim

    def _inlined(self, node: torch.fx.Node, ops: int, heavy: bool, target: str) -> bool:
        """Inductor's realize rules (ir.py's should_realize_on_reuse, has_exceeded_max_reads) with
        its config's thresholds for the target (torch_internals.realize_thresholds)."""
        reads = len(self.reads[node])
        max_reads, max_acc_reads, max_ops = self.thresholds
        reused = len(node.users) > 1 and ((target == "cpu" and heavy) or ops > max_ops or reads > max_reads)
        too_big = reads > max_acc_reads or ops > max_ops
        return bool(node.users) and all(is_kernel(r) for r in readers(node)) and not reused and not too_big

    def _overwritable(self, node: torch.fx.Node, order: dict, backward: bool) -> torch.fx.Node | None:
        """The first input, in graph order, that the kernel computing node reads last, of its size and
        dtype: a value of this graph or, in a backward, a saved activation (donated to it); never a
        parameter or a gradient input. Graph order keeps the choice the same in every process."""
        size = nbytes(node)
        for read in sorted(self.reads[node], key=lambda r: order.get(r, -1)):
            if not isinstance(read, torch.fx.Node) or nbytes(read) != size:
                continue
            if read.op == "placeholder" and not (backward and not read.name.startswith(("primals", "tangents"))):
                continue
            if read.op != "placeholder" and not is_kernel(read):
                continue
            others = [r for r in readers(read) if r is not node]
            if all(r in self.fused and order[r] < order[node] for r in others):  # it dies in this kernel
                return read
        return None

    def allocates(self, node: torch.fx.Node) -> bool:
        """Whether Inductor's code allocates node's buffer itself (and may reuse a freed one for it)."""
        return node not in self.fused and (is_kernel(node) or op_name(node) in EXTERN_WITH_OUT)


class LoweredGraph(torch.fx.Interpreter):
    """Runs a partitioned graph op by op as Inductor's code would hold memory: each value freed after
    its last use and the inputs as soon as they are consumed (boxed), inlined values taking none,
    in-place kernels and reused buffers handing their memory on (module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, lowering: Lowering):
        super().__init__(gm)
        self.lowering = lowering
        self.pool: dict[
            tuple, list[Life]
        ] = {}  # buffers this graph allocated, by size and dtype, to hand on once freed

    def run_node(self, n: torch.fx.Node):
        trace = active_trace()
        if trace is None:
            return super().run_node(n)
        trace.lowered = (self.lowering, n)  # for plan.timing: the node whose ops run now
        if n in self.lowering.fused:
            trace.fusing = True
            try:
                return super().run_node(n)
            finally:
                trace.fusing = False
        before = trace.event
        out = super().run_node(n)
        if self.lowering.allocates(n):
            for life in trace.lives_of(out):
                if life.born >= before:
                    self._hand_on(trace, n, life)
        return out

    def _hand_on(self, trace: MemoryTrace, n: torch.fx.Node, life: Life) -> None:
        """The memory life takes: the input it overwrites, else a freed buffer of its size and dtype."""
        victim = self.lowering.inplace.get(n)
        lives = trace.lives_of(self.env.get(victim)) if victim is not None else []
        if lives and lives[0].nbytes == life.nbytes:
            lives[0].died = min(lives[0].died, life.born)
        else:
            same = self.pool.get((life.nbytes, life.dtype), [])
            free = [old for old in same if old.died <= life.born]
            if free:
                old = max(free, key=lambda old: old.died)  # the most recently freed, as Inductor's pool pops
                same.remove(old)
                old.died = life.born
        if n not in self.output_nodes:
            self.pool.setdefault((life.nbytes, life.dtype), []).append(life)

    @functools.cached_property
    def output_nodes(self) -> set[torch.fx.Node]:
        output = next(node for node in reversed(self.graph.nodes) if node.op == "output")
        return {base(a) for a in output.all_input_nodes}


def run_graph(gm: torch.fx.GraphModule, example_inputs, target: str = "cuda", is_backward: bool = False, **kwargs):
    """Inductor's inner compiler, replaced: the graph runs as a LoweredGraph."""
    lowering = Lowering(gm, target, is_backward)

    def run(args: list):
        trace = active_trace()
        if trace is not None:
            trace.graph_calls += 1
        return LoweredGraph(gm, lowering).boxed_run(args)

    run._boxed_call = True
    return run


def planning_backend(gm: torch.fx.GraphModule, example_inputs, target: str = "cuda"):
    """A torch.compile backend: Inductor up to its code generation, then run_graph."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=functools.partial(run_graph, target=target))


@functools.cache
def backend_for(target: str):
    """One backend object per target: torch.compile recompiles a module whose backend is another object."""
    return functools.partial(planning_backend, target=target)


def recompile_for_plan(model: torch.nn.Module, target: str) -> None:
    """Every submodule the run compiles (module.compile), compiled with planning_backend instead."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module.compile(backend=backend_for(target), dynamic=False)


@contextlib.contextmanager
def compiling_for_plan() -> Iterator[None]:
    """Inductor's and AOTAutograd's caches off (their entries would hold the planning graphs); the
    compiled code forgotten afterwards."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        try:
            yield
        finally:
            torch._dynamo.reset()
