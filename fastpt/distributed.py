"""torchrun integration: the process group from the environment, the model compiled and put under
DDP or FSDP2, and the cross-rank reductions the loop needs. (Checkpoints of either layout:
checkpoint.py, checkpointer.py.)"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from fastpt import cores
from fastpt.errors import FastptError, fail

# A collective that waits longer than this for a rank fails instead of hanging (torch's default is
# 30 minutes for gloo, and NCCL's watchdog may never fire on a peer that is gone); long enough for
# the other ranks to compile or write a checkpoint. FASTPT_COLLECTIVE_TIMEOUT (seconds) overrides it.
COLLECTIVE_TIMEOUT_S = 600


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    peers: list = field(default_factory=list)  # (hostname, pid) of every rank, to name one that dies
    store: object = field(default=None, repr=False)  # torchrun's rendezvous store (connect), None for one process

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, kind: str) -> torch.device:
        """This rank's device of that kind ("cuda" or "cpu")."""
        return torch.device(f"cuda:{self.local_rank}" if kind == "cuda" else "cpu")


ONE_PROCESS = Dist()  # a plain run's: nothing to reduce or sync


def cpu_threads(requested: int) -> int:
    """torch's CPU threads for this process: `requested`, or for 0 the cores not busy now (the whole
    cores the 1-minute load average keeps busy taken away), shared by torchrun's local ranks. torch's
    own default (every core) oversubscribes a busy machine: the README's first run took 3x longer
    with it than with one thread on a 2-core machine at load 2; on the same machine at load 0.7 two
    threads were 1.45x faster than one, so a partly busy core still counts as free. An
    OMP_NUM_THREADS in the environment is a choice already made: torch's count, which follows it.
    A `requested` count is capped at the cores (threads_capped says so)."""
    if requested:
        return min(requested, cores.all_cores())
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    busy = int(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, (cores.all_cores() - busy) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def threads_capped(requested: int) -> str:
    """The line for a --threads beyond the cores this process may use, which cpu_threads caps it at
    (5,000 threads starved a 2-core machine; 100,000 crashed torch), else ''."""
    if requested <= (usable := cores.all_cores()):
        return ""
    plural = "s" if usable > 1 else ""
    return (
        f"fastpt: warning: --threads {requested} is more than the {usable} core{plural} this process may use: "
        f"using {usable}"
    )


def param_dtype(d: Dist, parallel: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the parameters compute in, and so the activations between autocast's ops: bf16
    where FSDP shards a bf16 run (its mixed-precision policy casts them, `shard`), else fp32."""
    return torch.bfloat16 if d.enabled and parallel == "fsdp" and dtype == torch.bfloat16 else torch.float32


def one_process_warning(parallel: str, d: Dist) -> str:
    """The line a run that asked for --parallel fsdp but runs as one process gets (no torchrun, or
    torchrun with one: it trains unsharded, which a user may not expect), else ''."""
    if parallel != "fsdp" or d.enabled:
        return ""
    return (
        "fastpt: warning: --parallel fsdp shards over torchrun's processes (torchrun --nproc-per-node N, N >= 2); "
        "this run is one process, unsharded"
    )


def connect(device_type: str) -> Dist:
    """This process's place in the torchrun group before the group exists: its rank and device, and
    the rendezvous store every rank shares (`share`), so that the ranks can agree (on the kernels'
    check) before --micro-batch auto plans, which must come before the process group (its plan
    builds a fake one). A plain run is world size 1, with no store."""
    if device_type == "cuda":  # fp32 matmuls outside autocast (and --dtype fp32) use TF32 tensor cores
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if "RANK" not in os.environ:
        return Dist()
    d = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    if device_type == "cuda":
        torch.cuda.set_device(d.local_rank)
    store, _, _ = next(dist.rendezvous("env://", rank=d.rank, world_size=d.world_size, timeout=_timeout()))
    # The store's keys of an attempt torchrun restarted must not meet the dead attempt's (a rank that
    # read its peer's old address would fail to connect to it): one key prefix per attempt.
    d.store = dist.PrefixStore(f"fastpt/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    return d


def setup(d: Dist, device_type: str) -> Dist:
    """Join the torchrun process group of `connect`'s `d` (nccl on CUDA, gloo on CPU)."""
    if not d.enabled:
        return d
    dist.init_process_group(
        backend="nccl" if device_type == "cuda" else "gloo",
        store=d.store,
        rank=d.rank,
        world_size=d.world_size,
        timeout=_timeout(),
    )
    d.peers = [None] * d.world_size
    dist.all_gather_object(d.peers, (socket.gethostname(), os.getpid()))
    return d


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("FASTPT_COLLECTIVE_TIMEOUT", COLLECTIVE_TIMEOUT_S)))


