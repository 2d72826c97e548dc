"""torchrun integration: the process group from the environment, the model compiled and put under
DDP or FSDP2, and the cross-rank reductions the loop needs. (Checkpoints of either layout:
checkpoint.py.)"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP


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


def parallelize(model: nn.Module, d: Dist, parallel: str, dtype: torch.dtype,
                compile_mode: str | None = None) -> nn.Module:
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
        for module in model.layers if sharded else [model]:
            module.compile(mode=compile_mode, dynamic=False)
    if not d.enabled:
        return model
    if parallel == "fsdp":
        shard(model, dtype)
        return model
    # The RoPE tables are the only buffers and they are constants: nothing to broadcast per step.
    # torch 2.13 renamed broadcast_buffers (now deprecated, with a warning per rank) forward_sync_buffers.
    device = next(model.parameters()).device
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
               else {"broadcast_buffers": False})
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)


def shard(model: nn.Module, dtype: torch.dtype) -> None:
    """FSDP2: one all-gather / reduce-scatter unit per TransformerBlock, then the root (embedding,
    head, final norm). bf16 runs compute in bf16 and reduce gradients in fp32."""
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if dtype == torch.bfloat16 else MixedPrecisionPolicy())
    # The mesh on the model's device: FSDP's default is the accelerator, even for a gloo run on CPU.
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


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
