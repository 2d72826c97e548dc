"""Pretrain a Llama-style model: python -m fastpt.train [--compile] [--preset NAME] [--data DIR] ...

The loop is `train()`, top to bottom on one screen: the LR schedule, one `train_step()` per step
(gradient accumulation with loss / grad_accum, global-norm clipping, bf16 autocast or fp16 with a
GradScaler; the benchmark and the memory planner run it too), the dashboard line every log_every
steps, evals and atomic checkpoints. What it needs is built before it: the data
(data.dataset.build_data), the model with its optimizers and precision (step.build_model), the
checkpointed state (checkpointer.build_checkpointer), the run folder (metrics.write_run_folder).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from contextlib import ExitStack, closing
from pathlib import Path

import torch

from fastpt import checkpoint, distributed
from fastpt.checkpointer import build_checkpointer, save_checkpoint, start_or_resume
from fastpt.cli import parse_args, resumed_run
from fastpt.config import TrainConfig, check_runtime, pick_device, resolve
from fastpt.data.dataset import Data, build_data, check_out_of_data, packing_warning
from fastpt.distributed import Preemption
from fastpt.errors import ConfigError, memory_as_error, print_or_drop, run_command
from fastpt.evaluate import Evaluator, describe_eval
from fastpt.metrics import Dashboard, Pace, own_run_folder, summary, write_run_folder
from fastpt.optim import apply_schedule
from fastpt.plan import fit
from fastpt.plan.planner import planned_model
from fastpt.profiling import StepProbe
from fastpt.run_folder import check_out, this_run_id
from fastpt.selfcheck import Backend, kernel_backend
from fastpt.step import Net, TrainState, accum_at, build_model, train_step


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


def preempted_exit(signum: int, step: int, saved: bool, log) -> int:
    """The exit code of a run stopped by SIGTERM / Ctrl-C after `step`: 128 + the signal (143, 130),
    as a shell reports a process the signal ended, once its checkpoint is safe, so `train && export`
    and torchrun's restart policy see an unfinished run; 1 when that checkpoint failed (said above)."""
    name = signal.Signals(signum).name
    if not saved:
        log(f"preempted: stopped after step {step} by {name}, its checkpoint failed; exit 1", file=sys.stderr)
        return 1
    log(f"preempted: stopped after step {step}; continue with --resume (exit {128 + signum}: {name})")
    return 128 + signum


RUN_FILES = ("config.toml", "tokenizer.json", "metrics.jsonl")  # what metrics.write_run_folder writes


def take_back(made: list[Path], state: TrainState):
    """An exit callback: a run stopped before its first step (a model too big for memory, a Ctrl-C
    while it compiles) deletes the run folder's files it `made`, so the folder is as it found it
    (files.owned_folder then takes back the lock file and the folders it made)."""

    def undo(exc_type, exc, tb) -> bool:
        if exc_type is not None and state.step == 0:
            for path in made:
                path.unlink(missing_ok=True)
        return False

    return undo


