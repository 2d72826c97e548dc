"""Train-step benchmark: tok/s, step time, peak memory, MFU, compile time and final loss per mode.

A mode is `eager`, `compiled` or `baseline`, optionally followed by "+"-joined options:
  kernels       fastpt's Triton kernels (on a CPU they dispatch to the reference: same as without)
  autotune      torch.compile(mode="max-autotune-no-cudagraphs")
  cudagraphs    torch.compile(mode="reduce-overhead"), i.e. CUDA graphs (CUDA only, else skipped);
                with autotune: mode="max-autotune"
  ac            activation checkpointing of every block (--activation-checkpointing full)
  ac-selective  ... of every other block (selective)
  float8        torchao float8 linears (--float8; CUDA with compute capability >= 8.9, else skipped)
`eager` / `compiled` run fastpt's model with the pure-PyTorch ops unless +kernels is given, compiled
as fastpt.train compiles it; `baseline` is bench/baseline.py (plain PyTorch, the peer) under
torch.compile. E.g. `compiled+kernels+ac`, `compiled+kernels+autotune+cudagraphs`.

Every mode runs in its own process (clean allocator, compile caches in memory and peak RSS)
on the same initial weights and the same batches, so in fp32 the final losses must agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench import baseline
from bench.common import REPO, check_outputs, cuda_context_gib, env_info, matmul_tflops, rss_gib, sync
from bench.train_step_report import add_mfu, losses_agree, markdown
from fastpt import float8, settings
from fastpt.config import CUDA_GRAPH_MODES, DTYPES, PRESETS, TrainConfig
from fastpt.data.dataset import Windows, data_vocab, find_shards
from fastpt.data.loader import TrainLoader
from fastpt.data.shards import write_shard
from fastpt.distributed import Dist, parallelize
from fastpt.errors import FastptError, fail
from fastpt.files import write_output
from fastpt.hf import write_json
from fastpt.metrics import peak_flops, peak_mem_gib
from fastpt.model import LossOutput, Transformer
from fastpt.optim import build_optimizer
from fastpt.plan import gpus, planner, timing
from fastpt.presets import MAX_SEQ_LEN, model_config
from fastpt.profiling import compiled_graphs
from fastpt.settings import THREADS, Interval
from fastpt.step import Net, train_step


class Baseline(baseline.GPT):
    """The peer, its seed-style (logits, loss, None) returned as the LossOutput train_step reads."""

    def forward(self, idx, labels=None):
        _, loss, _ = super().forward(idx, labels)
        return LossOutput(None, loss, loss.detach().new_zeros(()))


# (autotune, cudagraphs) -> torch.compile mode
COMPILE_MODES = {
    (False, False): "default",
    (True, False): "max-autotune-no-cudagraphs",
    (False, True): "reduce-overhead",
    (True, True): "max-autotune",
}
AC_OPTIONS = {"ac": "full", "ac-selective": "selective"}
OPTIONS = {"kernels", "autotune", "cudagraphs", "float8", *AC_OPTIONS}
# micro-batch, grad-accum per preset: 0.04b at 32 x 1024, accum 2 (the reference job's 64k tokens/step);
# 0.35b and 1b at their trainer micro-batch, one micro-step (memory and speed of the levers there)
BATCH = {"0.04b": (32, 2), "tiny": (8, 1), "0.1b": (16, 1), "0.35b": (16, 1), "1b": (8, 1)}
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}  # bf16 rounding differs between kernels and compile
TRAIN = TrainConfig()  # fastpt.train's optimizer defaults, used by every mode
RANDOM_TOKENS = 1 << 22
MIN_MODE_S = 20  # a mode started with less time than this left could not even compile


@dataclass(frozen=True)
class Mode:
    name: str
    impl: str  # fastpt | baseline
    compile: bool
    kernels: bool
    compile_mode: str  # torch.compile's mode when compiled
    activation_checkpointing: str = "none"
    float8: bool = False


def parse_mode(name: str) -> Mode:
    base, *options = name.split("+")
    if base not in ("eager", "compiled", "baseline") or set(options) - OPTIONS or len(options) != len(set(options)):
        raise ValueError(
            f"bad mode {name!r}: eager|compiled|baseline [+kernels] [+autotune] [+cudagraphs] "
            "[+ac|+ac-selective] [+float8]"
        )
    autotune, cudagraphs = "autotune" in options, "cudagraphs" in options
    ac = [AC_OPTIONS[o] for o in options if o in AC_OPTIONS]
    if (autotune or cudagraphs) and base == "eager":
        raise ValueError(f"bad mode {name!r}: autotune and cudagraphs need compiled or baseline")
    if base == "baseline" and set(options) - {"autotune", "cudagraphs"}:
        raise ValueError(f"bad mode {name!r}: kernels, ac and float8 are fastpt's, not the baseline's")
    if len(ac) > 1:
        raise ValueError(f"bad mode {name!r}: one of ac, ac-selective")
    return Mode(
        name,
        "baseline" if base == "baseline" else "fastpt",
        base != "eager",
        "kernels" in options,
        COMPILE_MODES[autotune, cudagraphs],
        ac[0] if ac else "none",
        "float8" in options,
    )


@dataclass
class Setup:
    """Everything a mode's process needs to rebuild the same model, data and schedule."""

    preset: str
    device: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    dtype: str
    data_dir: str
    seed: int = 1337
    lr: float = TRAIN.lr
    threads: int = 0  # CPU threads; 0 = torch's default
    plan: bool = True  # also plan the mode's GPU peak over fake tensors (fastpt.plan)


