"""Where a step's memory goes: every storage's life recorded by a dispatch mode, and a replay of
PyTorch's CUDA caching allocator over those lives.

`MemoryTrace` is a TorchDispatchMode (the method of torch.distributed._tools.mem_tracker): each op's
new output storages are recorded with their size, the op and the phase that made them (forward,
backward, optimizer) and a weak reference whose callback records when the storage dies. Nothing
is categorized while the step runs; after it, `at(event)` sorts the storages alive at any moment
into parameters, gradients, optimizer state, activations kept for the backward (made in a forward
and still alive when its backward starts) and transients. Over fake tensors it measures a step that
never allocates a byte. It also follows what no mode sees: storages resized in place (FSDP frees
and refills its unsharded parameters so), and leaves out DTensor's shape inference.

`CachingAllocator` replays those lives through the CUDA caching allocator's block rules (sizes
rounded to 512 B; requests up to 1 MiB from 2 MiB segments, up to 10 MiB from 20 MiB segments,
larger ones from their own rounded to 2 MiB; best fit; a block split only when the rest is worth
keeping; neighbours merged on free): what `torch.cuda.max_memory_allocated` and
`max_memory_reserved` would report. One stream, no cache release: a reserve that the real
allocator, short of memory, would first try to free.
"""

from __future__ import annotations

import bisect
import math
import re
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from fastpt.plan import torch_internals

ALIVE = math.inf
MIN_BLOCK = 512  # the caching allocator's rounding
SMALL_REQUEST = 2**20  # up to this from the small pool
SMALL_SEGMENT = 2 * 2**20
LARGE_SEGMENT = 20 * 2**20  # for requests up to MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * 2**20
ROUND_LARGE = 2 * 2**20

PARTS = ("parameters", "gradients", "optimizer state", "activations", "transient")
STEP_PHASES = ("forward", "backward", "optimizer")  # a storage's phase: these, or before (it existed) or scratch


