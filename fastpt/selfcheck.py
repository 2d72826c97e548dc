"""The kernels checked where they are about to run: before a run's first step on a GPU (or under
TRITON_INTERPRET=1) with --kernels auto or triton, each kernel the model uses runs a small probe in
the run's dtype and shapes against the PyTorch reference (fastpt.kernels.selftest). No fastpt
kernel had run on a GPU in bf16 before a user's run, and Triton's interpreter cannot check that.
The probe runs the ops as the model does: under autocast, on fp32 parameters and activations, or
bf16 ones where FSDP casts them."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from fastpt.config import DTYPES, ModelConfig, TrainConfig
from fastpt.distributed import Dist, param_dtype
from fastpt.errors import FastptError
from fastpt.kernels import api as kernels
from fastpt.kernels import selftest


def kernel_backend(cfg: TrainConfig, mcfg: ModelConfig, device: torch.device, d: Dist, log: Callable) -> str:
    """The backend the model's kernels take: cfg.kernels, or "torch" when a kernel failed its check
    under --kernels auto (one warning naming it and why); under --kernels triton a failure stops the run."""
    runs_triton = device.type == "cuda" or kernels.interpreting()
    if cfg.kernels == "torch" or not (runs_triton and kernels.available()):
        return cfg.kernels
    dtype = DTYPES[cfg.dtype]
    params = param_dtype(d, cfg.parallel, dtype)  # what the model's ops get: FSDP's bf16 parameters, or fp32
    failed = selftest.failures(
        dtype, device, mcfg.dim, mcfg.vocab_size, mcfg.norm_eps, cfg.z_loss, params, mcfg.logit_softcap
    )
    if not failed:
        return cfg.kernels
    where = f"on {device.type} in {cfg.dtype} (dim {mcfg.dim}, vocab {mcfg.vocab_size})"
    what = "; ".join(f"kernel {name} failed its check {where}: {why}" for name, why in failed.items())
    if cfg.kernels == "triton":
        raise FastptError(f"--kernels triton: {what} (--kernels auto falls back to the PyTorch reference)")
    log(f"fastpt: warning: {what}; the run uses the PyTorch reference kernels", file=sys.stderr)
    return "torch"
