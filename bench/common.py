"""What every benchmark records and prints: environment, device sync, memory, markdown."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch

from fastpt.errors import ConfigError
from fastpt.files import check_output
from fastpt.metrics import device_name

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()


def git_commit() -> str:
    """HEAD (+dirty with changes to tracked files: a user's data/ or runs/ beside the code is not a
    change to it); FASTPT_COMMIT wins, e.g. on a machine without .git."""
    if os.environ.get("FASTPT_COMMIT"):
        return os.environ["FASTPT_COMMIT"]
    try:
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        return _git("rev-parse", "--short=12", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for name in ("triton", "liger_kernel"):
        try:
            out[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            out[name] = None
    return out


def env_info(device: torch.device) -> dict:
    """Device, versions, commit and date: every stored figure carries these."""
    return {
        "device": device.type,
        "device_name": device_name(device),
        **versions(),
        "cpu_threads": torch.get_num_threads(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def sync(device: torch.device) -> None:
    """Wait for queued device work, so a host timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def cpu_threads(n: int):
    """torch's intra-op CPU threads set to n inside the block (0 = leave them alone)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rss_gib() -> float:
    """This process's current resident set (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def _matmul_ms(device: torch.device, n: int) -> float:
    from triton.testing import do_bench

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")


def matmul_tflops(device: torch.device, n: int = 8192) -> float | None:
    """A bf16 n x n x n matmul's TFLOP/s measured now: the ceiling MFU is also quoted against."""
    if device.type != "cuda":
        return None
    ms = _matmul_ms(device, n)
    torch.cuda.empty_cache()  # the benchmarked modes run in child processes: leave them the memory
    return 2 * n**3 / (ms * 1e-3) / 1e12


def cuda_context_gib(device: torch.device) -> float | None:
    """What this CUDA process holds outside torch's allocator after a matmul (context, kernels,
    cuBLAS): the card's used memory less torch's reserve. fastpt.plan assumes gpus.CUDA_CONTEXT."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return (total - free - torch.cuda.memory_reserved(device)) / 2**30


def kernel_rows_note(device: torch.device, rows: str) -> str:
    """What the `rows` of a table that ran fastpt's kernels ran: said on a CPU, where it is not them."""
    if device.type == "cuda":
        return ""
    from fastpt.kernels import api as kernels

    if kernels.interpreting():
        return f"{rows} run the Triton kernels through Triton's CPU interpreter (TRITON_INTERPRET=1), not compiled"
    return f"on a CPU {rows} run the PyTorch reference, not the Triton kernels, unless TRITON_INTERPRET=1"


def fmt(value, spec: str = ".3g") -> str:
    return "–" if value is None else format(value, spec)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def check_outputs(ap: argparse.ArgumentParser, args: argparse.Namespace, *flags: str) -> None:
    """Refuse, before any benchmark runs, an output file (--json, --markdown) that writing would cost the
    user something (files.check_output): a folder, a training run's own file, a read-only file."""
    for flag in flags:
        if path := getattr(args, flag):
            try:
                check_output(path, f"--{flag}")
            except ConfigError as e:
                ap.error(str(e))