def unavailable(mode: Mode, setup: Setup) -> str | None:
    """Why the mode's lever cannot run on this device or at this setup (the row says so), or None."""
    device = torch.device(setup.device)
    if mode.compile_mode in CUDA_GRAPH_MODES and device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if mode.compile_mode in CUDA_GRAPH_MODES and setup.grad_accum > 1:
        return "CUDA graphs need --grad-accum 1 (as fastpt.train refuses them otherwise)"
    if mode.float8:
        try:
            float8.check(device)
        except FastptError as e:
            return str(e)
    return None


@dataclass
class Run:
    step: Callable[[], torch.Tensor]  # one optimizer step of fastpt.train; returns its mean loss on device
    loader: TrainLoader
    params: int
    flops_per_token: float
    tokens_per_step: int
    model: torch.nn.Module  # the module trained (before compiling): its parameters
    optimizer: torch.optim.Optimizer


def build(setup: Setup, mode: Mode, backend: str | None = None) -> Run:
    """A fresh model (same seed, so the same weights in every mode), its optimizer and loader; the
    kernels' backend follows the device unless given."""
    device = torch.device(setup.device)
    shards = find_shards(setup.data_dir, "train")
    backend = backend or (("triton" if device.type == "cuda" else "auto") if mode.kernels else "torch")
    cfg = model_config(
        TrainConfig(preset=setup.preset, seq_len=setup.seq_len), data_vocab(Path(setup.data_dir), shards, False)
    )
    torch.manual_seed(setup.seed)
    # built on the CPU: identical weights on every device
    fastpt_model = Transformer(cfg, backend, activation_checkpointing=mode.activation_checkpointing)
    betas = (TRAIN.beta1, TRAIN.beta2)
    if mode.impl == "baseline":
        model = Baseline(baseline.GPTConfig.like(cfg))
        model.load_llama_state(fastpt_model.state_dict())
        model = on_device(model, device)
        optimizer = model.configure_optimizers(TRAIN.weight_decay, setup.lr, betas)
    else:
        model = on_device(fastpt_model, device)
        if mode.float8:
            float8.convert(model)
        optimizer = build_optimizer(model, TRAIN.weight_decay, "ndim", setup.lr, betas, TRAIN.eps)  # = nanoGPT groups
    # compiled in place as fastpt.train compiles one process
    net = parallelize(model, Dist(), "ddp", DTYPES[setup.dtype], mode.compile_mode if mode.compile else None)
    loader = TrainLoader(Windows(shards, setup.seq_len), setup.micro_batch, setup.seed, device)
    autocast = torch.autocast(device.type, dtype=DTYPES[setup.dtype], enabled=setup.dtype != "fp32")
    scaler = torch.amp.GradScaler(device.type, enabled=setup.dtype == "fp16")  # as fastpt.train builds it
    step_cfg = dataclasses.replace(TRAIN, grad_accum=setup.grad_accum)
    step = lambda: train_step(Net(model, net, [optimizer], autocast, scaler), loader, step_cfg).loss
    return Run(
        step,
        loader,
        fastpt_model.num_params(),
        fastpt_model.cfg.flops_per_token(setup.seq_len),
        setup.micro_batch * setup.seq_len * setup.grad_accum,
        model,
        optimizer,
    )