def introduce(
    cfg: TrainConfig, data: Data, net: Net, dash: Dashboard, step: int, chosen: str, backend: Backend, log
) -> None:
    """What the run is (the summary with the kernels in effect, what --micro-batch auto chose), a
    packing warning, and that a resumed run already at max_steps has nothing to do."""
    for line in summary(cfg, data, net.raw.num_params(), dash, str(backend)) + ([chosen] if chosen else []):
        log(line)
    seq_len = data.train.seq_len
    if warning := packing_warning(data.train, dash.tokens_per_step // seq_len, cfg.max_steps):
        log(warning, file=sys.stderr)
    if step >= cfg.max_steps:  # a resume of a finished run: said after what the run is
        log(f"nothing to do: the run is already at step {step} of max_steps {cfg.max_steps}")


# ---- the loop


def train(
    cfg: TrainConfig,
    d: distributed.Dist,
    preemption: Preemption,
    backend: Backend,
    chosen: str = "",
    fresh_note: str = "",
) -> int:
    """Run the training loop (`preemption` tells when SIGTERM / Ctrl-C asked it to stop; `backend`,
    the kernels the model takes (selfcheck.kernel_backend); `chosen`, what --micro-batch auto chose,
    joins the summary; `fresh_note`, why a --resume starts afresh); returns the process exit code."""
    device = d.device(cfg.device)
    log = print_or_drop if d.is_main else (lambda *a, **k: None)
    # Whatever ends the run, everything opened here is closed: a failed allocation first becomes one line.
    with ExitStack() as cleanup, memory_as_error("training the run"):
        if d.is_main:
            own_run_folder(cfg, cleanup)
        data = build_data(cfg, d, device)
        cleanup.callback(data.loader.close)
        evaluator = Evaluator(data.val, cfg, device, data.sources)  # val loss, bpb, --eval-mc
        net = build_model(cfg, data.model_config, device, d, data.init_weights, backend.name)
        state = TrainState()
        ckpt = build_checkpointer(cfg, data, net, state, d.is_main)
        start_or_resume(cfg, ckpt, device, log, fresh_note)
        if state.step > cfg.max_steps:  # refused before config.toml takes the lower max_steps
            raise ConfigError(
                f"'max_steps' = {cfg.max_steps} is below step {state.step}, where --resume continues {cfg.out} "
                f"from: a resume continues the run, give --max-steps {state.step} or more"
            )
        made = [Path(cfg.out) / name for name in RUN_FILES if d.is_main and not (Path(cfg.out) / name).exists()]
        metrics = cleanup.enter_context(closing(write_run_folder(cfg, data.dir, state.step))) if d.is_main else None
        cleanup.push(take_back(made, state))
        write_record = metrics.log if metrics else (lambda record: None)  # metrics.jsonl: the main rank's
        seq_len = data.train.seq_len
        dash = Dashboard.for_run(cfg, net.raw.cfg.flops_per_token(seq_len), seq_len, device, d.world_size)
        introduce(cfg, data, net, dash, state.step, chosen, backend, log)
        probe = cleanup.enter_context(closing(StepProbe(cfg, device, d.rank)))
        pace, exit_code = Pace(), 0
        first_bad_step = torch.full((), -1, device=device)  # first non-finite step, read at log steps only
        net.model.train()
        preemption.armed = True
        while state.step < cfg.max_steps:
            lrs = apply_schedule(net.optimizers, cfg, state.step)  # each group's LR, Muon's momentum
            accum = accum_at(cfg, state.step)  # --batch-warmup-steps: fewer micro-batches at first
            with probe.step(state.step + 1):  # --profile, recompiles
                result = train_step(net, data.loader, cfg, d, accum)
            state.count(result, dash.tokens_per_step * accum // cfg.grad_accum)  # state.step: this step's number
            if result.applied:
                first_bad_step = torch.where(~result.finite & (first_bad_step < 0), state.step, first_bad_step)
            elif too_many_skips(state, cfg.max_skips, log):
                return 1

            is_last = state.step == cfg.max_steps
            # Under torchrun the ranks agree at log steps only: the vote is a collective. `preempted` is
            # the signal that stopped any rank (SIGTERM over SIGINT), 0 for none; a run at its last step is done.
            vote = not is_last and (not d.enabled or state.step % cfg.log_every == 0)
            preempted = vote and distributed.max_rank(preemption.signal, d)
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
                write_record(record)
                state.new_window()
                data.loader.wait_s = 0.0

            with pace.paused():  # on a GPU a non-log step may still be in flight here
                if eval_now:
                    record = {"step": state.step, **evaluator.run(net.model, net.autocast, d)}
                    state.best_val_loss = min(state.best_val_loss, record["val_loss"])
                    log(f"Step {state.step:5d}/{cfg.max_steps} | {describe_eval(record)}")
                    write_record(record)
                if ckpt_now and not save_checkpoint(ckpt, state.step, log) and (is_last or preempted):
                    exit_code = 1  # the checkpoint that --resume needs is missing: say so in the exit code
            if preempted:
                return preempted_exit(preempted, state.step, saved=not exit_code, log=log)
        return exit_code


def main(argv: list[str] | None = None) -> int:
    cli, config_file = parse_args(argv)
    if fit.requested(cli, config_file):
        return fit.main(cli, config_file)
    device = pick_device(cli)
    cfg = resolve(cli, config_file, device, resumed_run(cli, config_file, device))
    check_runtime(cfg)
    check_out_of_data(cfg.out, cfg.data)
    fresh_note = check_out(cfg)  # before any preparing, planning or compiling
    capped = distributed.threads_capped(cfg.threads)
    cfg = dataclasses.replace(cfg, threads=distributed.cpu_threads(cfg.threads))
    torch.set_num_threads(cfg.threads)
    d = distributed.connect(cfg.device)  # the rank and its device; the process group comes after the plan
    # rank 0's run id on every rank: each would make its own, and find rank 0's checkpoint another run's
    cfg = dataclasses.replace(cfg, run_id=distributed.share(this_run_id(cfg), "run-id", d)[0])
    # Checked before --micro-batch auto plans, which plans for the kernels in effect (the reference's loss
    # materializes the logits), and before the model is built or compiled (a kernel that fails is never traced).
    backend = kernel_backend(cfg, lambda: planned_model(cfg), d.device(cfg.device), d)
    cfg, chosen = fit.auto_micro_batch(cfg, backend.name)  # planned before any process group: it fakes one
    distributed.setup(d, cfg.device)
    for warning in (capped, distributed.one_process_warning(cfg.parallel, d)):
        if d.is_main and warning:
            print_or_drop(warning, file=sys.stderr)
    try:
        # The handlers outlive report_lost_ranks: torchrun's SIGTERM to a survivor of a dead rank
        # must not kill it before it has said which rank died.
        with Preemption() as preemption, distributed.report_lost_ranks(d):
            return train(cfg, d, preemption, backend, chosen, fresh_note)
    finally:
        distributed.teardown(d)


if __name__ == "__main__":
    run_command(main)
