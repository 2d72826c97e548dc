"""The kernels checked where they are about to run: before a run plans (--micro-batch auto) and
builds its model, on a GPU (or under TRITON_INTERPRET=1) with --kernels auto or triton, each kernel
launch the run's model makes runs a small probe in the run's dtypes and shapes, with its program
structure, against the PyTorch reference (fastpt.kernels.selftest). No fastpt kernel had run on a
GPU in bf16 before a user's run, and Triton's interpreter cannot check that.

The launches are the model's own (`launches`): a forward of the run's model as training makes it
and evaluation's forward without gradients, over fake tensors with one block (each launches alike),
each distinct call of a kernel op noted: the norms over the hidden size, QK-norm's over the head
size (bf16 queries and keys, fp32 weights in a bf16 run), the loss with its options. Under torchrun
every rank probes its own device and the ranks agree through the rendezvous store: a kernel that
fails on any rank falls back on every one, and each failing rank says why (a probe that raises, out
of memory say, is its kernel's failure: no rank leaves the others waiting for its result)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fastpt import distributed
from fastpt.config import DTYPES, TrainConfig
from fastpt.distributed import Dist, param_dtype
from fastpt.errors import FastptError, print_or_drop
from fastpt.kernels import api as kernels
from fastpt.kernels import selftest
from fastpt.model import Transformer
from fastpt.presets import ModelConfig

EXERCISED_LAYERS, EXERCISED_TOKENS = 1, 16  # every block launches alike; rows do not pick a launch


@dataclass(frozen=True)
class Backend:
    """The kernels a run takes: `name` (triton | torch) and, under --kernels auto, why."""

    name: str
    auto: str = ""  # "" when --kernels named it; else "auto", or "auto: <kernel> failed its check"

    def __str__(self) -> str:
        return f"{self.name} ({self.auto})" if self.auto else self.name


def exercise(
    cfg: TrainConfig,
    mcfg: ModelConfig,
    params: torch.dtype,
    backend: str,
    shape: tuple[int, int] | None = None,
    within: contextlib.AbstractContextManager | None = None,
    backward: bool = False,
) -> None:
    """The run's model as its kernels see it, over fake tensors (nothing allocated, nothing computed):
    parameters in `params`, a training forward under the run's autocast (and its backward), then
    evaluation's forward per target without gradients, on a batch of `shape` (a few tokens by
    default); `within` is entered inside the fake mode (bench/aot.py runs the kernels' launchers there).
    The ops' calls are all in the forwards: a backward launches what its forward's call implies."""
    dtype = DTYPES[cfg.dtype]
    small = dataclasses.replace(mcfg, n_layers=min(mcfg.n_layers, EXERCISED_LAYERS))
    shape = shape or (1, min(EXERCISED_TOKENS, mcfg.max_seq_len))
    with FakeTensorMode(), within or contextlib.nullcontext():
        model = Transformer(small, backend, cfg.z_loss)
        for p in model.parameters():  # as FSDP casts them: the parameters, not the RoPE tables
            p.data = p.data.to(params)
        idx = torch.zeros(shape, dtype=torch.long)
        autocast = lambda: torch.autocast("cpu", dtype, enabled=dtype != torch.float32)  # noqa: E731 (CPU casts as CUDA does)
        with autocast():
            loss = model(idx, labels=idx).loss
        if backward:
            loss.backward()
        model.eval()
        with torch.no_grad(), autocast():
            model(idx, labels=idx, reduction="none")


def launches(cfg: TrainConfig, mcfg: ModelConfig, params: torch.dtype) -> list[selftest.Launch]:
    """Each distinct kernel launch the run's model makes (`exercise`), with parameters in `params`."""
    with selftest.recording() as seen:
        exercise(cfg, mcfg, params, "torch")
    return seen


def kernel_backend(cfg: TrainConfig, model_config: Callable[[], ModelConfig], device: torch.device, d: Dist) -> Backend:
    """The backend the model's kernels take: cfg.kernels ("triton" for auto where the kernels run),
    or "torch" when a kernel failed its check on any rank under --kernels auto (each failing rank's
    warning says why); under --kernels triton a failure stops the run on every rank. `model_config`
    gives the run's model, asked only where the check runs."""
    if cfg.kernels == "torch":
        return Backend("torch")
    asked = "" if cfg.kernels == "triton" else "auto"
    if not ((device.type == "cuda" or kernels.interpreting()) and kernels.available()):
        return Backend("torch", asked)  # auto off a GPU (check_runtime refuses triton where it cannot run)
    dtype = DTYPES[cfg.dtype]
    params = param_dtype(d, cfg.parallel, dtype)  # what the model's ops get: FSDP's bf16 parameters, or fp32
    mine = selftest.failures(launches(cfg, model_config(), params), device)
    where = f"on {device.type} in {cfg.dtype}"
    rank = f"rank {d.rank}: " if d.enabled else ""
    said = {name: f"{rank}kernel {name} failed its check {where}: {why}" for name, why in mine.items()}
    every = [json.loads(s) for s in distributed.share(json.dumps(sorted(said)), "kernel-check", d)]
    failed = {name: [r for r, names in enumerate(every) if name in names] for name in sorted(set().union(*every))}
    if not failed:
        return Backend("triton", asked)
    if cfg.kernels == "triton":
        what = "; ".join(said.values()) or f"{failing(failed, d)} (that rank's line says why)"
        raise FastptError(f"--kernels triton: {what} (--kernels auto falls back to the PyTorch reference)")
    for line in said.values():
        print_or_drop(
            f"fastpt: warning: {line}; the run uses the PyTorch reference kernels", file=sys.stderr, flush=True
        )
    return Backend("torch", f"auto: {failing(failed, d)}")


def failing(failed: dict[str, list[int]], d: Dist) -> str:
    """'rms_norm failed its check', with the ranks it failed on under torchrun."""
    on = lambda ranks: f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if d.enabled else ""  # noqa: E731
    return "; ".join(f"{name} failed its check{on(ranks)}" for name, ranks in failed.items())
