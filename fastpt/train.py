"""Pretrain a Llama-style model: python -m fastpt.train [--compile] [--preset NAME] [--data DIR] ...

The whole loop is in `train()`, top to bottom: grouped AdamW, warmup + cosine LR, gradient
accumulation with loss / grad_accum, global-norm clipping, bf16 autocast (fp16 with a
GradScaler), the dashboard line every log_every steps, evals and atomic checkpoints.
One optimizer step is `train_step()`, which the benchmark runs too.
"""
from __future__ import annotations

import dataclasses
import math
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

import kernels
from fastpt import checkpoint, distributed, float8
from fastpt.config import (CUDA_GRAPH_MODES, DTYPES, PRESETS, ModelConfig, TrainConfig, model_config,
                           parse_args, profile_steps, resolve, to_toml)
from fastpt.data import TrainLoader, Windows, check_token_ids, data_vocab, doc_token, eval_batches, find_shards
from fastpt.errors import CheckpointError, ConfigError, DataError, print_or_drop, run_command
from fastpt.files import lock
from fastpt.hf import hf_tokenizer_path, load_hf
from fastpt.metrics import MetricsLogger, Pace, device_name, peak_flops, peak_mem_gib, rewind
from fastpt.model import Transformer
from fastpt.optim import lr_schedule, optimizer_for
from fastpt.profiling import StepProbe
from fastpt.tokenizer import copy_for_run, same_tokenizer


@dataclass
class StepResult:
    loss: torch.Tensor  # mean cross-entropy over the step's micro-batches (and ranks), on device
    z_loss: torch.Tensor  # mean z-loss term, trained on but not in `loss` (0 without --z-loss)
    grad_norm: torch.Tensor  # global norm before clipping
    finite: torch.Tensor  # loss and norm both finite (bool, on device)
    applied: bool  # False only for an update skipped as non-finite


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               loader: TrainLoader, grad_accum: int, autocast: torch.autocast, max_grad_norm: float,
               d: distributed.Dist = distributed.Dist(), skip_nonfinite: bool = False) -> StepResult:
    """One optimizer step: grad_accum micro-batches, each loss / grad_accum so the accumulated
    gradient averages like one large batch (DDP / FSDP sync only on the last), then unscale (fp16),
    clip the global norm and step. Nothing waits for the host, unless skip_nonfinite asks whether
    to apply the update."""
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(2, device=loader.device)  # loss, z-loss
    for micro_step in range(grad_accum):
        batch = loader.next()
        distributed.set_grad_sync(model, micro_step == grad_accum - 1)
        torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs may reuse their buffers; else a no-op
        with autocast:
            _, loss, z_loss = model(batch.x, labels=batch.y)
        loss = loss / grad_accum
        scaler.scale(loss).backward()
        sums[0] += loss.detach()
        if z_loss is not None:  # logged apart: the loss stays the cross-entropy, comparable across runs
            sums += torch.stack((-z_loss, z_loss)) / grad_accum
    loss, z_loss = distributed.all_reduce_mean(sums, d)  # every rank takes the same branches
    scaler.unscale_(optimizer)
    grad_norm = distributed.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    # fp16's GradScaler skips overflowing steps itself; an inf norm there is routine.
    finite = torch.isfinite(loss) & (torch.isfinite(grad_norm) | scaler.is_enabled())
    applied = not skip_nonfinite or bool(finite)  # one host sync per step, in skip mode only
    if applied:
        scaler.step(optimizer)
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
        return {**dataclasses.asdict(self), "window_loss": float(self.window_loss),
                "window_z_loss": float(self.window_z_loss)}

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:  # window_* are absent from checkpoints of older releases
                setattr(self, f.name, state[f.name])


