"""Pretrain a Llama-style model: python -m fastpt.train [--compile] [--preset NAME] [--data DIR] ...

The loop is `train()`, top to bottom on one screen: the LR schedule, one `train_step()` per step
(gradient accumulation with loss / grad_accum, global-norm clipping, bf16 autocast or fp16 with a
GradScaler; the benchmark and the memory planner run it too), the dashboard line every log_every
steps, evals and atomic checkpoints. What it needs is built before it: the data (data.build_data),
the model with its optimizers and precision (build_model), the checkpointed state
(checkpoint.build_checkpointer), the run folder (metrics.write_run_folder).
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from fastpt import checkpoint, distributed, float8, plan
from fastpt.checkpoint import build_checkpointer, save_checkpoint, start_or_resume
from fastpt.cli import parse_args
from fastpt.config import DTYPES, ModelConfig, TrainConfig, check_runtime, pick_device, resolve
from fastpt.data import TrainLoader, build_data, packing_warning
from fastpt.distributed import Preemption
from fastpt.errors import print_or_drop, run_command
from fastpt.evaluate import Evaluator, describe_eval
from fastpt.metrics import Dashboard, Pace, own_run_folder, summary, write_run_folder
from fastpt.model import Transformer
from fastpt.optim import apply_schedule, optimizers_for, step_all
from fastpt.profiling import StepProbe


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


def train_step(
    net: Net, loader: TrainLoader, cfg: TrainConfig, d: distributed.Dist = distributed.ONE_PROCESS
) -> StepResult:
    """One optimizer step: grad_accum micro-batches, each loss / grad_accum so the accumulated
    gradient averages like one large batch (DDP / FSDP sync only on the last), then unscale (fp16),
    clip the global norm and step every optimizer. Nothing waits for the host, unless
    --on-nonfinite skip asks whether to apply the update."""
    model, scaler = net.model, net.scaler
    for opt in net.optimizers:
        opt.zero_grad(set_to_none=True)
    sums = torch.zeros(2, device=loader.device)  # cross-entropy, z-loss
    for micro_step in range(cfg.grad_accum):
        batch = loader.next()
        distributed.set_grad_sync(model, micro_step == cfg.grad_accum - 1)
        torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs may reuse their buffers; else a no-op
        with net.autocast:
            out = model(batch.x, labels=batch.y)  # loss: (), the fused loss never builds the logits
        scaler.scale(out.loss / cfg.grad_accum).backward()
        # logged apart: the loss stays the cross-entropy, comparable across runs
        sums += torch.stack((out.cross_entropy, out.z_loss)) / cfg.grad_accum
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

    def state_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "window_loss": float(self.window_loss),
            "window_z_loss": float(self.window_z_loss),
        }

    def load_state_dict(self, state: dict) -> None:
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


# ---- setup


def build_model(
    cfg: TrainConfig, mcfg: ModelConfig, device: torch.device, d: distributed.Dist, init_weights: dict | None = None
) -> Net:
    """The seeded model (--init-from's weights if given; --zero-init zeroes its output projections),
    float8, compiled and parallelized in torchtitan's order, its optimizers and precision."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    raw = Transformer(mcfg, cfg.kernels, cfg.z_loss, cfg.activation_checkpointing, cfg.zero_init)
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


def nonfinite_error(bad_step: int, run_dir: Path) -> str:
    last = checkpoint.latest(run_dir)
    return (
        f"fastpt: error: non-finite loss or gradient norm at step {bad_step}; stopped, the latest checkpoint "
        f"({last.name if last else 'none'}) predates it (--on-nonfinite skip skips such updates)"
    )


def too_many_skips(state: TrainState, max_skips: int, log) -> bool:
    """--on-nonfinite skip skipped this step's update: say so; True (an error line said why) once
    max_skips updates in a row were skipped."""
    log(f"step {state.step}: non-finite loss or gradient norm, update skipped ({state.consecutive_skips} in a row)")
    if state.consecutive_skips < max_skips:
        return False
    log(
        f"fastpt: error: stopping at step {state.step}: {state.consecutive_skips} consecutive non-finite steps "
        "(max_skips)",
        file=sys.stderr,
    )
    return True


# ---- the loop


def train(cfg: TrainConfig, d: distributed.Dist, preemption: Preemption, chosen: str = "") -> int:
    """Run the training loop (`preemption` tells when SIGTERM / Ctrl-C asked it to stop; `chosen`, what
    --micro-batch auto chose, joins the summary); returns the process exit code."""
    device = d.device(cfg.device)
    log = print_or_drop if d.is_main else (lambda *a, **k: None)
    with ExitStack() as cleanup:  # whatever ends the run, everything opened here is closed
        if d.is_main:
            own_run_folder(cfg, cleanup)
        data = build_data(cfg, d, device)
        cleanup.callback(data.loader.close)
        evaluator = Evaluator(data.val, cfg, device, data.sources)  # val loss, bpb, --eval-mc
        net = build_model(cfg, data.model_config, device, d, data.init_weights)
        state = TrainState()
        ckpt = build_checkpointer(cfg, data, net, state, d.is_main)
        start_or_resume(cfg, ckpt, device, log)
        metrics = cleanup.enter_context(closing(write_run_folder(cfg, data.dir, state.step))) if d.is_main else None
        seq_len = data.train.seq_len
        dash = Dashboard.for_run(cfg, net.raw.flops_per_token(seq_len), seq_len, device, d.world_size)
        for line in summary(cfg, data, net.raw.num_params(), dash) + ([chosen] if chosen else []):
            log(line)
        if warning := packing_warning(data.train, dash.tokens_per_step // seq_len, cfg.max_steps):
            log(warning, file=sys.stderr)
        probe = cleanup.enter_context(closing(StepProbe(cfg, device, d.rank)))
        pace, exit_code = Pace(), 0
        first_bad_step = torch.full((), -1, device=device)  # first non-finite step, read at log steps only
        net.model.train()
        preemption.armed = True
        while state.step < cfg.max_steps:
            lrs = apply_schedule(net.optimizers, cfg, state.step)  # each group's LR, Muon's momentum
            with probe.step(state.step + 1):  # --profile, recompiles
                result = train_step(net, data.loader, cfg, d)
            state.count(result, dash.tokens_per_step)  # from here on, state.step is this step's number
            if result.applied:
                first_bad_step = torch.where(~result.finite & (first_bad_step < 0), state.step, first_bad_step)
            elif too_many_skips(state, cfg.max_skips, log):
                return 1

            is_last = state.step == cfg.max_steps
            # Under torchrun the ranks agree at log steps only: the vote is a collective.
            preempted = (not d.enabled or state.step % cfg.log_every == 0) and distributed.any_rank(
                preemption.requested, d
            )
            log_now, eval_now = state.step % cfg.log_every == 0 or is_last, state.step % cfg.eval_every == 0 or is_last
            ckpt_now = state.step % cfg.ckpt_every == 0 or is_last or preempted
            # The stop-mode flag is read only here, so nothing is logged, evaluated or saved from bad weights.
            if (log_now or eval_now or ckpt_now) and (bad := int(first_bad_step)) >= 0:
                log(nonfinite_error(bad, ckpt.run_dir), file=sys.stderr)
                return 1
            if log_now and state.window_steps:  # in skip mode a window may hold no update at all
                record = dash.record(
                    state, pace.lap(state.window_steps), lrs, result.grad_norm, data.loader.wait_s, probe.recompiles()
                )
                log(dash.line(record, pace.eta(cfg.max_steps - state.step)), flush=True)
                if metrics:
                    metrics.log(record)
                state.new_window()
                data.loader.wait_s = 0.0

            with pace.paused():  # on a GPU a non-log step may still be in flight here
                if eval_now:
                    record = {"step": state.step, **evaluator.run(net.model, net.autocast, d)}
                    state.best_val_loss = min(state.best_val_loss, record["val_loss"])
                    log(f"Step {state.step:5d}/{cfg.max_steps} | {describe_eval(record)}")
                    if metrics:
                        metrics.log(record)
                if ckpt_now and not save_checkpoint(ckpt, state.step, log) and (is_last or preempted):
                    exit_code = 1  # the checkpoint that --resume needs is missing: say so in the exit code
            if preempted:
                log(f"preempted: stopped after step {state.step}; continue with --resume")
                break
        return exit_code


def main(argv: list[str] | None = None) -> int:
    cli, config_file = parse_args(argv)
    if plan.requested(cli, config_file):
        return plan.main(cli, config_file)
    cfg = resolve(cli, config_file, pick_device(cli))
    check_runtime(cfg)
    cfg, chosen = plan.auto_micro_batch(cfg)  # --micro-batch auto: planned before any process group
    d = distributed.setup(cfg.device)
    try:
        # The handlers outlive report_lost_ranks: torchrun's SIGTERM to a survivor of a dead rank
        # must not kill it before it has said which rank died.
        with Preemption() as preemption, distributed.report_lost_ranks(d):
            return train(cfg, d, preemption, chosen)
    finally:
        distributed.teardown(d)


if __name__ == "__main__":
    run_command(main)