def share(value: str, key: str, d: Dist) -> list[str]:
    """Every rank's `value`, on every rank, in rank order, through the rendezvous store (no process
    group needed): a rank that does not come within the collective timeout fails it."""
    if not d.enabled:
        return [value]
    from torch.distributed.elastic.utils.store import synchronize  # one multi-get; rank 0 (the store) leaves last

    got = synchronize(d.store, value.encode(), d.rank, d.world_size, f"{key}/", _timeout().total_seconds())
    return [v.decode() for v in got]


def _state(host: str, pid: int) -> str | None:
    """The process's state letter in /proc ('R', 'S', 'T' stopped, 't' stopped by a debugger, 'Z'
    a zombie), 'X' when it is gone; None when it runs on another machine."""
    if host != socket.gethostname():
        return None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def lost_ranks(d: Dist) -> list[str]:
    """The other ranks on this machine that are dead or stopped, each as a phrase for the error line.
    A rank stopped by a signal (SIGSTOP, a frozen process) is SIGKILLed: it would never end by itself,
    and torchrun would wait its shutdown timeout (30 s) for it before it restarts the group. One
    stopped by a debugger ('t') is left alone."""
    lost = []
    for r, (host, pid) in enumerate(d.peers):
        state = None if r == d.rank else _state(host, pid)
        if state in ("Z", "X"):
            lost.append(f"rank {r} (pid {pid} on {host}) died")
        elif state == "T":
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            lost.append(f"rank {r} (pid {pid} on {host}) is stopped (SIGSTOP, or frozen) and was killed")
        elif state == "t":
            lost.append(f"rank {r} (pid {pid} on {host}) is stopped by a debugger")
    return lost


@contextlib.contextmanager
def report_lost_ranks(d: Dist):
    """A collective that fails because a rank died, or timed out waiting for one that hangs, becomes
    one line naming the rank and exit 1 at once, instead of a traceback from every survivor; other
    errors pass through. At once: the broken process group's destructors can block for as long as
    torchrun waits before it SIGKILLs a worker, delaying the restart; checkpoints and metrics are
    written whole, so skipping the interpreter's cleanup loses nothing."""
    try:
        yield
    except RuntimeError as e:  # gloo and NCCL raise DistBackendError, a RuntimeError; older torch plain ones
        if not d.enabled or isinstance(e, FastptError):
            raise
        lost = lost_ranks(d)
        if not lost and not isinstance(e, dist.DistError):
            raise
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail(
            f"rank {d.rank}: {', '.join(lost) if lost else 'another rank stopped answering'}; a collective failed "
            f"({first_line[:200]}). torchrun --max-restarts restarts the group, which resumes from the newest "
            "complete checkpoint with --resume"
        )
        sys.stdout.flush()
        os._exit(1)


