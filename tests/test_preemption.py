"""Preemption's exit code: a run stopped by SIGTERM or Ctrl-C checkpoints, then exits 143 or 130 (128 +
the signal, as a shell reports it), so `train && export` and torchrun's restart policy see an
unfinished run; 1 when that checkpoint could not be written. In this process: the signal comes
from the run itself, after a chosen step (the real process and torchrun: test_signals.py and
test_distributed.py)."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import pytest

from conftest import run_main, tiny_args
from fastpt import checkpoint, integrity, train


def signal_after_step(monkeypatch, at: int, sig: int) -> None:
    """The run sends itself `sig` once its step `at` has run, as a scheduler or Ctrl-C would."""
    real, steps = train.train_step, []

    def step_then_signal(*args, **kwargs):
        result = real(*args, **kwargs)
        steps.append(1)
        if len(steps) == at:
            os.kill(os.getpid(), sig)
        return result

    monkeypatch.setattr(train, "train_step", step_then_signal)


def args(data: Path, out: Path, *extra: str) -> list[str]:
    return tiny_args(data, out, *extra, max_steps=8, log_every=1, eval_every=1000, ckpt_every=1000)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_preempted_run_checkpoints_and_exits_128_plus_the_signal(tiny_data, tmp_path, capsys, monkeypatch, sig):
    signal_after_step(monkeypatch, 2, sig)
    code, out, _ = run_main(train.main, args(tiny_data, tmp_path), capsys)
    assert code == 128 + sig == {signal.SIGTERM: 143, signal.SIGINT: 130}[sig]
    name = signal.Signals(sig).name
    assert f"preempted: stopped after step 2; continue with --resume (exit {code}: {name})" in out
    saved = checkpoint.latest(tmp_path)
    assert saved.name == "ckpt_00000002.pt" and integrity.verify(saved, checkpoint.STATE_FILE)
    monkeypatch.undo()
    code, out, _ = run_main(train.main, args(tiny_data, tmp_path, "--resume", "--max-steps", "3"), capsys)
    assert code == 0 and f"resumed from {saved} at step 2" in out


def test_a_preempted_run_whose_checkpoint_fails_exits_1(tiny_data, tmp_path, capsys, monkeypatch):
    """A write past `ulimit -f` fails like a full disk: the checkpoint --resume needs is missing."""
    signal_after_step(monkeypatch, 2, signal.SIGTERM)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, not death
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limit[1]))  # checkpoints are ~5 MB
    try:
        code, out, err = run_main(train.main, args(tiny_data, tmp_path), capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    assert code == 1
    assert f"fastpt: warning: could not write checkpoint {tmp_path / 'ckpt_00000002.pt'}: File too large" in err
    assert "preempted: stopped after step 2 by SIGTERM, its checkpoint failed; exit 1" in err
    assert checkpoint.latest(tmp_path) is None
