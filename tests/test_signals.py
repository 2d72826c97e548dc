"""A real trainer process and the signals a user or a scheduler sends it: SIGTERM and Ctrl-C
checkpoint and exit 128 + the signal, Ctrl-C while importing is one line, a SIGKILLed trainer
leaves no lock on its run folder (one owner per folder), and a closed pipe does not end a run.
(Preemption in this process: test_preemption.py; under torchrun: test_distributed.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, base_args, losses, run_args, run_train, train_here
from fastpt import checkpoint


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)], ids=["SIGTERM", "SIGINT"]
)
def test_preemption_checkpoints_exits_128_plus_the_signal_and_resumes(tiny_data, tmp_path, sig):
    args = (
        *TINY,
        "--data",
        str(tiny_data),
        "--out",
        str(tmp_path),
        "--log-every",
        "1",
        "--eval-every",
        "1000",
        "--ckpt-every",
        "1000",
    )
    with open(tmp_path / "stdout.txt", "w") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fastpt.train", *args, "--max-steps", "1000"],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while "Step" not in (tmp_path / "stdout.txt").read_text():  # training has begun
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == 128 + sig, proc.stderr.read()
    stopped = checkpoint.step_of(checkpoint.load(checkpoint.latest(tmp_path)))
    assert 1 <= stopped < 1000
    said = (tmp_path / "stdout.txt").read_text()
    assert f"preempted: stopped after step {stopped}; continue with --resume" in said
    # The kernel choice is not part of the model: a checkpoint resumes under another one.
    resumed = run_train(*args, "--max-steps", str(stopped + 2), "--resume", "--kernels", "torch")
    assert resumed.returncode == 0, resumed.stderr
    assert [s for s, _ in losses(tmp_path)] == list(range(1, stopped + 3))


# ---- one owner per run folder


def start_train(*args: str, stdout) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fastpt.train", *args],
        cwd=REPO,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def wait_for(text: str, path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)


def test_a_second_trainer_on_the_same_folder_is_refused_and_a_killed_one_leaves_no_lock(tiny_data, tmp_path, capsys):
    args = (
        *TINY,
        "--data",
        str(tiny_data),
        "--out",
        str(tmp_path / "run"),
        "--log-every",
        "1",
        "--ckpt-every",
        "2",
        "--eval-every",
        "1000",
    )
    with open(tmp_path / "first.txt", "w") as stdout:
        first = start_train(*args, "--max-steps", "100000", stdout=stdout)
        wait_for("saved", tmp_path / "first.txt", first)
        code, _, err = train_here(capsys, *args, "--max-steps", "100000", "--resume")
        assert code == 2
        assert err == (
            f"fastpt: error: {tmp_path / 'run'} is in use by another trainer (pid {first.pid} "
            f"on {socket.gethostname()}); wait for it to end or choose another --out\n"
        )
        first.kill()
        first.wait()
    saved = checkpoint.step_of(checkpoint.load(checkpoint.latest(tmp_path / "run")))
    code, _, err = train_here(capsys, *args, "--max-steps", str(saved + 1), "--resume")  # SIGKILL left no stale lock
    assert code == 0, err


# ---- Ctrl-C


def test_ctrl_c_while_importing_is_one_line_and_exit_130(tiny_data, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastpt.train", *base_args(tiny_data, tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text():  # `import torch` is under way
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "fastpt: error: interrupted\n"


@pytest.mark.slow
def test_a_run_outlives_the_reader_of_its_output(tiny_data, tmp_path):
    """`python -m fastpt.train ... | head -3`: the pipe closes, the run goes on to its last step and
    checkpoint, its metrics.jsonl whole, and exits 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastpt.train", *run_args(tiny_data, tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    for _ in range(3):
        proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()
    assert checkpoint.latest(tmp_path).name == "ckpt_00000010.pt"
    assert [step for step, _ in losses(tmp_path)] == list(range(1, 11))
