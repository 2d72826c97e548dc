"""Pretrain a Llama-style model: python -m fastpt.train [--compile] [--preset NAME] [--data DIR] ...

The loop is `train()`, top to bottom on one screen: warmup + cosine LR, one `train_step()` per
step (gradient accumulation with loss / grad_accum, global-norm clipping, bf16 autocast or fp16
with a GradScaler; the benchmark runs it too), the dashboard line every log_every steps, evals
and atomic checkpoints. What it needs is built before it by named builders: build_data,
build_model, the Checkpointer with every piece of checkpointed state, write_run_folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from fastpt import checkpoint, distributed, float8, kernels, plan
from fastpt.checkpoint import Checkpointer, ModelState, OptimizerState, RNGState
from fastpt.config import (
    CUDA_GRAPH_MODES,
    DTYPES,
    PRESETS,
    ModelConfig,
    TrainConfig,
    model_config,
    parse_args,
    profile_steps,
    resolve,
    to_toml,
)
from fastpt.data import (
    Source,
    TrainLoader,
    WindowSet,
    common_vocab,
    data_sources,
    describe_data,
    doc_token,
    open_windows,
)
from fastpt.errors import CheckpointError, ConfigError, print_or_drop, run_command
from fastpt.evaluate import Evaluator, describe_eval
from fastpt.files import lock
from fastpt.hf import hf_tokenizer_path, load_hf
from fastpt.metrics import Dashboard, MetricsLogger, Pace, device_name, peak_flops, rewind
from fastpt.model import Transformer
from fastpt.optim import optimizers_for, run_lr, step_all
from fastpt.profiling import StepProbe
from fastpt.tokenizer import copy_for_run, same_tokenizer


@dataclass
class StepResult:
    loss: torch.Tensor  # mean cross-entropy over the step's micro-batches (and ranks), on device
    z_loss: torch.Tensor  # mean z-loss term, trained on but not in `loss` (0 without --z-loss)
    grad_norm: torch.Tensor  # global norm before clipping
    finite: torch.Tensor  # loss and norm both finite (bool, on device)
    applied: bool  # False only for an update skipped as non-finite


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    scaler: torch.amp.GradScaler,
    loader: TrainLoader,
    grad_accum: int,
    autocast: torch.autocast,
    max_grad_norm: float,
    d: distributed.Dist = distributed.ONE_PROCESS,
    skip_nonfinite: bool = False,
) -> StepResult:
    """One optimizer step: grad_accum micro-batches, each loss / grad_accum so the accumulated
    gradient averages like one large batch (DDP / FSDP sync only on the last), then unscale (fp16),
    clip the global norm and step (every optimizer, when given several). Nothing waits for the
    host, unless skip_nonfinite asks whether to apply the update."""
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    sums = torch.zeros(2, device=loader.device)  # cross-entropy, z-loss
    for micro_step in range(grad_accum):
        batch = loader.next()
        distributed.set_grad_sync(model, micro_step == grad_accum - 1)
        torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs may reuse their buffers; else a no-op
        with autocast:
            out = model(batch.x, labels=batch.y)
        scaler.scale(out.loss / grad_accum).backward()
        # logged apart: the loss stays the cross-entropy, comparable across runs
        sums += torch.stack((out.cross_entropy, out.z_loss)) / grad_accum
    loss, z_loss = distributed.all_reduce_mean(sums, d)  # every rank takes the same branches
    for opt in optimizers:
        scaler.unscale_(opt)
    grad_norm = distributed.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    # fp16's GradScaler skips overflowing steps itself; an inf norm there is routine.
    finite = torch.isfinite(loss) & (torch.isfinite(grad_norm) | scaler.is_enabled())
    applied = not skip_nonfinite or bool(finite)  # one host sync per step, in skip mode only
    if applied:
        step_all(optimizers, scaler, grad_norm)
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
            if f.name in state:  # window_* are absent from checkpoints of older releases
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


class Preemption:
    """While entered and armed (the loop has started), SIGTERM / SIGINT ask the loop to checkpoint
    after the current step and exit cleanly; a second Ctrl-C does not wait for a step that takes too
    long (the last checkpoint stands). Before the loop, with nothing to save, a signal does what it
    did before. On exit the handlers found on entry are back, so an in-process caller keeps its own."""

    def __init__(self):
        self.requested = False
        self.armed = False
        self.previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # where Python delivers signals
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():  # None: installed outside Python, i.e. the default
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum, frame):
        if not self.armed:
            previous = self.previous[signum]
            if callable(previous):  # Python's own SIGINT handler: KeyboardInterrupt
                return previous(signum, frame)
            if previous != signal.SIG_IGN:  # the default: die of the signal, as without us
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True


def pick_device(cli: dict) -> str:
    return cli.get("device", "") or ("cuda" if torch.cuda.is_available() else "cpu")


def check_runtime(cfg: TrainConfig) -> None:
    """Choices the config allows but this machine cannot run: every device check is here."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'device' = 'cuda' but torch sees no CUDA device")
    if cfg.dtype == "fp16" and cfg.device != "cuda":
        raise ConfigError(f"'dtype' = 'fp16' needs a CUDA device (got {cfg.device}); use bf16 or fp32")
    if cfg.dtype == "bf16" and cfg.device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"'dtype' = 'bf16' is not supported on {device_name(torch.device('cuda'))}; use fp16 or fp32")
    if cfg.kernels == "triton" and not kernels.available():
        raise ConfigError(
            "'kernels' = 'triton' cannot run here: it needs Triton and a CUDA device "
            "(or TRITON_INTERPRET=1 on a CPU, slowly); use 'auto'"
        )
    if cfg.float8:
        float8.check(torch.device(cfg.device))