@dataclass(eq=False, slots=True)
class Life:
    """One storage (or one op's scratch) from birth to death, in trace events."""

    nbytes: int
    born: int
    op: str
    shape: tuple[int, ...]
    phase: str  # before (existed when tracing began), forward, backward, optimizer, scratch
    dtype: torch.dtype | None = None
    died: float = ALIVE
    kind: str = ""  # parameters, gradients, optimizer state: labelled after the step
    ref: weakref.ref | None = None

    def alive_at(self, event: int) -> bool:
        return self.born <= event < self.died


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages under a tensor: its own, or those of the tensors a wrapper subclass holds."""
    if not is_traceable_wrapper_subclass(t):
        return [t.untyped_storage()]
    return [st for name in t.__tensor_flatten__()[0] for st in storages(getattr(t, name))]


def cuda_rounded(nbytes: int) -> int:
    """What the CUDA caching allocator hands out for a request: 512 B multiples (0 stays 0)."""
    return 0 if nbytes == 0 else max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


# Ops whose kernels allocate scratch memory inside, which their fake implementation cannot show:
# a function of (args, outputs) -> bytes held while the op runs, on top of its outputs.
Scratch = Callable[[tuple, object], int]


class MemoryTrace(TorchDispatchMode):
    """Records every storage the ops inside it create (see the module docstring). `round_to`
    maps a request to the bytes the allocator holds for it; `scratch` maps ops to a Scratch;
    `labels` maps ops to what they tell of their tensors: (args, kwargs, out) -> [(tensor, kind)]."""

    def __init__(self, round_to: Callable[[int], int] = int, scratch: dict | None = None, labels: dict | None = None):
        super().__init__()
        from torch.distributed.tensor import DTensor  # here, not at the top: ~1 s of fastpt.train's start-up

        self._dtensor = DTensor  # once per trace, not once per op
        self.round_to, self.scratch, self.labels = round_to, scratch or {}, labels or {}
        self.lives: list[Life] = []
        self.by_storage: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.event = 0
        self.backward_starts: list[int] = []  # the event at which each backward began
        self.steps: list[int] = []  # the event at which each step began
        self._phase, self._in_optimizer, self._hooks = "forward", False, ()
        self.fusing = False  # the current op's outputs live inside a fused kernel: no memory of their own
        self.paused = 0  # inside DTensor's shape propagation
        self.graph_calls = 0  # compiled graphs run so far (plan.compiled), for plan.timing's host clock

    supports_higher_order_operators = True  # a compiled graph's run_and_save_rng_state runs an op inside

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # off while torch.compile traces, on while its graphs run

    def __enter__(self) -> MemoryTrace:
        self._hooks = (
            register_optimizer_step_pre_hook(lambda *_: setattr(self, "_in_optimizer", True)),
            register_optimizer_step_post_hook(lambda *_: setattr(self, "_in_optimizer", False)),
        )
        # DTensor works out each new op's output shape by running it on global-shape fake tensors:
        # those are not memory.
        self._unpause = torch_internals.pause_in_sharding_propagation(lambda: _Paused(self))
        # FSDP frees and refills its unsharded parameters' storages with resize_, which no mode sees.
        resize = self._resize = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int):
            out = resize(st, size)
            self._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc) -> None:

        for hook in self._hooks:
            hook.remove()
        self._unpause()
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)

    def _resized(self, st: torch.UntypedStorage) -> None:
        """A recorded storage resized: its life ends, and a new one starts at its new size."""
        life = self.by_storage.get(st)
        held = life.nbytes if life is not None and life.died == ALIVE else 0
        if life is None or self.paused or held == self.round_to(st.nbytes()):
            return
        if held:
            life.died = self.event
            self.event += 1
        if st.nbytes():
            self._birth(st, life.shape, life.dtype, self._current_phase(), "resize_").kind = life.kind

    def add(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """Record tensors that exist already (parameters, buffers) as `kind`."""
        for t in tensors:
            for life in self._lives_of(t, "before", "", create=True):
                life.kind = life.kind or kind

    def label(self, tensors: Iterable[torch.Tensor | None], kind: str) -> None:
        """Name what these (recorded) tensors are: gradients, optimizer state."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for life in self._lives_of(t, "", "", create=False):
                    life.kind = kind

    def begin_step(self) -> None:
        self.steps.append(self.event)

    def _lives_of(self, t: torch.Tensor, phase: str, op: str, create: bool) -> list[Life]:
        t = t.to_local() if isinstance(t, self._dtensor) else t
        lives = []
        for st in storages(t):
            life = self.by_storage.get(st)
            if life is None and create:
                life = self._birth(st, tuple(t.shape), t.dtype, phase, op)
            if life is not None:
                lives.append(life)
        return lives

    def _birth(self, st: torch.UntypedStorage, shape: tuple, dtype: torch.dtype | None, phase: str, op: str) -> Life:
        nbytes = 0 if self.fusing else self.round_to(st.nbytes())
        life = Life(nbytes, self.event, op, shape, phase, dtype)
        life.ref = weakref.ref(st, lambda _, life=life: self._death(life))
        self.by_storage[st] = life
        self.lives.append(life)
        self.event += 1
        return life

    def _death(self, life: Life) -> None:
        life.died = min(life.died, self.event)  # a compiled graph may have handed its memory on earlier
        self.event += 1

    def _current_phase(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        if torch_internals.in_backward():
            if self._phase != "backward":
                self.backward_starts.append(self.event)
            self._phase = "backward"
        else:
            self._phase = "forward"
        return self._phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is self._dtensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which are the real allocations
        if func is torch.ops._c10d_functional.wait_tensor.default:
            out = args[0]  # its fake returns a new tensor; on a device it waits in place
        else:
            out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        phase, name = self._current_phase(), str(func)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._lives_of(t, phase, name, create=True)
        for t, kind in self.labels[func](args, kwargs or {}, out) if func in self.labels else ():
            self.label([t], kind)
        if (scratch := self.scratch.get(func)) and (nbytes := self.round_to(scratch(args, out))):
            self.lives.append(Life(nbytes, self.event, f"{name} (scratch)", (), "scratch", died=self.event + 1))
            self.event += 2
        return out

    def lives_of(self, t: object) -> list[Life]:
        """The recorded lives of a value's storages (none for a non-tensor)."""
        return self._lives_of(t, "", "", create=False) if isinstance(t, torch.Tensor) else []

    # ---- after the step

    def kept(self, life: Life) -> bool:
        """Made in a forward and still alive when that forward's backward began."""
        if life.phase != "forward":
            return False
        start = bisect.bisect_right(self.backward_starts, life.born)
        return start < len(self.backward_starts) and life.died > self.backward_starts[start]

    def part(self, life: Life) -> str:
        return life.kind or ("activations" if self.kept(life) else "transient")

    def at(self, event: int) -> Snapshot:
        """What was alive at `event`, by part, and the largest transient then."""
        alive = [life for life in self.lives if life.alive_at(event)]
        parts = dict.fromkeys(PARTS, 0)
        for life in alive:
            parts[self.part(life)] = parts.get(self.part(life), 0) + life.nbytes
        transients = [life for life in alive if self.part(life) == "transient"]
        largest = max(transients, key=lambda life: life.nbytes, default=None)
        return Snapshot(event, parts, largest, self.where(event))

    def where(self, event: int, phase: str = "") -> str:
        """'step 2, micro-step 3, backward' (or 'step 2, optimizer'): the moment of `event` (whose
        phase, when known, is `phase`)."""
        step = bisect.bisect_right(self.steps, event)
        phase = phase or self._phase_at(event)
        if phase == "optimizer":
            return f"step {step}, optimizer"
        in_step = [s for s in self.backward_starts if s <= event and (step == 0 or s >= self.steps[step - 1])]
        return f"step {step}, micro-step {len(in_step) + (phase == 'forward')}, {phase}"

    def moments(self) -> list[tuple[int, str]]:
        """Where the moment `where` names may change, in time order: (first event, its phase) at each
        step's start, each backward's start and each change of phase among the storages made."""
        changes: list[tuple[int, str]] = []  # (event, phase): where the phase of the storages made changes
        for life in sorted(self.lives, key=lambda life: life.born):
            if life.phase in STEP_PHASES and (not changes or life.phase != changes[-1][1]):
                changes.append((life.born, life.phase))
        events = [event for event, _ in changes]
        starts = sorted({0, *self.steps, *self.backward_starts, *events})
        at = [bisect.bisect_right(events, event) - 1 for event in starts]
        return [(event, changes[i][1] if i >= 0 else "forward") for event, i in zip(starts, at, strict=True)]

    def _phase_at(self, event: int) -> str:
        """The phase of the last storage made by then (scratch and the tensors from before aside)."""
        phases = (life.phase for life in reversed(self.lives) if life.born <= event)
        return next((p for p in phases if p in STEP_PHASES), "forward")


class _Paused:
    """A reentrant context manager: the trace records nothing inside it."""

    def __init__(self, trace: MemoryTrace):
        self.trace = trace

    def __enter__(self) -> None:
        self.trace.paused += 1

    def __exit__(self, *exc) -> None:
        self.trace.paused -= 1


def active_trace() -> MemoryTrace | None:
    """The MemoryTrace recording now (the innermost), if any."""
    return next((m for m in reversed(torch_internals.dispatch_mode_stack()) if isinstance(m, MemoryTrace)), None)


@dataclass
class Snapshot:
    event: int
    parts: dict[str, int]
    largest: Life | None  # the largest transient alive
    where: str


@dataclass
class Peak:
    """A traced step's peak and what was alive then."""

    bytes: int  # what torch.cuda.max_memory_allocated would report (CPU: the allocator's peak)
    parts: dict[str, int]  # parameters, gradients, optimizer state, activations, transient, ...
    blocks: int  # the caching allocator's blocks beyond the requests
    largest: tuple[int, str, tuple[int, ...]] | None  # the largest transient: bytes, op, shape
    where: str  # 'step 2, micro-step 2, backward'
    reserved: int  # max_memory_reserved (0 on a CPU)


@dataclass(eq=False, slots=True)
class Block:
    addr: int
    size: int
    segment: int
    free: bool = True
    prev: Block | None = None
    next: Block | None = None


@dataclass
class CachingAllocator:
    """The CUDA caching allocator's block rules (module docstring), on one stream."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    pools: dict[bool, list[tuple[int, int, Block]]] = field(default_factory=lambda: {True: [], False: []})
    _top: int = 0  # the next segment's address
    _segments: int = 0

    def malloc(self, nbytes: int) -> Block:
        size, small = cuda_rounded(nbytes), nbytes <= SMALL_REQUEST
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            block = self._new_segment(size, small)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_REQUEST:
            tail = Block(block.addr + size, rest, block.segment, True, block, block.next)
            if block.next:
                block.next.prev = tail
            block.next, block.size = tail, size
            bisect.insort(pool, (tail.size, tail.addr, tail))
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def _new_segment(self, size: int, small: bool) -> Block:
        if small:
            segment = SMALL_SEGMENT
        elif size < MIN_LARGE_ALLOC:
            segment = LARGE_SEGMENT
        else:
            segment = -(-size // ROUND_LARGE) * ROUND_LARGE
        self._segments += 1
        block = Block(self._top, segment, self._segments)
        self._top += segment
        self.reserved += segment
        return block

    def free(self, block: Block, small: bool) -> None:
        self.allocated -= block.size
        block.free = True
        pool = self.pools[small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                pool.remove((neighbour.size, neighbour.addr, neighbour))
                block = self._merge(block, neighbour)
        bisect.insort(pool, (block.size, block.addr, block))

    @staticmethod
    def _merge(block: Block, neighbour: Block) -> Block:
        first, second = (neighbour, block) if neighbour.addr < block.addr else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next:
            second.next.prev = first
        return first


@dataclass
class Replay:
    peak_allocated: int  # max_memory_allocated
    peak_event: int  # the first event at which it was reached
    peak_reserved: int  # max_memory_reserved
    totals: list[tuple[int, int]] = field(default_factory=list)  # (event, memory_allocated) after each malloc


def sweep(lives: list[Life]) -> tuple[int, int]:
    """The most bytes alive at once, and the first event at which they were (no allocator)."""
    return running_peak(deltas(lives))


def deltas(lives: list[Life]) -> list[tuple[float, int]]:
    """Every life's birth (+bytes) and death (-bytes), by event."""
    return [(life.born, life.nbytes) for life in lives] + [(life.died, -life.nbytes) for life in lives]


def running_totals(deltas: Iterable[tuple[float, int]]) -> Iterator[tuple[float, int]]:
    """(time, the running total after it) of (time, bytes allocated or, negative, freed), taken in
    time order (at one time, frees first)."""
    live = 0
    for event, delta in sorted(deltas):
        live += delta
        yield event, live


def running_peak(deltas: Iterable[tuple[float, int]]) -> tuple[int, float]:
    """The highest running total (running_totals), and the time it was first reached."""
    peak = peak_event = 0
    for event, live in running_totals(deltas):
        if live > peak:
            peak, peak_event = live, event
    return peak, peak_event


def span_peaks(totals: Iterable[tuple[float, int]], starts: list[int]) -> dict[int, tuple[int, float]]:
    """The highest running total in each span between `starts` (sorted events; span i begins at
    starts[i]), and the first time it was reached there: {i: (bytes, time)}."""
    best: dict[int, tuple[int, float]] = {}
    for event, live in totals:
        i = bisect.bisect_right(starts, event) - 1
        if live > best.get(i, (-1, 0))[0]:
            best[i] = (live, event)
    return best


def replay(lives: list[Life]) -> Replay:
    """Every life's malloc and free, in trace order, through the caching allocator."""
    events = sorted(
        [(life.born, 1, i) for i, life in enumerate(lives) if life.nbytes]
        + [(life.died, 0, i) for i, life in enumerate(lives) if life.nbytes and life.died != ALIVE]
    )
    allocator, blocks, totals = CachingAllocator(), {}, []
    peak, peak_event = -1, 0
    for event, is_malloc, i in events:
        nbytes = lives[i].nbytes
        if is_malloc:
            blocks[i] = allocator.malloc(nbytes)
            totals.append((event, allocator.allocated))
            if allocator.allocated > peak:
                peak, peak_event = allocator.allocated, event
        else:
            allocator.free(blocks.pop(i), nbytes <= SMALL_REQUEST)
    return Replay(max(peak, 0), peak_event, allocator.reserved, totals)


# ---- a traced step's peak


def peak_of(mem: MemoryTrace, target: str, micro_steps: int) -> Peak:
    """The peak (on CUDA through the caching allocator's replay) and what was alive then."""
    if target == "cuda":
        allocator = replay(mem.lives)
        peak, event, reserved = allocator.peak_allocated, allocator.peak_event, allocator.peak_reserved
    else:
        (peak, event), reserved = sweep(mem.lives), 0
    return snapshot(mem, peak, event, reserved, micro_steps)


def moment_peaks(mem: MemoryTrace, target: str, micro_steps: int) -> dict[str, Peak]:
    """The highest allocation at each moment of the step (mem.where: step, micro-step, phase) and
    what was alive then; the step's peak (peak_of) is the highest, the first of equals."""
    if target == "cuda":
        allocator = replay(mem.lives)
        totals, reserved = allocator.totals, allocator.peak_reserved
    else:
        totals, reserved = running_totals(deltas(mem.lives)), 0
    moments = mem.moments()
    best: dict[str, tuple[int, float]] = {}
    for i, (nbytes, event) in sorted(span_peaks(totals, [start for start, _ in moments]).items()):
        where = clip_phase(mem.where(event, moments[i][1]), micro_steps)
        if nbytes > best.get(where, (-1, 0))[0]:
            best[where] = (nbytes, event)
    return {where: snapshot(mem, nbytes, event, reserved, micro_steps) for where, (nbytes, event) in best.items()}


def snapshot(mem: MemoryTrace, peak: int, event: float, reserved: int, micro_steps: int) -> Peak:
    """The Peak of `peak` bytes allocated at `event`: what was alive then, by part."""
    snap = mem.at(event)
    largest = snap.largest and (snap.largest.nbytes, snap.largest.op, snap.largest.shape)
    blocks = peak - sum(snap.parts.values())
    return Peak(peak, snap.parts, blocks, largest, clip_phase(snap.where, micro_steps), reserved)


def clip_phase(where: str, micro_steps: int) -> str:
    """A 'forward' after the last micro-step's backward is the clipping and loss reduction."""
    m = re.search(r"micro-step (\d+), forward", where)
    if m and int(m[1]) > micro_steps:
        return where[: m.start()] + "after the backward (clipping)"
    return where
