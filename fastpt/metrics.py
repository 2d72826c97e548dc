"""Run metrics: metrics.jsonl always, TensorBoard and Weights & Biases on request; MFU."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import re
import resource
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from fastpt.config import FIELDS, TrainConfig, to_toml
from fastpt.data.dataset import Data, describe_data
from fastpt.data.tokenizer import run_tokenizer
from fastpt.errors import ConfigError, require
from fastpt.files import clear_temporaries, owned_folder, write_atomic_all
from fastpt.model import unet_wiring
from fastpt.presets import ModelConfig
from fastpt.step import micro_batches

# Dense bf16 tensor-core peak FLOP/s (no sparsity), by a substring of the device name.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


def peak_flops(device_name: str) -> float | None:
    """The table's peak for a GPU name, or None when the GPU is unknown (no guessed MFU)."""
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # "H100 NVL" before "H100"
        # Whole words only: "T4" must not match a "T400", nor "H200" a "GH200".
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", device_name):
            return PEAK_BF16_FLOPS[key]
    return None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_mem_gib(device: torch.device) -> float:
    """CUDA: max allocated by torch. CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


class Pace:
    """Wall time of training since the last dashboard line, with evals and checkpoints left out
    (their time, the first eval's compile included, is not training), and the steady pace that
    the ETA follows: seconds per step since the first log window, which holds the warm-up
    (compilation, first allocations), so one slow start does not promise hours."""

    def __init__(self):
        self.start = time.perf_counter()
        self.laps = 0
        self.steady_s, self.steady_steps = 0.0, 0  # after the first lap

    @contextlib.contextmanager
    def paused(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - t0

    def lap(self, steps: int) -> float:
        """Seconds of training since the last lap, which covered `steps` steps; starts the next one."""
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        if self.laps:
            self.steady_s += elapsed
            self.steady_steps += steps
        self.laps += 1
        return elapsed

    def eta(self, steps_left: int) -> float | None:
        """Seconds until `steps_left` more steps are done at the steady pace; None while there is
        none yet (the first window, compilation and all, says little about the rest)."""
        if not steps_left:
            return 0.0
        return steps_left * self.steady_s / self.steady_steps if self.steady_steps else None


def fmt_duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


@dataclass
class Dashboard:
    """The record that metrics.jsonl gets for each log window and eval, and the line printed for it."""

    max_steps: int
    tokens_per_step: int  # all ranks together
    world_size: int
    flops_per_token: float
    peak_flops: float | None  # per GPU; None: no MFU (a CPU, an unknown GPU)
    device: torch.device
    z_loss: bool  # the run trains with a z-loss term: log it
    compile: bool  # the run is compiled: show recompiles

    @classmethod
    def for_run(cls, cfg: TrainConfig, flops_per_token: float, seq_len: int, device: torch.device, world_size: int):
        """The dashboard of a run of `cfg` over all its ranks: tokens and FLOPs per step, the GPU's peak."""
        tokens_per_step = cfg.micro_batch * seq_len * cfg.grad_accum * world_size
        peak = peak_flops(device_name(device)) if device.type == "cuda" else None
        return cls(
            max_steps=cfg.max_steps,
            tokens_per_step=tokens_per_step,
            world_size=world_size,
            flops_per_token=flops_per_token,
            peak_flops=peak,
            device=device,
            z_loss=cfg.z_loss > 0,
            compile=cfg.compile,
        )

    def record(
        self, state, elapsed: float, lrs: dict[str, float], grad_norm: torch.Tensor, data_wait_s: float, recompiles: int
    ) -> dict:
        """The record of the log window that the loop's TrainState `state` has summed, `elapsed`
        seconds of training long; reading the loss is the window's one wait for the device. `lrs`:
        each optimizer group's LR (optim.apply_schedule), "lr" as `lr`, the others as `lr/NAME`. Speed
        and MFU count the tokens the window trained: a batch warm-up's steps train fewer."""
        steps = state.window_steps
        loss = (state.window_loss / steps).item()
        tok_s = state.window_tokens / elapsed
        mfu = self.flops_per_token * tok_s / self.world_size / self.peak_flops if self.peak_flops else None
        record = {
            "step": state.step,
            "loss": loss,
            "ppl": math.exp(min(loss, 20.0)),
            "lr": lrs["lr"],
            **{f"lr/{name}": lr for name, lr in lrs.items() if name != "lr"},
            "grad_norm": float(grad_norm),
            "tok_s": tok_s,
            "tok_s_per_gpu": tok_s / self.world_size,
            "mfu": mfu,
            "peak_mem_gib": peak_mem_gib(self.device),
            "data_wait_pct": 100 * data_wait_s / elapsed,
            "tokens": state.tokens_seen,
            "skipped_steps": state.skipped_steps,
            "recompiles": recompiles,
        }
        if self.z_loss:
            record["z_loss"] = (state.window_z_loss / steps).item()
        return record

    def line(self, r: dict, eta_s: float | None) -> str:
        return (
            f"Step {r['step']:5d}/{self.max_steps} | Loss: {r['loss']:.4f} | PPL: {r['ppl']:.2f} | "
            + (f"Z: {r['z_loss']:.2e} | " if self.z_loss else "")
            + f"LR: {r['lr']:.2e}"
            + "".join(f" {k[3:]} {v:.2e}" for k, v in r.items() if k.startswith("lr/"))
            + f" | Norm: {r['grad_norm']:.3f} | Mem: {r['peak_mem_gib']:.2f} GiB | "
            f"Speed: {r['tok_s']:,.0f} tok/s"
            + (f" | MFU: {r['mfu']:.1%}" if r["mfu"] is not None else "")
            + (f" | Recompiles: {r['recompiles']}" if self.compile else "")
            + f" | ETA {'after warm-up' if eta_s is None else fmt_duration(eta_s)}"
        )


def rewound(path: Path, step: int) -> bytes:
    """metrics.jsonl without the records after `step`: a killed run logged steps that the resumed run
    is about to redo (write_run_folder replaces the file with this atomically, so a kill during the
    rewrite costs no earlier history)."""
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, AttributeError):  # a line cut short by a kill is dropped
            if json.loads(line).get("step", 0) <= step:
                kept.append(line + "\n")
    return "".join(kept).encode()


