"""torchrun integration: process group from the environment, DDP or FSDP2 over the model,
cross-rank reductions, and checkpoint state that moves between layouts and world sizes.

Checkpoints come in two kinds, both named ckpt_{step:08d} in the run directory (see checkpoint.py):
a single file `ckpt_N.pt` written by rank 0 when every rank holds the full state (one process, DDP),
and a directory `ckpt_N/` of torch.distributed.checkpoint (DCP) shards written by every rank under
FSDP. Model and optimizer state are keyed by parameter name in both, so either kind resumes in any
layout and world size: a file is sharded on load, a directory is resharded by DCP.
"""
from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from fastpt import checkpoint
from fastpt.checkpoint import CheckpointError
from fastpt.config import ConfigError

TENSOR_KEYS = ("model", "optimizer")  # what DCP shards; the rest of a checkpoint is small and replicated


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device_type: str) -> Dist:
    """Join the torchrun process group (nccl on CUDA, gloo on CPU); a plain run is world size 1."""
    if "RANK" not in os.environ:
        return Dist()
    d = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    if device_type == "cuda":
        torch.cuda.set_device(d.local_rank)
    dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return d


def teardown(d: Dist) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def parallelize(model: nn.Module, d: Dist, parallel: str, dtype: torch.dtype, compile: bool) -> nn.Module:
    """Compile the model in place, then wrap it in DDP or shard it with FSDP2; returns what to call.

    Compiling the inner module before DDP is PyTorch's advice: DDP's graph splitting (DDPOptimizer)
    then overlaps the gradient all-reduce with the backward. fully_shard works in place, so under
    FSDP the model itself is returned.
    """
    if parallel == "fsdp" and dtype == torch.float16:
        raise ConfigError("'parallel' = 'fsdp' supports bf16 and fp32, not fp16: the fp16 GradScaler "
                          "would check only this rank's gradient shards for overflow")
    if compile:
        model.compile()
    if not d.enabled:
        return model
    if parallel == "fsdp":
        shard(model, dtype)
        return model
    # The RoPE tables are the only buffers and they are constants: nothing to broadcast per step.
    device = next(model.parameters()).device
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)


def shard(model: nn.Module, dtype: torch.dtype) -> None:
    """FSDP2: one all-gather / reduce-scatter unit per TransformerBlock, then the root (embedding,
    tied head, final norm). bf16 runs compute in bf16 and reduce gradients in fp32."""
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if dtype == torch.bfloat16 else MixedPrecisionPolicy())
    # A block also returns its (k, v) pair, views that training never touches in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Gradients are all-reduced (DDP) or reduce-scattered (FSDP) only on the last micro-step."""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = enabled
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """Clip to a global norm. Under FSDP torch reduces the norm over all shards and returns a
    replicated DTensor; the caller gets a plain tensor either way."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def all_reduce_mean(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= d.world_size
    return t


def any_rank(flag: bool, d: Dist) -> bool:
    """True on every rank if it is True on any rank."""
    if not d.enabled:
        return flag
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def get_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state keyed by parameter name, the same for a plain, DDP or FSDP model
    (under FSDP the tensors are this rank's DTensor shards)."""
    return get_state_dict(model, optimizer)


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int, d: Dist) -> Path | None:
    """Sharded state: a DCP directory from every rank; full state: one file from rank 0.
    Returns the checkpoint's path (None on ranks that wrote nothing)."""
    if any(isinstance(v, DTensor) for v in state["model"].values()):
        return save_sharded(Path(run_dir), step, state, keep, d)
    return checkpoint.save(run_dir, step, state, keep) if d.is_main else None


def save_sharded(run_dir: Path, step: int, state: dict, keep: int, d: Dist) -> Path:
    """Every rank writes its shards into a hidden directory; rank 0 adds the rest of the state and
    renames the directory into place, so a reader sees a whole checkpoint or none."""
    path = run_dir / f"ckpt_{step:08d}"
    tmp = run_dir / f".{path.name}.partial"
    try:
        dcp.save({k: state[k] for k in TENSOR_KEYS}, checkpoint_id=tmp)
        if d.is_main:  # dcp.save returns on rank 0 (its coordinator) once every rank has written
            rest = {k: v for k, v in state.items() if k not in TENSOR_KEYS}
            checkpoint.write_atomic(tmp / checkpoint.STATE_FILE, lambda f: torch.save(rest, f))
            shutil.rmtree(path, ignore_errors=True)  # the same step, from an attempt that was resumed
            os.replace(tmp, path)
            checkpoint.fsync_dir(run_dir)
            checkpoint.write_atomic(run_dir / "latest", lambda f: f.write(path.name.encode()))
            for stale in run_dir.glob(".ckpt_*.partial"):  # from runs killed mid-save
                shutil.rmtree(stale, ignore_errors=True)
            checkpoint.prune(run_dir, keep)
    except (OSError, RuntimeError, CheckpointException) as e:
        raise CheckpointError(f"could not write sharded checkpoint {path}: {e}; "
                              "the previous checkpoint is intact") from None
    return path


def load_state(path: Path, ckpt: dict, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load model (and optimizer) state from either kind of checkpoint into this run's layout.

    `ckpt` is what checkpoint.load returned: a single file carries full tensors, which
    set_state_dict shards under FSDP; a directory's tensors are read by DCP, resharded to this
    world size (or gathered whole for a plain or DDP run, or for sampling).
    """
    optimizers = [optimizer] if optimizer else []
    try:
        if "model" in ckpt:
            set_state_dict(model, optimizers, model_state_dict=ckpt["model"],
                           optim_state_dict=ckpt["optimizer"] if optimizer else {},
                           options=StateDictOptions(full_state_dict=True))
            return
        model_state, optim_state = get_state_dict(model, optimizers)  # the layout to read into
        state = {"model": model_state, "optimizer": optim_state}
        with warnings.catch_warnings():  # reading a sharded checkpoint in one process is intended
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except (OSError, RuntimeError, KeyError, CheckpointException) as e:
        raise CheckpointError(f"could not load model and optimizer state from {path}: {e}") from None