class Preemption:
    """While entered and armed (the loop has started), SIGTERM / SIGINT ask the loop to checkpoint
    after the current step and stop (`signal`: the first one that came, 0 for none; the run then exits
    128 + it, as a shell reports a process the signal ended); a second Ctrl-C does not wait for a step that takes too
    long (the last checkpoint stands). Before the loop, with nothing to save, a signal does what it
    did before. On exit the handlers found on entry are back, so an in-process caller keeps its own."""

    def __init__(self):
        self.signal = 0
        self.armed = False
        self.previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # where Python delivers signals
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():  # None: installed outside Python, i.e. the default
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum, frame):
        if not self.armed:
            previous = self.previous[signum]
            if callable(previous):  # Python's own SIGINT handler: KeyboardInterrupt
                return previous(signum, frame)
            if previous != signal.SIG_IGN:  # the default: die of the signal, as without us
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if self.signal and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = self.signal or signum


def teardown(d: Dist) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def parallelize(
    model: nn.Module, d: Dist, parallel: str, dtype: torch.dtype, compile_mode: str | None = None
) -> nn.Module:
    """Compile the model in place (compile_mode None: eager), then wrap it in DDP or shard it with
    FSDP2; returns what to call.

    One process and DDP compile the whole model before wrapping, PyTorch's advice: DDP's graph
    splitting (DDPOptimizer) then overlaps the gradient all-reduce with the backward. FSDP compiles
    each TransformerBlock and then shards it, as torchtitan does: FSDP's all-gather and
    reduce-scatter hooks run between the block graphs, not inside one graph of the whole model
    (the root's embedding, final norm and loss stay eager). Shapes are static in training, so
    dynamic=False: eval's smaller last batch gets a graph of its own rather than a dynamic one.
    fully_shard works in place, so under FSDP the model itself is returned.
    """
    sharded = d.enabled and parallel == "fsdp"
    if compile_mode:
        compile_in_place(model, compile_mode, per_block=sharded)
    if not d.enabled:
        return model
    if parallel == "fsdp":
        shard(model, dtype)
        return model
    # The RoPE tables are the only buffers and they are constants: nothing to broadcast per step.
    # torch 2.13 renamed broadcast_buffers (now deprecated, with a warning per rank) forward_sync_buffers.
    device = next(model.parameters()).device
    no_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP).parameters
        else {"broadcast_buffers": False}
    )
    # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets, not a second
    # copy of them (4 bytes per parameter less; the run is bit-identical, tests/test_distributed.py).
    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, gradient_as_bucket_view=True, **no_sync)


def compile_in_place(model: nn.Module, mode: str, per_block: bool) -> None:
    """torch.compile the whole model, or each of its TransformerBlocks (per_block: FSDP's units)."""
    for module in model.layers if per_block else [model]:
        module.compile(mode=mode, dynamic=False)


def shard(model: nn.Module, dtype: torch.dtype) -> None:
    """FSDP2: one all-gather / reduce-scatter unit per TransformerBlock, then the root (embedding,
    head, final norm). bf16 runs compute in bf16 and reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # ~1 s to import: FSDP runs only

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if dtype == torch.bfloat16
        else MixedPrecisionPolicy()
    )
    # The mesh on the model's device: FSDP's default is the accelerator, even for a gloo run on CPU.
    # Real tensors even when fastpt.plan builds the model over fake ones (a mesh holds its ranks).
    with unset_fake_temporarily():
        mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Gradients are all-reduced (DDP) or reduce-scattered (FSDP) only on the last micro-step. (An
    FSDP model is known by its method: torch.distributed.fsdp is imported only where FSDP runs.)"""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = enabled
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """Clip to a global norm. Under FSDP torch reduces the norm over all shards and returns a
    replicated DTensor (known by its full_tensor: DTensor is imported where FSDP runs); the caller
    gets a plain tensor either way."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def all_reduce_mean(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= d.world_size
    return t


def max_rank(value: int, d: Dist) -> int:
    """The largest of every rank's `value`, on every rank."""
    if not d.enabled:
        return value
    t = torch.tensor([value], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()