class MetricsLogger:
    """Appends one JSON object per logged step; mirrors scalars to TensorBoard / W&B if asked.

    A failed write (a full disk) is a warning, said once, never the end of the run: the loop goes
    on to its next checkpoint, which is what a user needs to keep."""

    def __init__(self, run_dir: Path, config: dict, tensorboard: bool = False, wandb_project: str = ""):
        self.path = run_dir / "metrics.jsonl"
        self.file = open(self.path, "ab", buffering=0)  # each record one write(2), nothing held back
        self.tb = self.wandb = None
        self.failed = False
        if tensorboard:
            SummaryWriter = require("torch.utils.tensorboard", "--tensorboard", "tensorboard").SummaryWriter
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb_project:
            self.wandb = require("wandb", "--wandb").init(project=wandb_project, config=config, dir=str(run_dir))

    def log(self, record: dict) -> None:
        step = record["step"]
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        line = (json.dumps(record) + "\n").encode()
        end = self.file.seek(0, os.SEEK_END)
        try:
            if self.file.write(line) != len(line):
                self.file.truncate(end)  # a record is whole or absent, never half a line
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if self.tb is not None:
                for k, v in scalars.items():
                    self.tb.add_scalar(k, v, step)
                self.tb.flush()
        except OSError as e:
            self._warn(e)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def _warn(self, e: OSError) -> None:
        if not self.failed:
            print(
                f"fastpt: warning: could not write {self.path} ({e.strerror or e}); training goes on, "
                "later records may be missing",
                file=sys.stderr,
                flush=True,
            )
        self.failed = True

    def close(self) -> None:
        try:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
        except OSError as e:
            self._warn(e)
        if self.wandb is not None:
            self.wandb.finish()


# ---- a training run's folder and first lines


def unwritable(cfg: TrainConfig, e: OSError) -> ConfigError:
    return ConfigError(f"'out' = {cfg.out!r}: cannot write the run folder ({e.strerror or e})")


def own_run_folder(cfg: TrainConfig, cleanup: ExitStack) -> None:
    """One trainer per run folder, until `cleanup` closes: a second one is refused before it touches
    anything, and a run refused before it wrote anything leaves no folder behind (files.owned_folder)."""
    try:
        cleanup.enter_context(owned_folder(Path(cfg.out), "trainer"))
    except OSError as e:
        raise unwritable(cfg, e) from None