def on_device(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The module moved to device (in place); one built there already is left as it is (a plan's
    fake modules cannot move)."""
    return module if next(module.parameters()).device == device else module.to(device)


def planned(setup: Setup, mode: Mode) -> dict:
    """What fastpt.plan predicts for this mode's step on a GPU, the same build traced over fake
    tensors: torch.cuda.max_memory_allocated (GiB) and the step's time on planned_card() (ms, tok/s);
    nothing for CUDA graphs, whose pools it does not model."""
    if mode.compile_mode in CUDA_GRAPH_MODES:
        return {}
    with planner.fake_run("cuda", 1, mode.compile) as (_, mem):
        run = build(dataclasses.replace(setup, device="cpu"), mode, "triton" if mode.kernels else "torch")
        try:
            with timing.KernelTrace(mem) as timed:
                planner.trace_steps(mem, run.step, run.model, [run.optimizer], "cuda")
        finally:
            run.loader.close()
    step = max(op.step for op in timed.ops)
    ops = [op for op in timed.ops if op.step == step]
    log = timing.KernelLog(ops, setup.grad_accum, setup.grad_accum, 1, run.tokens_per_step, run.flops_per_token)
    planned_step = timing.step_time(log, gpus.speed_of(planned_card()))
    return {
        "planned_gib": planner.peak_of(mem, "cuda", setup.grad_accum).bytes / 2**30,
        "planned_step_ms": planned_step.seconds * 1e3,
        "planned_tok_s": planned_step.tok_s,
    }


def planned_card() -> gpus.Card:
    """The card a step's time is planned on: this machine's GPU where it has a known one, else an H100."""
    here = gpus.card("") if torch.cuda.is_available() else None
    return here if here is not None and gpus.speed_of(here) else gpus.card("h100-80")


def measure(setup: Setup, mode: Mode, steps: int, warmup: int) -> dict:
    """Warm up (compiles), then time `steps` steps with one device sync at the end, like training."""
    device = torch.device(setup.device)
    if setup.threads:
        torch.set_num_threads(setup.threads)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = rss_gib() if device.type == "cpu" else 0.0  # on a CPU the table shows the growth
    run = build(setup, mode)
    t0 = time.perf_counter()
    for _ in range(warmup):
        run.step()
    sync(device)
    warmup_s = time.perf_counter() - t0
    graphs = compiled_graphs()  # must not grow after warm-up
    run.loader.wait_s = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = run.step()
    sync(device)
    elapsed = time.perf_counter() - t0
    run.loader.close()
    peak = peak_mem_gib(device) - rss_before
    return {
        "mode": mode.name,
        "tok_s": run.tokens_per_step * steps / elapsed,
        "step_ms": 1e3 * elapsed / steps,
        "peak_mem_gib": peak,
        "loss": loss.item(),
        "compile_s": max(0.0, warmup_s - warmup * elapsed / steps),  # warm-up time beyond steady steps
        "data_wait_pct": 100 * run.loader.wait_s / elapsed,
        "graphs_after_warmup": compiled_graphs() - graphs,
        "params": run.params,
        "flops_per_token": run.flops_per_token,
        "tokens_per_step": run.tokens_per_step,
        "cpu_threads": torch.get_num_threads(),
    } | (planned(setup, mode) if setup.plan else {})  # after the timing: CPU work


def measure_isolated(setup: Setup, mode: Mode, steps: int, warmup: int, timeout: float | None) -> dict:
    """measure() in a fresh Python process; a crash or timeout becomes a row with an error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        spec = json.dumps({"setup": dataclasses.asdict(setup), "mode": mode.name, "steps": steps, "warmup": warmup})
        try:
            proc = subprocess.run([sys.executable, "-m", "bench.train_step", spec, str(out)], timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"mode": mode.name, "error": f"timed out after {timeout:.0f} s"}
        if proc.returncode or not out.is_file():
            return {"mode": mode.name, "error": f"process exited with code {proc.returncode}"}
        return json.loads(out.read_text())


def run_mode(setup: Setup, mode: Mode, steps: int, warmup: int, timeout: float | None, deadline: float) -> dict:
    """One row: skipped when the device lacks the mode's lever or the time budget is spent, else
    measured in its own process, within the mode timeout and the budget."""
    if why := unavailable(mode, setup):
        return {"mode": mode.name, "skipped": why}
    left = deadline - time.monotonic()
    if left < MIN_MODE_S:
        return {"mode": mode.name, "skipped": f"out of time ({max(left, 0):.0f} s of --time-budget left)"}
    print(f"bench: {mode.name} ...", file=sys.stderr, flush=True)
    limit = min(timeout or math.inf, left)
    return measure_isolated(setup, mode, steps, warmup, None if limit == math.inf else limit)


def prepare_data(spec: str, tmp: Path, vocab: int) -> tuple[Path, str]:
    """repo: this repository's .py files as bytes (real text, seconds to make). random: uniform
    tokens (pure step throughput). default: fastpt's default corpus. Anything else: a shard folder."""
    if spec == "repo":
        from fastpt.prepare import prepare

        files = sorted(p for d in ("fastpt", "kernels", "bench", "tests") for p in (REPO / d).rglob("*.py"))
        meta = prepare(files, tmp / "repo", "bytes")
        return tmp / "repo", f"repo sources ({len(files)} .py files, {meta['tokens']['train']:,} byte tokens)"
    if spec == "random":
        vocab = vocab or 257
        (tmp / "random").mkdir()
        tokens = np.random.default_rng(0).integers(0, vocab, RANDOM_TOKENS)
        write_shard(tmp / "random" / "train_000000.bin", tokens, vocab)
        return tmp / "random", f"random tokens (uniform over {vocab:,}, pure step throughput)"
    if spec == "default":
        from fastpt.prepare import default_corpus

        return default_corpus(vocab or 4096), "default corpus (stdlib sources, BPE)"
    return Path(spec), f"shards in {spec}"


class OneLineParser(argparse.ArgumentParser):
    """A mistake on the command line is one line and exit 2 (no usage dump), as fastpt's commands say it."""

    def error(self, message: str):
        fail(f"{self.prog}: {message}")
        sys.exit(2)


def within(domain: Interval, kind: type = int) -> Callable[[str], float]:
    """An argparse type: `kind` of the text, in `domain` (finite), else the flag's one-line error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value not in domain:
            raise argparse.ArgumentTypeError(f"must be {domain}, got {text}")
        return value

    return parse


STEPS = Interval(1, 10**6)  # timed steps of a mode: a million is days of a 0.04b step
WARMUP = Interval(0, STEPS.high)
MODE_SECONDS = Interval(0, 10**6, low_open=True)
BUDGET_SECONDS = Interval(MIN_MODE_S, 10**6)  # below MIN_MODE_S no mode would start


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags; defaults follow the device: 0.04b in bf16 on CUDA, tiny in fp32 on a CPU."""
    cuda = torch.cuda.is_available()
    ap = OneLineParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="python -m bench kernels --help: the kernel table",
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu")
    ap.add_argument("--preset", choices=tuple(PRESETS), help="default: 0.04b on CUDA, tiny on CPU")
    ap.add_argument("--steps", type=within(STEPS), help="timed steps per mode (default: 20 on CUDA, 10 on CPU)")
    ap.add_argument("--warmup", type=within(WARMUP), default=3, help="untimed steps first (they compile)")
    ap.add_argument("--micro-batch", type=within(settings.BATCH), help="default: 32 for 0.04b, 8 for tiny")
    ap.add_argument("--grad-accum", type=within(settings.BATCH), help="default: 2 for 0.04b, 1 for tiny")
    ap.add_argument("--seq-len", type=within(Interval(1, MAX_SEQ_LEN)), help="default: the preset's")
    ap.add_argument("--dtype", choices=tuple(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument(
        "--modes",
        help="comma-separated modes, see above (default: eager,compiled,"
        "compiled+kernels,baseline on CUDA, eager,compiled,baseline on CPU)",
    )
    ap.add_argument(
        "--threads",
        type=within(THREADS),
        default=0,
        help="CPU threads per mode (default: torch's); 1 steadies a busy shared machine",
    )
    ap.add_argument("--data", default="repo", help="repo | random | default | a folder of shards")
    ap.add_argument(
        "--no-plan", dest="plan", action="store_false", help="leave out the planned GPU peak (fastpt.plan) of each mode"
    )
    ap.add_argument("--json", help="write every row (and the table) here")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument(
        "--mode-timeout", type=within(MODE_SECONDS, float), help="seconds per mode before it counts as failed"
    )
    ap.add_argument(
        "--time-budget",
        type=within(BUDGET_SECONDS, float),
        help=f"seconds for all modes: a mode is skipped when less than {MIN_MODE_S} s are left, and none runs past it",
    )
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    if gpu and not cuda:
        ap.error("--device cuda but torch sees no CUDA device")
    check_outputs(ap, args, "json", "markdown")
    args.preset = args.preset or ("0.04b" if gpu else "tiny")
    args.steps = args.steps or (20 if gpu else 10)
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    args.micro_batch = args.micro_batch or BATCH[args.preset][0]
    args.grad_accum = args.grad_accum or BATCH[args.preset][1]
    args.seq_len = args.seq_len or PRESETS[args.preset].max_seq_len
    modes = args.modes or ("eager,compiled,compiled+kernels,baseline" if gpu else "eager,compiled,baseline")
    try:
        args.modes = [parse_mode(m) for m in modes.split(",")]
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every mode, print the table; non-zero when a mode fails or the losses disagree."""
    args = parse_args(argv)
    device = torch.device(args.device)
    env = env_info(device)
    ceiling = matmul_tflops(device)
    context = cuda_context_gib(device)  # after the matmul: cuBLAS loaded
    peak = peak_flops(env["device_name"]) if device.type == "cuda" else None
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, data_desc = prepare_data(args.data, Path(tmp), PRESETS[args.preset].vocab_size)
        setup = Setup(
            args.preset,
            args.device,
            args.micro_batch,
            args.grad_accum,
            args.seq_len,
            args.dtype,
            str(data_dir),
            threads=args.threads,
            plan=args.plan,
        )
        deadline = time.monotonic() + (math.inf if args.time_budget is None else args.time_budget)
        rows = [run_mode(setup, mode, args.steps, args.warmup, args.mode_timeout, deadline) for mode in args.modes]
    add_mfu(rows, peak, ceiling)
    info = {
        **env,
        **dataclasses.asdict(setup),
        "data": data_desc,
        "steps": args.steps,
        "warmup": args.warmup,
        "matmul_tflops": ceiling,
        "cuda_context_gib": context,
        "peak_tflops": peak and peak / 1e12,
        "params": next((r["params"] for r in rows if "params" in r), 0),
        "cpu_threads": next((r["cpu_threads"] for r in rows if "cpu_threads" in r), env["cpu_threads"]),
        "tokens_per_step": args.micro_batch * args.seq_len * args.grad_accum,
    }
    del info["data_dir"]  # a temporary folder, gone by now
    agree = losses_agree(rows, LOSS_RTOL[args.dtype])
    table = markdown(rows, info, planned_card().name)
    print(table)
    measured = any("loss" in r for r in rows)
    failed = "FAILED: a mode errored or the losses disagree" if measured else "FAILED: no mode ran"
    verdict = "losses agree" if agree else failed
    first = next((r["mode"] for r in rows if "loss" in r), "none measured")
    print(f"\n{verdict} (relative tolerance {LOSS_RTOL[args.dtype]:g} vs {first})")
    if args.json:
        write_json(
            args.json,
            {"kind": "train_step", "losses_agree": agree, "markdown": table, "rows": [{**info, **r} for r in rows]},
        )
    if args.markdown:
        write_output(args.markdown, lambda f: f.write((table + "\n").encode()))
    return 0 if agree else 1


if __name__ == "__main__":  # the per-mode child process of measure_isolated()
    job = json.loads(sys.argv[1])
    row = measure(Setup(**job["setup"]), parse_mode(job["mode"]), job["steps"], job["warmup"])
    Path(sys.argv[2]).write_text(json.dumps(row))