class Preemption:
    """SIGTERM / SIGINT ask the loop to checkpoint after the current step and exit cleanly; a
    second Ctrl-C does not wait for a step that takes too long (the last checkpoint stands)."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True


def pick_device(cli: dict) -> str:
    wanted = cli.get("device", "")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'device' = 'cuda' but torch sees no CUDA device")
    return wanted or ("cuda" if torch.cuda.is_available() else "cpu")


def check_runtime(cfg: TrainConfig, device: torch.device) -> None:
    """Choices the config allows but this machine cannot run."""
    if cfg.dtype == "fp16" and device.type != "cuda":
        raise ConfigError(f"'dtype' = 'fp16' needs a CUDA device (got {device.type}); use bf16 or fp32")
    if cfg.dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"'dtype' = 'bf16' is not supported on {device_name(device)}; use fp16 or fp32")
    if cfg.kernels == "triton" and not kernels.available():
        raise ConfigError("'kernels' = 'triton' cannot run here: it needs Triton and a CUDA device "
                          "(or TRITON_INTERPRET=1 on a CPU, slowly); use 'auto'")
    if cfg.float8:
        float8.check(device)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Generators take their state as CPU byte tensors only; a checkpoint loaded onto the GPU
    (map_location=device) brings these back as CUDA tensors."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def model_mismatch(saved: dict, mcfg: ModelConfig) -> str:
    """The architecture fields a checkpoint disagrees on ('dim 512 != 128')."""
    saved = dataclasses.asdict(ModelConfig.from_dict(saved))
    return ", ".join(f"{k} {v} != {getattr(mcfg, k)}" for k, v in saved.items() if getattr(mcfg, k) != v)


def speed_choices(cfg: TrainConfig) -> str:
    """What the summary line adds after 'compile True': the compile mode, AC, float8."""
    return ((f" ({cfg.compile_mode})" if cfg.compile and cfg.compile_mode != "default" else "")
            + (f" | AC {cfg.activation_checkpointing}" if cfg.activation_checkpointing != "none" else "")
            + (" | float8" if cfg.float8 else ""))


def fmt_duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


@torch.no_grad()
def evaluate(model: nn.Module, windows: Windows, cfg: TrainConfig, device: torch.device, autocast: torch.autocast,
             d: distributed.Dist) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for batch in eval_batches(windows, cfg.micro_batch, cfg.eval_tokens, device, d.rank, d.world_size):
        torch.compiler.cudagraph_mark_step_begin()  # each forward a CUDA-graph step of its own; else a no-op
        with autocast:
            _, loss, z_loss = model(batch.x, labels=batch.y)
        loss = loss if z_loss is None else loss - z_loss  # the cross-entropy alone
        counted = (batch.y != -100).sum()
        total += torch.where(counted > 0, loss.float() * counted, 0.0)  # all padding: its mean is 0 / 0
        count += counted
    model.train()
    stats = distributed.all_reduce_mean(torch.stack([total, count]), d)
    return (stats[0] / stats[1]).item()


def train(cfg: TrainConfig, d: distributed.Dist) -> int:
    """Run the training loop; returns the process exit code."""
    device = torch.device(f"cuda:{d.local_rank}" if cfg.device == "cuda" else "cpu")
    check_runtime(cfg, device)
    if device.type == "cuda":  # fp32 matmuls outside autocast (and --dtype fp32) use TF32 tensor cores
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    run_dir = Path(cfg.out)
    log = print_or_drop if d.is_main else (lambda *a, **k: None)
    if d.is_main:  # one trainer per run folder: a second one is refused before it touches anything
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            run_lock = lock(run_dir / ".lock", "trainer")  # noqa: F841 (held until the process ends)
        except OSError as e:
            raise ConfigError(f"'out' = {cfg.out!r}: cannot write the run folder ({e.strerror or e})") from None

    # ---- a Hugging Face model to continue from: its shape, weights (and tokenizer, see below)
    init = load_hf(cfg.init_from) if cfg.init_from else None  # (ModelConfig, fastpt-named state)
    init_tokenizer = hf_tokenizer_path(cfg.init_from) if init else None

    # ---- data: memory-mapped shards, token ids checked against the vocab once
    data_dir = Path(cfg.data) if cfg.data else None
    if data_dir is None:
        from fastpt.prepare import default_corpus
        vocab_hint = cfg.vocab_size or PRESETS[cfg.preset].vocab_size or 4096  # BPE size (tiny takes the data's)
        if init and init_tokenizer is None:  # a BPE of our own would give its ids another meaning
            raise ConfigError(f"{cfg.init_from} has no tokenizer.json to prepare the default corpus with: "
                              "give --data prepared with the model's tokenizer")
        if d.is_main:  # prepared once, by rank 0; the others wait, then find it complete
            default_corpus(vocab_hint, init_tokenizer)
        distributed.barrier(d)
        data_dir = default_corpus(vocab_hint, init_tokenizer)
    headerless = cfg.data_format == "nanogpt"
    train_shards = find_shards(data_dir, "train", cfg.data_format)
    val_shards = find_shards(data_dir, "val", cfg.data_format)
    vocab = data_vocab(data_dir, train_shards + val_shards, headerless)
    data_tokenizer = data_dir / "tokenizer.json"
    if d.is_main and init_tokenizer and data_tokenizer.is_file() and not same_tokenizer(init_tokenizer, data_tokenizer):
        print(f"fastpt: warning: {data_dir} was not prepared with {init_tokenizer}: its ids mean other tokens "
              f"to the model of --init-from (prepare it with --tokenizer {init_tokenizer})", file=sys.stderr)
    mcfg = model_config(cfg, vocab, init[0] if init else None,
                        doc_token(data_dir) if cfg.attention == "document" else None)
    check_token_ids(train_shards + val_shards, mcfg.vocab_size, headerless)
    seq_len = cfg.seq_len or mcfg.max_seq_len
    train_windows = Windows(train_shards, seq_len, headerless)
    val_windows = Windows(val_shards, seq_len, headerless)
    loader = TrainLoader(train_windows, cfg.micro_batch, cfg.seed, device, d.rank, d.world_size)

    # ---- model, optimizer, precision
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    raw_model = Transformer(mcfg, cfg.kernels, cfg.z_loss, cfg.activation_checkpointing)
    if init:
        raw_model.load_state_dict(init[1])
    raw_model.to(device)
    if cfg.float8:  # before compiling and sharding, torchtitan's order
        float8.convert(raw_model)
    model = distributed.parallelize(raw_model, d, cfg.parallel, DTYPES[cfg.dtype],
                                    cfg.compile_mode if cfg.compile else None)
    optimizer = optimizer_for(raw_model, cfg)  # AdamW, or Muon + AdamW as one (fastpt.optim.Optimizers)
    autocast = torch.autocast(device.type, dtype=DTYPES[cfg.dtype], enabled=cfg.dtype != "fp32")
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16")

    # ---- resume: model, optimizer, scaler, RNG, loader position, loop state
    state = TrainState()

    def resume_from(path: Path, ckpt: dict) -> None:
        if diff := model_mismatch(ckpt["model_config"], mcfg):
            raise ConfigError(f"{path} was written for another model ({diff}); "
                              "resume with the same preset, shape keys and data")
        if (saved := ckpt.get("train_config", {}).get("optimizer", "adamw")) != cfg.optimizer:
            raise ConfigError(f"{path} was written with --optimizer {saved}: resume with the same optimizer")
        checkpoint.load_state(path, ckpt, raw_model, optimizer)  # any layout, any world size
        scaler.load_state_dict(ckpt["scaler"])
        try:
            loader.load_state_dict(ckpt["loader"])
        except DataError as e:  # say which checkpoint does not fit the data and batch given now
            raise DataError(f"{path}: {e}") from None
        set_rng_state(ckpt["rng"])
        state.load_state_dict(ckpt.get("train_state", ckpt))

    if cfg.resume and (restored := checkpoint.restore(run_dir, device, resume_from)):
        log(f"resumed from {restored[0]} at step {state.step}")
        if state.step >= cfg.max_steps:
            log(f"nothing to do: the run is already at step {state.step} of max_steps {cfg.max_steps}")
    elif cfg.resume:
        log(f"--resume: no checkpoint in {run_dir}, starting from scratch")
    elif path := checkpoint.latest(run_dir):  # a fresh run would mix its checkpoints with the old ones
        raise ConfigError(f"{run_dir} already holds a run (newest checkpoint {path.name}): "
                          "add --resume to continue it, or choose another --out")
    elif (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size:
        raise ConfigError(f"{run_dir} holds an earlier run's metrics.jsonl (and no checkpoint): "
                          "add --resume to start that run over, or choose another --out")
    state.window_loss, state.window_z_loss = (torch.tensor(float(v), device=device)
                                              for v in (state.window_loss, state.window_z_loss))

    def save_checkpoint() -> bool:
        model_state, optim_state = checkpoint.state_of(raw_model, optimizer)
        ckpt = {
            "model": model_state, "optimizer": optim_state,
            "scaler": scaler.state_dict(), "loader": loader.state_dict(), "rng": rng_state(),
            "step": state.step, "train_state": state.state_dict(),
            "model_config": dataclasses.asdict(mcfg), "train_config": dataclasses.asdict(cfg),
        }
        try:
            if path := checkpoint.save(run_dir, state.step, ckpt, cfg.keep_checkpoints, d.is_main):
                log(f"saved {path}")
            return True
        except CheckpointError as e:
            print(f"fastpt: warning: {e}", file=sys.stderr)
            return False

    tokens_per_step = cfg.micro_batch * seq_len * cfg.grad_accum * d.world_size
    flops_per_step = raw_model.flops_per_token(seq_len) * tokens_per_step
    peak = peak_flops(device_name(device)) if device.type == "cuda" else None
    metrics = None
    if d.is_main:
        try:
            (run_dir / "config.toml").write_text(to_toml(cfg))
            copy_for_run(data_dir, run_dir)  # the run folder alone is enough for fastpt.sample
            rewind(run_dir / "metrics.jsonl", state.step)
        except OSError as e:
            raise ConfigError(f"'out' = {cfg.out!r}: cannot write the run folder ({e.strerror or e})") from None
        metrics = MetricsLogger(run_dir, dataclasses.asdict(cfg), cfg.tensorboard, cfg.wandb)
    log(f"device {device_name(device)} x {d.world_size} | "
        + (f"init from {cfg.init_from}" if init else f"preset {cfg.preset}") + f" | params {raw_model.num_params():,} "
        f"| dtype {cfg.dtype} | compile {cfg.compile}{speed_choices(cfg)} | kernels {cfg.kernels} | MFU "
        + (f"vs {peak / 1e12:.0f} TFLOP/s peak" if peak else f"n/a (no peak-FLOPs entry for {device_name(device)})"))
    log(f"data {data_dir}: {len(train_shards)} train shards ({sum(map(len, train_windows.tokens)):,} tokens), "
        f"{len(val_shards)} val ({sum(map(len, val_windows.tokens)):,} tokens) "
        f"| {tokens_per_step:,} tokens/step ({cfg.micro_batch} x {seq_len} x {cfg.grad_accum} accum x "
        f"{d.world_size} ranks) | {cfg.max_steps:,} steps = {tokens_per_step * cfg.max_steps:,} tokens")

    # ---- the loop
    preemption = Preemption()
    model.train()
    first_bad_step = torch.full((), -1, device=device)  # first non-finite step, read at log steps only
    pace = Pace()
    probe = StepProbe(profile_steps(cfg), run_dir / "profile", device, d.rank,
                      cuda_graphs=cfg.compile and cfg.compile_mode in CUDA_GRAPH_MODES)
    exit_code = 0
    while state.step < cfg.max_steps:
        lr = lr_schedule(cfg.schedule, state.step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio,
                         cfg.decay_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's group runs at muon_lr on the same curve
        with probe.step(state.step + 1):  # --profile, recompiles
            result = train_step(model, optimizer, scaler, loader, cfg.grad_accum, autocast, cfg.max_grad_norm, d,
                                skip_nonfinite=cfg.on_nonfinite == "skip")
        state.step += 1  # from here on, the number of this step as the log and the metrics count it
        if result.applied:
            state.consecutive_skips = 0
            first_bad_step = torch.where(~result.finite & (first_bad_step < 0), state.step, first_bad_step)
            state.tokens_seen += tokens_per_step
            state.window_loss += result.loss
            state.window_z_loss += result.z_loss
            state.window_steps += 1
        else:
            state.skipped_steps += 1
            state.consecutive_skips += 1
            log(f"step {state.step}: non-finite loss or gradient norm, update skipped "
                f"({state.consecutive_skips} in a row)")
            if state.consecutive_skips >= cfg.max_skips:
                log(f"fastpt: error: stopping at step {state.step}: {state.consecutive_skips} consecutive "
                    "non-finite steps (max_skips)", file=sys.stderr)
                exit_code = 1
                break

        is_last = state.step == cfg.max_steps
        preempted = distributed.any_rank(preemption.requested, d) if (
            not d.enabled or state.step % cfg.log_every == 0) else False
        log_now, eval_now = state.step % cfg.log_every == 0 or is_last, state.step % cfg.eval_every == 0 or is_last
        ckpt_now = state.step % cfg.ckpt_every == 0 or is_last or preempted
        # The stop-mode flag is read only here, so nothing is logged, evaluated or saved from bad weights.
        if (log_now or eval_now or ckpt_now) and (bad := int(first_bad_step)) >= 0:
            last = checkpoint.latest(run_dir)
            log(f"fastpt: error: non-finite loss or gradient norm at step {bad}; stopped, the latest checkpoint "
                f"({last.name if last else 'none'}) predates it (--on-nonfinite skip skips such updates)",
                file=sys.stderr)
            exit_code = 1
            break
        if log_now and state.window_steps:  # in skip mode a window may hold no update at all
            elapsed = pace.lap()
            avg_loss = (state.window_loss / state.window_steps).item()
            tok_s = state.window_steps * tokens_per_step / elapsed
            mem = peak_mem_gib(device)
            eta = (cfg.max_steps - state.step) * elapsed / state.window_steps  # at the latest pace
            record = {
                "step": state.step, "loss": avg_loss, "ppl": math.exp(min(avg_loss, 20.0)), "lr": lr,
                "grad_norm": float(result.grad_norm), "tok_s": tok_s, "tok_s_per_gpu": tok_s / d.world_size,
                "mfu": flops_per_step * state.window_steps / elapsed / d.world_size / peak if peak else None,
                "peak_mem_gib": mem, "data_wait_pct": 100 * loader.wait_s / elapsed,
                "tokens": state.tokens_seen, "skipped_steps": state.skipped_steps, "recompiles": probe.recompiles(),
            }
            if cfg.z_loss:
                record["z_loss"] = (state.window_z_loss / state.window_steps).item()
            log(f"Step {state.step:5d}/{cfg.max_steps} | Loss: {avg_loss:.4f} | PPL: {record['ppl']:.2f} | "
                + (f"Z: {record['z_loss']:.2e} | " if cfg.z_loss else "")
                + f"LR: {lr:.2e} | Norm: {record['grad_norm']:.3f} | Mem: {mem:.2f} GiB | "
                f"Speed: {tok_s:,.0f} tok/s" + (f" | MFU: {record['mfu']:.1%}" if peak else "")
                + (f" | Recompiles: {record['recompiles']}" if cfg.compile else "")
                + f" | ETA {fmt_duration(eta)}", flush=True)
            if metrics:
                metrics.log(record)
            state.window_loss.zero_()
            state.window_z_loss.zero_()
            state.window_steps = 0
            loader.wait_s = 0.0

        with pace.paused():  # on a GPU a non-log step may still be in flight here
            if eval_now:
                val_loss = evaluate(model, val_windows, cfg, device, autocast, d)
                state.best_val_loss = min(state.best_val_loss, val_loss)
                val_ppl = math.exp(min(val_loss, 20.0))
                log(f"Step {state.step:5d}/{cfg.max_steps} | val loss {val_loss:.4f} | val PPL {val_ppl:.2f}")
                if metrics:
                    metrics.log({"step": state.step, "val_loss": val_loss, "val_ppl": val_ppl})
            if ckpt_now and not save_checkpoint() and (is_last or preempted):
                exit_code = 1  # the checkpoint that --resume needs is missing: say so in the exit code
        if preempted:
            log(f"preempted: stopped after step {state.step}; continue with --resume")
            break
    loader.close()
    probe.close()
    if metrics:
        metrics.close()
    return exit_code


def main(argv: list[str] | None = None) -> int:
    cli, config_file = parse_args(argv)
    cfg = resolve(cli, config_file, pick_device(cli))
    d = distributed.setup(cfg.device)
    try:
        return train(cfg, d)
    finally:
        distributed.teardown(d)


if __name__ == "__main__":
    run_command(main)
