"""One training step and what it runs on: the Net (the model, its compiled or parallel wrapper,
optimizers and precision), build_model, train_step and the TrainState the loop carries. The loop
(fastpt.train), the benchmark and the memory planner all run this step."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from fastpt import distributed, float8
from fastpt.config import DTYPES, ModelConfig, TrainConfig, begin_cuda_graph_step
from fastpt.data.loader import TrainLoader
from fastpt.model import Transformer
from fastpt.nanochat_parts import nanochat_init
from fastpt.optim import optimizers_for, step_all


@dataclass
class Net:
    raw: Transformer  # the module itself: checkpoints, parameter count, FLOPs
    model: nn.Module  # what the loop calls: compiled, under DDP or FSDP
    optimizers: list[torch.optim.Optimizer]
    autocast: torch.autocast
    scaler: torch.amp.GradScaler


@dataclass
class StepResult:
    loss: torch.Tensor  # mean cross-entropy over the step's micro-batches (and ranks), on device
    z_loss: torch.Tensor  # mean z-loss term, trained on but not in `loss` (0 without --z-loss)
    grad_norm: torch.Tensor  # global norm before clipping
    finite: torch.Tensor  # loss and norm both finite (bool, on device)
    applied: bool  # False only for an update skipped as non-finite


def accum_at(cfg: TrainConfig, step: int) -> int:
    """Micro-batches in the step after `step` steps: grad_accum, or during --batch-warmup-steps N the
    whole micro-batches within a linear ramp of sequences, from batch_warmup_start at step 0 up to
    the full batch (config.check_batch_warmup: start >= one micro-batch). The micro-batch's shape
    never changes: a compiled model does not recompile."""
    if step >= cfg.batch_warmup_steps:
        return cfg.grad_accum
    start, full = cfg.batch_warmup_start, cfg.micro_batch * cfg.grad_accum
    return (start + (full - start) * step // cfg.batch_warmup_steps) // cfg.micro_batch


def micro_batches(cfg: TrainConfig, steps: int) -> int:
    """Micro-batches the first `steps` steps train, the batch warm-up's ramp counted (per rank): the
    ramp's sum in closed form, so a plan or a summary of a billion steps costs no loop."""
    ramp, n = min(steps, cfg.batch_warmup_steps), cfg.batch_warmup_steps
    start, full = cfg.batch_warmup_start, cfg.micro_batch * cfg.grad_accum
    # accum_at(s) = (start * n + (full - start) * s) // (n * micro_batch), summed over s < ramp
    ramped = floor_sum(ramp, n * cfg.micro_batch, full - start, start * n) if ramp else 0
    return ramped + cfg.grad_accum * (steps - ramp)


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum((a * i + b) // m for i in range(n)) for n, m >= 1 and a, b >= 0, in O(log m) steps (the
    AtCoder Library's floor_sum: Euclid's algorithm on the lattice points under the line)."""
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        top = a * n + b
        if top < m:
            return total
        n, b, m, a = top // m, top % m, a, m


def train_step(
    net: Net,
    loader: TrainLoader,
    cfg: TrainConfig,
    d: distributed.Dist = distributed.ONE_PROCESS,
    accum: int | None = None,
) -> StepResult:
    """One optimizer step: `accum` micro-batches (grad_accum by default), each loss / accum so the accumulated
    gradient averages like one large batch (DDP / FSDP sync only on the last; FSDP on every one with
    --fsdp-reshard-grads, keeping only sharded gradients), then unscale (fp16),
    clip the global norm and step every optimizer. Nothing waits for the host, unless
    --on-nonfinite skip asks whether to apply the update."""
    model, scaler = net.model, net.scaler
    for opt in net.optimizers:
        opt.zero_grad(set_to_none=True)
    accum = accum or cfg.grad_accum
    sums = torch.zeros(2, device=loader.device)  # cross-entropy, z-loss
    for micro_step in range(accum):
        batch = loader.next()
        distributed.set_grad_sync(
            model, micro_step == accum - 1 or (cfg.fsdp_reshard_grads and d.enabled and cfg.parallel == "fsdp")
        )
        begin_cuda_graph_step(cfg)
        with net.autocast:
            out = model(batch.x, labels=batch.y)  # loss: (), the fused loss never builds the logits
        scaler.scale(out.loss / accum).backward()
        # logged apart: the loss stays the cross-entropy, comparable across runs
        sums += torch.stack((out.cross_entropy, out.z_loss)) / accum
    loss, z_loss = distributed.all_reduce_mean(sums, d)  # every rank takes the same branches
    for opt in net.optimizers:
        scaler.unscale_(opt)
    grad_norm = distributed.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or math.inf)
    # fp16's GradScaler skips overflowing steps itself; an inf norm there is routine.
    finite = torch.isfinite(loss) & (torch.isfinite(grad_norm) | scaler.is_enabled())
    applied = cfg.on_nonfinite != "skip" or bool(finite)  # one host sync per step, in skip mode only
    if applied:
        step_all(net.optimizers, scaler, grad_norm)
    scaler.update()
    return StepResult(loss, z_loss, grad_norm, finite, applied)


@dataclass
class TrainState:
    """What the loop carries from step to step; checkpoints hold it, so a resumed run's records
    equal the uninterrupted run's, the log window straddling the checkpoint included."""

    step: int = 0
    tokens_seen: int = 0
    best_val_loss: float = math.inf
    skipped_steps: int = 0
    consecutive_skips: int = 0
    window_loss: float | torch.Tensor = 0.0  # sum of step losses since the last dashboard line
    window_z_loss: float | torch.Tensor = 0.0  # ... and of their z-loss terms
    window_steps: int = 0  # updates applied since the last dashboard line
    window_tokens: int = 0  # ... and the tokens they trained (fewer per step during a batch warm-up)

    def state_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "window_loss": float(self.window_loss),
            "window_z_loss": float(self.window_z_loss),
        }

    def load_state_dict(self, state: dict) -> None:
        state = {"window_tokens": 0, **state}  # a checkpoint from before window_tokens: tok/s restarts counting
        for f in dataclasses.fields(self):
            setattr(self, f.name, state[f.name])

    def to(self, device: torch.device) -> None:
        """The window sums as tensors on the device: adding a step's loss never waits for it."""
        self.window_loss, self.window_z_loss = (
            torch.tensor(float(v), device=device) for v in (self.window_loss, self.window_z_loss)
        )

    def count(self, result: StepResult, tokens_per_step: int) -> None:
        """Step `step + 1` is done: add its loss to the log window, or count it as skipped."""
        self.step += 1
        if result.applied:
            self.consecutive_skips = 0
            self.tokens_seen += tokens_per_step
            self.window_tokens += tokens_per_step
            self.window_loss += result.loss
            self.window_z_loss += result.z_loss
            self.window_steps += 1
        else:
            self.skipped_steps += 1
            self.consecutive_skips += 1

    def new_window(self) -> None:
        self.window_loss.zero_()
        self.window_z_loss.zero_()
        self.window_steps = 0
        self.window_tokens = 0