def model_mismatch(saved: dict, mcfg: ModelConfig) -> str:
    """The architecture fields a checkpoint disagrees on ('dim 512 != 128')."""
    saved = dataclasses.asdict(ModelConfig.from_dict(saved))
    return ", ".join(f"{k} {v} != {getattr(mcfg, k)}" for k, v in saved.items() if getattr(mcfg, k) != v)


def speed_choices(cfg: TrainConfig) -> str:
    """What the summary line adds after 'compile True': the compile mode, AC, float8."""
    return (
        (f" ({cfg.compile_mode})" if cfg.compile and cfg.compile_mode != "default" else "")
        + (f" | AC {cfg.activation_checkpointing}" if cfg.activation_checkpointing != "none" else "")
        + (" | float8" if cfg.float8 else "")
    )


# ---- setup: the builders train() calls, in order


def unwritable(cfg: TrainConfig, e: OSError) -> ConfigError:
    return ConfigError(f"'out' = {cfg.out!r}: cannot write the run folder ({e.strerror or e})")


@contextlib.contextmanager
def own_run_folder(cfg: TrainConfig) -> Iterator[None]:
    """One trainer per run folder: a second one is refused before it touches anything."""
    try:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        held = lock(Path(cfg.out) / ".lock", "trainer")
    except OSError as e:
        raise unwritable(cfg, e) from None
    with held:  # closing the file drops the lock
        yield


@dataclass
class Data:
    sources: list[Source]  # the prepared folders of --data (several for a mixture)
    train: WindowSet
    val: WindowSet
    loader: TrainLoader
    evaluator: Evaluator  # val loss / bpb over `val`, --eval-mc
    model_config: ModelConfig  # the preset (or --init-from's shape) fitted to the data's vocab and seq_len
    init_weights: dict | None  # --init-from's weights, fastpt-named

    @property
    def dir(self) -> Path:  # the first source: its tokenizer is the run's
        return self.sources[0].folder


def default_vocab(cfg: TrainConfig) -> int:
    """The BPE size the default corpus is prepared with (tiny takes the data's)."""
    return cfg.vocab_size or PRESETS[cfg.preset].vocab_size or 4096