def write_run_folder(cfg: TrainConfig, data_dir: Path, step: int) -> MetricsLogger:
    """The data's tokenizer (the run folder alone is enough for fastpt.sample), metrics.jsonl rewound
    to `step`, and config.toml, which a resume starts from. All or none: each is written whole under a
    temporary name before any replaces its file (files.write_atomic_all), so a run refused here (a
    read-only folder, a full disk, a file-size limit) changes nothing in the folder. What a killed
    write left behind is deleted first (this trainer owns the folder)."""
    run_dir = Path(cfg.out)
    metrics = run_dir / "metrics.jsonl"
    try:
        contents = {run_dir / "tokenizer.json": run_tokenizer(data_dir)}
        contents[metrics] = rewound(metrics, step) if metrics.is_file() else None
        contents[run_dir / "config.toml"] = to_toml(cfg).encode()
        for path in contents:
            clear_temporaries(path)
        write_atomic_all(
            {path: lambda f, data=data: f.write(data) for path, data in contents.items() if data is not None}
        )
    except OSError as e:
        raise unwritable(cfg, e) from None
    return MetricsLogger(run_dir, dataclasses.asdict(cfg), cfg.tensorboard, cfg.wandb)


def speed_choices(cfg: TrainConfig) -> str:
    """What the summary line adds after 'compile True': the compile mode, AC, float8."""
    return (
        (f" ({cfg.compile_mode})" if cfg.compile and cfg.compile_mode != "default" else "")
        + (f" | AC {cfg.activation_checkpointing}" if cfg.activation_checkpointing != "none" else "")
        + (" | float8" if cfg.float8 else "")
    )


def recipe_choices(cfg: TrainConfig, model: ModelConfig) -> list[str]:
    """Each recipe setting (setting(..., recipe=True)) where the run differs from the seed: its
    default, or for a shape key (default None: the preset's) the seed's ModelConfig."""
    seed_model, choices = ModelConfig(), []
    for name, f in FIELDS.items():
        if f.metadata["recipe"]:
            shape_key = f.default is None
            value = getattr(model if shape_key else cfg, name)
            if value != (getattr(seed_model, name) if shape_key else f.default):
                choices.append(f"{name} {value}")
    return choices


def run_tokens(cfg: TrainConfig, dash: Dashboard) -> int:
    """The tokens the whole run trains: fewer than max_steps full steps under a batch warm-up."""
    return micro_batches(cfg, cfg.max_steps) * dash.tokens_per_step // cfg.grad_accum


def summary(cfg: TrainConfig, data: Data, params: int, dash: Dashboard, kernels: str) -> list[str]:
    """The lines a run starts with: where it writes and what it trains (`kernels`: the kernels in
    effect, selfcheck.Backend), on what data, and the recipe's choices that differ from the seed's."""
    peak, seq_len, device = dash.peak_flops, data.train.seq_len, dash.device
    return [
        f"run {cfg.out} | device {device_name(device)} x {dash.world_size} | "
        + (f"init from {cfg.init_from}" if cfg.init_from else f"preset {cfg.preset}")
        + f" | params {params:,} | dtype {cfg.dtype} | compile {cfg.compile}{speed_choices(cfg)} | "
        f"kernels {kernels} | threads {cfg.threads} | MFU "
        + (f"vs {peak / 1e12:.0f} TFLOP/s peak" if peak else f"n/a (no peak-FLOPs entry for {device_name(device)})"),
        f"data {describe_data(data.sources, data.train, data.val)} | packing {cfg.packing} | "
        f"{dash.tokens_per_step:,} tokens/step ({cfg.micro_batch} x {seq_len} x {cfg.grad_accum} accum x "
        f"{dash.world_size} ranks) | {cfg.max_steps:,} steps = {run_tokens(cfg, dash):,} tokens"
        + (
            f" (a batch warm-up from {cfg.batch_warmup_start} to {cfg.micro_batch * cfg.grad_accum} sequences "
            f"per rank over the first {cfg.batch_warmup_steps:,})"
            if cfg.batch_warmup_steps
            else ""
        ),
        f"recipe {cfg.recipe} | vs the seed's: "
        + (", ".join(recipe_choices(cfg, data.model_config)) or "none")
        + (f" | {unet_wiring(data.model_config.n_layers)}" if data.model_config.unet_skips else ""),
    ]
