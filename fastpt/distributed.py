"""torchrun integration: process group from the environment, DDP wrapping, cross-rank reductions."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
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
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, d: Dist, device: torch.device) -> nn.Module:
    if not d.enabled:
        return model
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Gradients are all-reduced only on the last micro-step of an accumulation."""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = enabled


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
