"""Faults injected into fastpt.train from outside its code, in a real process (`python -c SCRIPT`:
a SIGKILL during a step, after a logged step or halfway through writing a checkpoint; a file-size
limit that makes big writes fail like a full disk, EFBIG, also for root; file permissions that hold
for root too: as_a_user; one torchrun rank's RMSNorm kernel 10% off, or its kernel check's probe
raising while it makes its inputs, or its checkpoint save starting only once rank 0's file is there)
or in this one through a MonkeyPatch (NaN losses at chosen steps, a disk that fills up after a step)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fastpt import checkpointer, metrics, model
from fastpt.kernels import functional, selftest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN_PROCESS = ("nan-at", "fill-disk-after-step")  # the faults that leave the process alive

# `python -c SCRIPT FAULT AT ARGS...`: fastpt.train with the fault installed (tests/ on the path).
SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import faults
from fastpt import errors, train
fault, at, argv = sys.argv[2], sys.argv[3], sys.argv[4:]
faults.install(fault, at, argv)
errors.run_command(lambda: train.main(argv))
"""


def install(fault: str, at: str, argv: list[str], patch: Callable = setattr) -> None:
    """Patch fastpt's logger, torch.save and the model's forward (with `patch`: setattr, or a
    MonkeyPatch's) to inject `fault` at step `at` into the run of `argv`."""
    steps = {int(s) for s in at.split(",")} if fault == "nan-at" else set()
    at = int(at) if at.isdigit() else None
    real_log, real_save, real_forward = metrics.MetricsLogger.log, torch.save, model.Transformer.forward
    accum = int(argv[argv.index("--grad-accum") + 1]) if "--grad-accum" in argv else 1
    train_forwards = 0

    def log(self, record):
        real_log(self, record)
        if fault == "kill-after-step" and record["step"] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "fill-disk-after-step" and record["step"] == at:
            with open(self.path.parent / "filler", "wb") as f:  # until the filesystem says ENOSPC
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass

    def save(obj, f, *args, **kwargs):
        if fault == "kill-in-save" and obj["train_state"]["step"] == at:
            f.write(b"half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(obj, f, *args, **kwargs)

    def forward(self, idx, labels=None, kv_cache=None, **kwargs):
        nonlocal train_forwards
        if labels is not None and self.training:
            train_forwards += 1
            step = (train_forwards - 1) // accum + 1
            if fault == "kill-at-step" and step == at:  # in the middle of the step, before its update
                os.kill(os.getpid(), signal.SIGKILL)
        out = real_forward(self, idx, labels, kv_cache, **kwargs)
        if labels is not None and self.training and step in steps:  # "nan-at": poison these steps' losses
            out = out._replace(loss=out.loss * float("nan"))
        return out

    if fault == "wrong-kernel-on-rank" and os.environ.get("RANK") == str(at):  # only that rank's kernel
        real_norm = functional.rms_norm
        patch(functional, "rms_norm", lambda *args: real_norm(*args) * 1.1)
    if fault == "probe-raises" and os.environ.get("RANK") == str(at):  # making its inputs, on that rank only

        def raises(*args, **kwargs):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

        patch(selftest, "probe_inputs", raises)
    if fault == "late-save-on-rank" and os.environ.get("RANK") == str(at):  # once rank 0 has written the step
        real_save_step = checkpointer.save

        def late(run_dir, step, *args, **kwargs):
            written, deadline = Path(run_dir) / f"ckpt_{step:08d}.pt", time.monotonic() + 60
            while not written.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return real_save_step(run_dir, step, *args, **kwargs)

        patch(checkpointer, "save", late)
    if fault == "file-size-limit":
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (at, resource.RLIM_INFINITY))
    patch(metrics.MetricsLogger, "log", log)
    patch(torch, "save", save)
    patch(model.Transformer, "forward", forward)


def as_a_user() -> None:
    """A subprocess's preexec_fn: file permissions then stop it as they stop a user (chmod 000 is
    unreadable). Root reads any file through CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: dropped from
    the bounding set, the program it runs never holds them; a user holds neither to drop."""
    if os.geteuid() != 0:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0):  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def script_args(fault: str, at: int | str, *args: str, nproc: int = 0) -> list[str]:
    """The command line of a real process running fastpt.train with `fault` (see SCRIPT); nproc > 0
    launches it under torchrun with that many processes (gloo on CPU, a free port)."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "--no-python"]
    here = os.path.dirname(os.path.abspath(__file__))
    return [sys.executable, *([*torchrun, sys.executable] if nproc else []), "-c", SCRIPT, here, fault, str(at), *args]


def run_faulty(fault: str, at: int | str, *args: str) -> subprocess.CompletedProcess:
    """fastpt.train with `fault` in a real process (a kill, a file-size limit): SCRIPT's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(script_args(fault, at, *args), capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
