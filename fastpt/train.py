"""Pretrain a Llama-style model: python -m fastpt.train [--compile] [--preset 0.04b|tiny] ...

The whole loop is in `train()`, top to bottom: grouped AdamW, warmup + cosine LR, gradient
accumulation with loss / grad_accum, global-norm clipping, bf16 autocast (fp16 with a
GradScaler), the dashboard line every log_every steps, evals and atomic checkpoints.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fastpt import checkpoint, distributed
from fastpt.checkpoint import CheckpointError
from fastpt.config import (CPU_PROFILE, FIELD_TYPES, FIELDS, ConfigError, ModelConfig, TrainConfig,
                           describe_presets, model_config, resolve, suggest, to_toml)
from fastpt.data import (DataError, TrainLoader, Windows, check_token_ids, data_vocab, eval_batches,
                         find_shards)
from fastpt.metrics import MetricsLogger, device_name, peak_flops, peak_mem_gib
from fastpt.model import Transformer
from fastpt.optim import build_optimizer, lr_at

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Testing hook: poison the loss of these steps ("3" or "3,5,6", numbered as in the log) to
# exercise the non-finite guard.
FAULT_NAN_STEPS = {int(s) for s in os.environ.get("FASTPT_FAULT_NAN_AT_STEP", "").split(",") if s.strip()}


class Preemption:
    """SIGTERM / SIGINT ask the loop to checkpoint after the current step and exit cleanly."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        """A mistyped flag is a user's mistake: one line through ConfigError, not a usage dump."""
        raise ConfigError(f"command line: {message}")


def parse_args(argv: list[str] | None) -> tuple[dict, str | None]:
    """Only flags the user actually gave are returned, so the TOML file and defaults can fill in."""
    ap = ArgumentParser(prog="python -m fastpt.train", description=__doc__.splitlines()[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="presets:\n" + describe_presets() + "\n\nOn a CPU the defaults become a short "
                               "tiny-preset run: " + ", ".join(f"{k}={v}" for k, v in CPU_PROFILE.items()))
    ap.add_argument("--config", help="TOML file with the same keys (underscores); flags win over it")
    ap.add_argument("--list-presets", action="store_true", help="print each preset's shape and size, then exit")
    flags = ["--config", "--list-presets"]
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        flags.append(flag)
        meta = f.metadata
        allowed = (f"; one of {', '.join(map(repr, meta['choices']))}" if meta["choices"]
                   else f"; {meta['domain']}" if meta["domain"] else "")
        help_text = f"{meta['help']}{allowed} (default: {f.default!r})".replace("%", "%%")
        if FIELD_TYPES[name] is bool:
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            ap.add_argument(flag, type=FIELD_TYPES[name], default=argparse.SUPPRESS, help=help_text,
                            metavar=name.upper())
    args, unknown = ap.parse_known_args(argv)
    if unknown:
        hint = suggest(unknown[0].split("=")[0], flags)
        raise ConfigError(f"command line: unrecognized argument '{unknown[0]}'{hint}")
    args = vars(args)
    if args.pop("list_presets", False):
        print(describe_presets())
        raise SystemExit(0)
    return args, args.pop("config", None)


def pick_device(cli: dict) -> str:
    wanted = cli.get("device", "")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'device' = 'cuda' but torch sees no CUDA device")
    return wanted or ("cuda" if torch.cuda.is_available() else "cpu")


def check_dtype(dtype: str, device: torch.device) -> None:
    if dtype == "fp16" and device.type != "cuda":
        raise ConfigError(f"'dtype' = 'fp16' needs a CUDA device (got {device.type}); use bf16 or fp32")
    if dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"'dtype' = 'bf16' is not supported on {device_name(device)}; use fp16 or fp32")


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