def default_data(cfg: TrainConfig, d: distributed.Dist, init_tokenizer: Path | None) -> Path:
    """The default corpus, prepared once by rank 0 (the others wait, then find it complete)."""
    from fastpt.prepare import default_corpus

    vocab_hint = default_vocab(cfg)
    if cfg.init_from and init_tokenizer is None:  # a BPE of our own would give its ids another meaning
        raise ConfigError(
            f"{cfg.init_from} has no tokenizer.json to prepare the default corpus with: "
            "give --data prepared with the model's tokenizer"
        )
    if d.is_main:
        default_corpus(vocab_hint, init_tokenizer)
    distributed.barrier(d)
    return default_corpus(vocab_hint, init_tokenizer)


def warn_if_other_tokenizer(data_dir: Path, init_tokenizer: Path) -> None:
    data_tokenizer = data_dir / "tokenizer.json"
    if data_tokenizer.is_file() and not same_tokenizer(init_tokenizer, data_tokenizer):
        print(
            f"fastpt: warning: {data_dir} was not prepared with {init_tokenizer}: its ids mean other tokens "
            f"to the model of --init-from (prepare it with --tokenizer {init_tokenizer})",
            file=sys.stderr,
        )


def build_data(cfg: TrainConfig, d: distributed.Dist, device: torch.device) -> Data:
    """Memory-mapped shards (the default corpus without --data), token ids checked against the
    vocab once, the model config that fits them (with --init-from: that model's, and its weights)."""
    init = load_hf(cfg.init_from) if cfg.init_from else None  # (ModelConfig, fastpt-named state)
    init_tokenizer = hf_tokenizer_path(cfg.init_from) if init else None
    sources = data_sources(cfg.data) or [Source(default_data(cfg, d, init_tokenizer))]
    vocab = common_vocab(sources, cfg.data_format)
    if d.is_main and init_tokenizer:
        warn_if_other_tokenizer(sources[0].folder, init_tokenizer)
    document = doc_token(sources[0].folder, "'attention' = 'document'") if cfg.attention == "document" else None
    mcfg = model_config(cfg, vocab, init[0] if init else None, document)
    seq_len = cfg.seq_len or mcfg.max_seq_len
    train, val = open_windows(sources, seq_len, cfg.packing, cfg.data_format, mcfg.vocab_size)
    loader = TrainLoader(train, cfg.micro_batch, cfg.seed, device, d.rank, d.world_size)
    evaluator = Evaluator(val, cfg, device, sources[0].folder, seq_len)
    return Data(sources, train, val, loader, evaluator, mcfg, init[1] if init else None)


@dataclass
class Net:
    raw: Transformer  # the module itself: checkpoints, parameter count, FLOPs
    model: nn.Module  # what the loop calls: compiled, under DDP or FSDP
    optimizers: list[torch.optim.Optimizer]
    autocast: torch.autocast
    scaler: torch.amp.GradScaler