def build_model(
    cfg: TrainConfig,
    mcfg: ModelConfig,
    device: torch.device,
    d: distributed.Dist,
    init_weights: dict | None = None,
    kernels: str | None = None,
) -> Net:
    """The seeded model (--init-from's weights if given; --zero-init zeroes its output projections, --init
    nanochat starts it as nanochat's),
    float8, compiled and parallelized in torchtitan's order, its optimizers and precision. `kernels`
    overrides cfg.kernels (a kernel that failed its check: selfcheck.kernel_backend)."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    raw = Transformer(mcfg, kernels or cfg.kernels, cfg.z_loss, cfg.activation_checkpointing, cfg.zero_init)
    if cfg.init == "nanochat":
        nanochat_init(raw)
    if init_weights is not None:
        raw.load_state_dict(init_weights)
    if raw.output_weight.device != device:  # built in place already: fastpt.plan's fake model cannot be moved
        raw.to(device)
    if cfg.float8:  # before compiling and sharding
        float8.convert(raw)
    model = distributed.parallelize(raw, d, cfg.parallel, DTYPES[cfg.dtype], cfg.compile_mode if cfg.compile else None)
    optimizers = optimizers_for(raw, cfg)  # AdamW, or AdamW + Muon
    autocast = torch.autocast(device.type, dtype=DTYPES[cfg.dtype], enabled=cfg.dtype != "fp32")
    return Net(raw, model, optimizers, autocast, torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16"))