def rewind_metrics(path: Path, step: int) -> None:
    """Drop records after `step`: a killed run logged steps that the resumed run is about to redo."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut short by the kill is dropped too
            if json.loads(line).get("step", 0) <= step:
                kept.append(line + "\n")
    path.write_text("".join(kept))


def model_mismatch(saved: dict, mcfg: ModelConfig) -> str:
    """The architecture fields a checkpoint disagrees on ('dim 512 != 128')."""
    return ", ".join(f"{k} {v} != {getattr(mcfg, k)}" for k, v in saved.items()
                     if getattr(mcfg, k, v) != v)


def fmt_duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


@torch.no_grad()
def evaluate(model, windows: Windows, cfg: TrainConfig, device, autocast, d) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    count = 0
    for batch in eval_batches(windows, cfg.micro_batch, cfg.eval_tokens, device, d.rank, d.world_size):
        with autocast:
            _, loss, _ = model(batch.x, labels=batch.y)
        total += loss.float() * batch.x.numel()
        count += batch.x.numel()
    model.train()
    stats = distributed.all_reduce_mean(torch.stack([total, torch.tensor(float(count), device=device)]), d)
    return (stats[0] / stats[1]).item()


def train(cfg: TrainConfig, d: distributed.Dist) -> int:
    """Run the training loop; returns the process exit code."""
    device = torch.device(f"cuda:{d.local_rank}" if cfg.device == "cuda" else "cpu")
    check_dtype(cfg.dtype, device)
    if device.type == "cuda":  # fp32 matmuls outside autocast (and --dtype fp32) use TF32 tensor cores
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    run_dir = Path(cfg.out)
    log = print if d.is_main else (lambda *a, **k: None)

    # ---- data: memory-mapped shards, token ids checked against the vocab once
    data_dir = Path(cfg.data) if cfg.data else None
    if data_dir is None:
        from fastpt.prepare import default_corpus
        vocab_hint = model_config(cfg, 0).vocab_size or 4096
        if d.is_main:  # prepared once, by rank 0; the others wait, then find it complete
            default_corpus(vocab_hint)
        distributed.barrier(d)
        data_dir = default_corpus(vocab_hint)
    headerless = cfg.data_format == "nanogpt"
    train_shards = find_shards(data_dir, "train", cfg.data_format)
    val_shards = find_shards(data_dir, "val", cfg.data_format)
    vocab = data_vocab(data_dir, train_shards + val_shards, headerless)
    mcfg = model_config(cfg, vocab)
    check_token_ids(train_shards + val_shards, mcfg.vocab_size, headerless)
    seq_len = cfg.seq_len or mcfg.max_seq_len
    train_windows = Windows(train_shards, seq_len, headerless)
    val_windows = Windows(val_shards, seq_len, headerless)
    loader = TrainLoader(train_windows, cfg.micro_batch, cfg.seed, device, d.rank, d.world_size)

    # ---- model, optimizer, precision
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    raw_model = Transformer(mcfg, cfg.kernels).to(device)
    model = distributed.parallelize(raw_model, d, cfg.parallel, DTYPES[cfg.dtype], cfg.compile)
    optimizer = build_optimizer(raw_model, cfg.weight_decay, cfg.decay_rule, cfg.lr,
                                (cfg.beta1, cfg.beta2), cfg.eps)
    autocast = torch.autocast(device.type, dtype=DTYPES[cfg.dtype], enabled=cfg.dtype != "fp32")
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16")

    # ---- resume: model, optimizer, scaler, RNG, loader position, loop state
    step, tokens_seen, best_val = 0, 0, float("inf")
    if cfg.resume and (path := checkpoint.latest(run_dir)):
        ckpt = checkpoint.load(path, device)
        if diff := model_mismatch(ckpt["model_config"], mcfg):
            raise ConfigError(f"{path} was written for another model ({diff}); "
                              "resume with the same preset and data")
        distributed.load_state(path, ckpt, raw_model, optimizer)  # any layout, any world size
        scaler.load_state_dict(ckpt["scaler"])
        loader.load_state_dict(ckpt["loader"])
        set_rng_state(ckpt["rng"])
        step, tokens_seen, best_val = ckpt["step"], ckpt["tokens_seen"], ckpt["best_val_loss"]
        log(f"resumed from {path} at step {step}")
        if step >= cfg.max_steps:
            log(f"nothing to do: the run is already at step {step} of max_steps {cfg.max_steps}")
    elif cfg.resume:
        log(f"--resume: no checkpoint in {run_dir}, starting from scratch")
    elif path := checkpoint.latest(run_dir):  # a fresh run would mix its checkpoints with the old ones
        raise ConfigError(f"{run_dir} already holds a run (newest checkpoint {path.name}): "
                          "add --resume to continue it, or choose another --out")

    def save_checkpoint() -> bool:
        model_state, optim_state = distributed.get_state(raw_model, optimizer)
        state = {
            "model": model_state, "optimizer": optim_state,
            "scaler": scaler.state_dict(), "loader": loader.state_dict(), "rng": rng_state(),
            "step": step, "tokens_seen": tokens_seen, "best_val_loss": best_val,
            "model_config": dataclasses.asdict(mcfg), "train_config": dataclasses.asdict(cfg),
        }
        try:
            if path := distributed.save_checkpoint(run_dir, step, state, cfg.keep_checkpoints, d):
                log(f"saved {path}")
            return True
        except CheckpointError as e:
            print(f"fastpt: warning: {e}", file=sys.stderr)
            return False

    tokens_per_step = cfg.micro_batch * seq_len * cfg.grad_accum * d.world_size
    flops_per_step = raw_model.flops_per_token(seq_len) * tokens_per_step
    peak = peak_flops(device_name(device)) if device.type == "cuda" else None
    if d.is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(to_toml(cfg))
            if (data_dir / "tokenizer.json").is_file():  # the run folder alone is enough for fastpt.sample
                (run_dir / "tokenizer.json").write_bytes((data_dir / "tokenizer.json").read_bytes())
            rewind_metrics(run_dir / "metrics.jsonl", step)
        except OSError as e:
            raise ConfigError(f"'out' = {cfg.out!r}: cannot write the run folder ({e.strerror or e})") from None
    metrics = MetricsLogger(run_dir, dataclasses.asdict(cfg), cfg.tensorboard, cfg.wandb) if d.is_main else None
    log(f"device {device_name(device)} x {d.world_size} | preset {cfg.preset} | params {raw_model.num_params():,} "
        f"| dtype {cfg.dtype} | compile {cfg.compile} | kernels {cfg.kernels} | MFU "
        + (f"vs {peak / 1e12:.0f} TFLOP/s peak" if peak else f"n/a (no peak-FLOPs entry for {device_name(device)})"))
    log(f"data {data_dir}: {len(train_shards)} train shards ({sum(map(len, train_windows.tokens)):,} tokens), "
        f"{len(val_shards)} val ({sum(map(len, val_windows.tokens)):,} tokens) "
        f"| {tokens_per_step:,} tokens/step ({cfg.micro_batch} x {seq_len} x {cfg.grad_accum} accum x "
        f"{d.world_size} ranks) | {cfg.max_steps:,} steps = {tokens_per_step * cfg.max_steps:,} tokens")

    # ---- the loop
    preemption = Preemption()
    model.train()
    first_bad_step = torch.full((), -1, device=device)  # first non-finite step, read at log steps only
    skips = consecutive_skips = 0
    running_loss = torch.zeros((), device=device)
    window_steps = 0  # updates applied since the last dashboard line
    window_start = time.perf_counter()
    exit_code = 0
    while step < cfg.max_steps:
        lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        accum_loss = torch.zeros((), device=device)  # stays on device: no host sync per micro-step
        for micro_step in range(cfg.grad_accum):
            batch = loader.next()
            distributed.set_grad_sync(model, micro_step == cfg.grad_accum - 1)
            with autocast:
                _, loss, _ = model(batch.x, labels=batch.y)
            if step + 1 in FAULT_NAN_STEPS:
                loss = loss * float("nan")
            loss = loss / cfg.grad_accum  # so accumulated grads average like one big batch
            scaler.scale(loss).backward()
            accum_loss += loss.detach()
        accum_loss = distributed.all_reduce_mean(accum_loss, d)  # every rank takes the same branch below
        scaler.unscale_(optimizer)
        grad_norm = distributed.clip_grad_norm_(raw_model.parameters(), cfg.max_grad_norm)
        finite = torch.isfinite(accum_loss) & (torch.isfinite(grad_norm) | (cfg.dtype == "fp16"))
        step += 1  # from here on, the number of this step as the log and the metrics count it
        if cfg.on_nonfinite == "skip" and not finite.item():  # one sync per step, in skip mode only
            skips, consecutive_skips = skips + 1, consecutive_skips + 1
            log(f"step {step}: non-finite loss or gradient norm, update skipped ({consecutive_skips} in a row)")
            if consecutive_skips >= cfg.max_skips:
                log(f"fastpt: error: stopping at step {step}: {consecutive_skips} consecutive non-finite steps "
                    "(max_skips)", file=sys.stderr)
                exit_code = 1
                break
        else:
            consecutive_skips = 0
            first_bad_step = torch.where(~finite & (first_bad_step < 0), step, first_bad_step)
            scaler.step(optimizer)
            tokens_seen += tokens_per_step
            running_loss += accum_loss
            window_steps += 1
        scaler.update()

        is_last = step == cfg.max_steps
        preempted = distributed.any_rank(preemption.requested, d) if (
            not d.enabled or step % cfg.log_every == 0) else False
        log_now, eval_now = step % cfg.log_every == 0 or is_last, step % cfg.eval_every == 0 or is_last
        ckpt_now = step % cfg.ckpt_every == 0 or is_last or preempted
        # The stop-mode flag is read only here, so nothing is logged, evaluated or saved from bad weights.
        if (log_now or eval_now or ckpt_now) and (bad := int(first_bad_step)) >= 0:
            last = checkpoint.latest(run_dir)
            log(f"fastpt: error: non-finite loss or gradient norm at step {bad}; stopped, the latest checkpoint "
                f"({last.name if last else 'none'}) predates it (--on-nonfinite skip skips such updates)",
                file=sys.stderr)
            exit_code = 1
            break
        if log_now and window_steps:  # in skip mode a window may hold no update at all
            avg_loss = (running_loss / window_steps).item()
            elapsed = time.perf_counter() - window_start
            tok_s = window_steps * tokens_per_step / elapsed
            mem = peak_mem_gib(device)
            eta = (cfg.max_steps - step) * elapsed / window_steps  # at the latest pace: compile time is behind us
            record = {
                "step": step, "loss": avg_loss, "ppl": math.exp(min(avg_loss, 20.0)), "lr": lr,
                "grad_norm": float(grad_norm), "tok_s": tok_s, "tok_s_per_gpu": tok_s / d.world_size,
                "mfu": flops_per_step * window_steps / elapsed / d.world_size / peak if peak else None,
                "peak_mem_gib": mem, "data_wait_pct": 100 * loader.wait_s / elapsed,
                "tokens": tokens_seen, "skipped_steps": skips,
            }
            log(f"Step {step:5d}/{cfg.max_steps} | Loss: {avg_loss:.4f} | PPL: {record['ppl']:.2f} | "
                f"LR: {lr:.2e} | Norm: {record['grad_norm']:.3f} | Mem: {mem:.2f} GiB | "
                f"Speed: {tok_s:,.0f} tok/s" + (f" | MFU: {record['mfu']:.1%}" if peak else "")
                + f" | ETA {fmt_duration(eta)}", flush=True)
            if metrics:
                metrics.log(record)
            running_loss.zero_()
            window_steps = 0
            loader.wait_s = 0.0
            window_start = time.perf_counter()

        # Evals and checkpoints are not training: their wall time (the first eval's compile too) is
        # kept out of the window's tok/s and ETA. On a GPU a non-log step may still be in flight here.
        paused = time.perf_counter()
        if eval_now:
            val_loss = evaluate(model, val_windows, cfg, device, autocast, d)
            best_val = min(best_val, val_loss)
            val_ppl = math.exp(min(val_loss, 20.0))
            log(f"Step {step:5d}/{cfg.max_steps} | val loss {val_loss:.4f} | val PPL {val_ppl:.2f}")
            if metrics:
                metrics.log({"step": step, "val_loss": val_loss, "val_ppl": val_ppl})

        if ckpt_now and not save_checkpoint() and (is_last or preempted):
            exit_code = 1  # the checkpoint that --resume needs is missing: say so in the exit code
        if preempted:
            log(f"preempted: stopped after step {step}; continue with --resume")
            break
        window_start += time.perf_counter() - paused
    loader.close()
    if metrics:
        metrics.close()
    return exit_code


def main(argv: list[str] | None = None) -> None:
    d = None
    try:
        cli, config_file = parse_args(argv)
        device_type = pick_device(cli)
        cfg = resolve(cli, config_file, device_type)
        d = distributed.setup(cfg.device)
        code = train(cfg, d)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"fastpt: error: {e}", file=sys.stderr)
        code = 2
    finally:
        if d is not None:
            distributed.teardown(d)
    sys.exit(code)


if __name__ == "__main__":
    main()