def build_model(cfg: TrainConfig, data: Data, device: torch.device, d: distributed.Dist) -> Net:
    """The seeded model (from --init-from's weights if given), float8, compiled and parallelized
    in torchtitan's order, its optimizers and precision."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    raw = Transformer(data.model_config, cfg.kernels, cfg.z_loss, cfg.activation_checkpointing)
    if data.init_weights is not None:
        raw.load_state_dict(data.init_weights)
    if raw.output_weight.device != device:  # built in place already: fastpt.plan's fake model cannot be moved
        raw.to(device)
    if cfg.float8:  # before compiling and sharding
        float8.convert(raw)
    model = distributed.parallelize(raw, d, cfg.parallel, DTYPES[cfg.dtype], cfg.compile_mode if cfg.compile else None)
    optimizers = optimizers_for(raw, cfg)  # AdamW, or AdamW + Muon
    autocast = torch.autocast(device.type, dtype=DTYPES[cfg.dtype], enabled=cfg.dtype != "fp32")
    return Net(raw, model, optimizers, autocast, torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16"))


def build_checkpointer(cfg: TrainConfig, data: Data, net: Net, state: TrainState, d: distributed.Dist) -> Checkpointer:
    """Every piece of state a checkpoint holds, registered once (a new one is one more entry)."""
    states = {
        "model": ModelState(net.raw),
        "optimizer": OptimizerState(net.raw, net.optimizers),
        "scaler": net.scaler,
        "loader": data.loader,
        "rng": RNGState(),
        "train_state": state,
    }
    meta = {"model_config": dataclasses.asdict(data.model_config), "train_config": dataclasses.asdict(cfg)}
    return Checkpointer(Path(cfg.out), states, meta, cfg.keep_checkpoints, d.is_main)


def start_or_resume(
    cfg: TrainConfig, ckpt: Checkpointer, state: TrainState, mcfg: ModelConfig, device: torch.device, log
) -> None:
    """--resume: every registered state from the newest checkpoint that loads. A fresh run refuses
    a folder that holds an earlier run's checkpoints or metrics."""

    def same_model(path: Path, saved: dict) -> None:
        if diff := model_mismatch(saved["model_config"], mcfg):
            raise ConfigError(
                f"{path} was written for another model ({diff}); resume with the same preset, shape keys and data"
            )
        if (optimizer := saved.get("train_config", {}).get("optimizer", "adamw")) != cfg.optimizer:
            raise ConfigError(f"{path} was written with --optimizer {optimizer}: resume with the same optimizer")

    run_dir = ckpt.run_dir
    if cfg.resume and (path := ckpt.restore(device, same_model)):
        log(f"resumed from {path} at step {state.step}")
        if state.step >= cfg.max_steps:
            log(f"nothing to do: the run is already at step {state.step} of max_steps {cfg.max_steps}")
    elif cfg.resume:
        log(f"--resume: no checkpoint in {run_dir}, starting from scratch")
    elif path := checkpoint.latest(run_dir):  # a fresh run would mix its checkpoints with the old ones
        raise ConfigError(
            f"{run_dir} already holds a run (newest checkpoint {path.name}): "
            "add --resume to continue it, or choose another --out"
        )
    elif (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size:
        raise ConfigError(
            f"{run_dir} holds an earlier run's metrics.jsonl (and no checkpoint): "
            "add --resume to start that run over, or choose another --out"
        )
    state.to(device)


def write_run_folder(cfg: TrainConfig, data_dir: Path, step: int) -> MetricsLogger:
    """config.toml, the data's tokenizer (the run folder alone is enough for fastpt.sample),
    metrics.jsonl rewound to `step`; returns the logger that appends to it."""
    run_dir = Path(cfg.out)
    try:
        (run_dir / "config.toml").write_text(to_toml(cfg))
        copy_for_run(data_dir, run_dir)
        rewind(run_dir / "metrics.jsonl", step)
    except OSError as e:
        raise unwritable(cfg, e) from None
    return MetricsLogger(run_dir, dataclasses.asdict(cfg), cfg.tensorboard, cfg.wandb)


def build_dashboard(cfg: TrainConfig, data: Data, net: Net, device: torch.device, d: distributed.Dist) -> Dashboard:
    tokens_per_step = cfg.micro_batch * data.train.seq_len * cfg.grad_accum * d.world_size
    return Dashboard(
        cfg.max_steps,
        tokens_per_step,
        d.world_size,
        net.raw.flops_per_token(data.train.seq_len) * tokens_per_step,
        peak_flops(device_name(device)) if device.type == "cuda" else None,
        device,
        cfg.z_loss > 0,
        cfg.compile,
    )


def summary(cfg: TrainConfig, data: Data, net: Net, dash: Dashboard, device: torch.device) -> list[str]:
    """The two lines a run starts with: where it writes and what it trains, then on what data."""
    peak, seq_len = dash.peak_flops, data.train.seq_len
    return [
        f"run {cfg.out} | device {device_name(device)} x {dash.world_size} | "
        + (f"init from {cfg.init_from}" if cfg.init_from else f"preset {cfg.preset}")
        + f" | params {net.raw.num_params():,} | dtype {cfg.dtype} | compile {cfg.compile}{speed_choices(cfg)} | "
        f"kernels {cfg.kernels} | MFU "
        + (f"vs {peak / 1e12:.0f} TFLOP/s peak" if peak else f"n/a (no peak-FLOPs entry for {device_name(device)})"),
        f"data {describe_data(data.sources, data.train, data.val)} | packing {cfg.packing} | "
        f"{dash.tokens_per_step:,} tokens/step ({cfg.micro_batch} x {seq_len} x {cfg.grad_accum} accum x "
        f"{dash.world_size} ranks) | {cfg.max_steps:,} steps = {dash.tokens_per_step * cfg.max_steps:,} tokens",
    ]


def save_checkpoint(ckpt: Checkpointer, step: int, log) -> bool:
    """Checkpoint `step`; a failed write (a full disk) is a warning, and False."""
    try:
        if path := ckpt.save(step):
            log(f"saved {path}")
        return True
    except CheckpointError as e:
        print(f"fastpt: warning: {e}", file=sys.stderr)
        return False


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


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's group runs at muon_lr on the same curve


# ---- the loop


def train(cfg: TrainConfig, d: distributed.Dist, preemption: Preemption, chosen: str = "") -> int:
    """Run the training loop (`preemption` tells when SIGTERM / Ctrl-C asked it to stop; `chosen`, what
    --micro-batch auto chose, joins the summary); returns the process exit code."""
    device = torch.device(f"cuda:{d.local_rank}" if cfg.device == "cuda" else "cpu")
    if device.type == "cuda":  # fp32 matmuls outside autocast (and --dtype fp32) use TF32 tensor cores
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    log = print_or_drop if d.is_main else (lambda *a, **k: None)
    with ExitStack() as cleanup:  # whatever ends the run, everything opened here is closed
        if d.is_main:
            cleanup.enter_context(own_run_folder(cfg))
        data = build_data(cfg, d, device)
        cleanup.callback(data.loader.close)
        net = build_model(cfg, data, device, d)
        state = TrainState()
        ckpt = build_checkpointer(cfg, data, net, state, d)
        start_or_resume(cfg, ckpt, state, data.model_config, device, log)
        metrics = cleanup.enter_context(closing(write_run_folder(cfg, data.dir, state.step))) if d.is_main else None
        dash = build_dashboard(cfg, data, net, device, d)
        for line in summary(cfg, data, net, dash, device) + ([chosen] if chosen else []):
            log(line)
        cuda_graphs = cfg.compile and cfg.compile_mode in CUDA_GRAPH_MODES
        probe = cleanup.enter_context(
            closing(StepProbe(profile_steps(cfg), ckpt.run_dir / "profile", device, d.rank, cuda_graphs=cuda_graphs))
        )
        pace, exit_code = Pace(), 0
        first_bad_step = torch.full((), -1, device=device)  # first non-finite step, read at log steps only
        net.model.train()
        preemption.armed = True
        while state.step < cfg.max_steps:
            lr = run_lr(cfg, state.step)
            set_lr(net.optimizers, lr)
            with probe.step(state.step + 1):  # --profile, recompiles
                result = train_step(
                    net.model,
                    net.optimizers,
                    net.scaler,
                    data.loader,
                    cfg.grad_accum,
                    net.autocast,
                    cfg.max_grad_norm,
                    d,
                    skip_nonfinite=cfg.on_nonfinite == "skip",
                )
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
                    state, pace.lap(state.window_steps), lr, result.grad_norm, data.loader.wait_s, probe.recompiles()
                )
                log(dash.line(record, pace.eta(cfg.max_steps - state.step)), flush=True)
                if metrics:
                    metrics.log(record)
                state.new_window()
                data.loader.wait_s = 0.0

            with pace.paused():  # on a GPU a non-log step may still be in flight here
                if eval_now:
                    record = {"step": state.step, **data.evaluator.run(net.model, net.autocast, d)}
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
