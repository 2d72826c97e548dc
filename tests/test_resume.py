"""Exact resume after a hard kill, atomic checkpoints, history that is never lost, the non-finite
guard and a full disk during training.

Faults are injected from outside the trainer's code (tests/faults.py): a SIGKILL at a chosen point
(during a step, after a logged step, or halfway through writing a checkpoint), NaN losses at chosen
steps, a disk that fills up after a step, or a file-size limit that makes big writes fail like a
full disk (EFBIG, also for root). The uninterrupted run they must reproduce: conftest's `reference`."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import faults
from conftest import (
    REPO,
    assert_one_line_error,
    base_args,
    ckpt_names,
    folder_bytes,
    losses,
    mount_tmpfs,
    read_metrics,
    records,
    run_args,
    run_command_line,
    run_main,
    run_train,
    tiny_args,
    train_here,
    train_refuses,
)
from fastpt import checkpoint, files, metrics, train
from faults import run_faulty


def faulty_here(capsys, fault: str, at: int | str, *args: str) -> tuple[int, str, str]:
    """fastpt.train with a fault that leaves the process alive (NaN losses, a full disk), in this
    process: (exit code, stdout, stderr)."""
    assert fault in faults.IN_PROCESS
    with pytest.MonkeyPatch.context() as mp:
        faults.install(fault, str(at), list(args), mp.setattr)
        return run_main(train.main, list(args), capsys)


def test_reference_run_keeps_the_last_k_checkpoints(reference):
    assert ckpt_names(reference) == ["ckpt_00000008.pt", "ckpt_00000010.pt"]
    assert (reference / "latest").read_text() == "ckpt_00000010.pt"
    state = checkpoint.load(checkpoint.latest(reference))
    assert checkpoint.step_of(state) == 10 and state["loader"]["windows_consumed"] == 10 * 2 * 4
    assert not any(k.startswith("_orig_mod.") for k in state["model"])  # loads into eager and compiled
    assert [s for s, _ in losses(reference)] == list(range(1, 11))


@pytest.mark.parametrize(
    "log_every, ckpt_every",
    [  # (3, 4): a log window straddles the checkpoint
        pytest.param(1, 4, marks=pytest.mark.slow),
        (3, 4),
        pytest.param(4, 3, marks=pytest.mark.slow),
        pytest.param(5, 2, marks=pytest.mark.slow),
    ],
)
def test_resume_after_sigkill_logs_what_the_uninterrupted_run_logs(tiny_data, tmp_path, capsys, log_every, ckpt_every):
    """SIGKILL in the middle of a random step, resume: every record (loss averaged over a log window
    that straddles the checkpoint too, lr, grad norm, tokens, val loss) equals the uninterrupted run's."""
    every = ("--log-every", str(log_every), "--ckpt-every", str(ckpt_every))
    code, _, err = train_here(capsys, *run_args(tiny_data, tmp_path / "reference", *every))
    assert code == 0, err
    kill_at = random.randint(ckpt_every + 1, 10)
    run_dir = tmp_path / "run"
    killed = run_faulty("kill-at-step", kill_at, *run_args(tiny_data, run_dir, *every))
    assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stderr)
    code, out, err = train_here(capsys, *run_args(tiny_data, run_dir, *every), "--resume")
    assert code == 0, err
    saved_at = (kill_at - 1) // ckpt_every * ckpt_every
    assert f"at step {saved_at}" in out, kill_at
    assert records(run_dir) == records(tmp_path / "reference"), f"killed in step {kill_at}"


def test_sigkill_while_writing_a_checkpoint_leaves_the_previous_one(tiny_data, tmp_path, capsys, reference):
    killed = run_faulty("kill-in-save", 8, *run_args(tiny_data, tmp_path))
    assert killed.returncode == -signal.SIGKILL
    assert [p.name.split(".tmp")[0] for p in tmp_path.glob(".*.tmp*")] == [".ckpt_00000008.pt"]  # half written
    assert checkpoint.latest(tmp_path).name == "ckpt_00000004.pt"  # ... and never taken for a checkpoint
    assert checkpoint.step_of(checkpoint.load(checkpoint.latest(tmp_path))) == 4
    code, _, err = train_here(capsys, *run_args(tiny_data, tmp_path), "--resume")
    assert code == 0, err
    assert losses(tmp_path) == losses(reference)
    assert not list(tmp_path.glob(".*.tmp*"))  # the next save cleared the leftover


def test_nonfinite_loss_stops_naming_the_step(tiny_data, tmp_path, capsys):
    # Checked at log / checkpoint steps only (no per-step sync): found at step 8, named as step 6.
    code, _, err = faulty_here(capsys, "nan-at", "6", *run_args(tiny_data, tmp_path, "--log-every", "4"))
    assert code == 1
    assert (
        "fastpt: error: non-finite loss or gradient norm at step 6; stopped, the latest checkpoint "
        "(ckpt_00000004.pt) predates it"
    ) in err
    assert ckpt_names(tmp_path) == ["ckpt_00000004.pt"]  # nothing saved from the poisoned weights
    assert [s for s, _ in losses(tmp_path)] == [4]


def test_nonfinite_skip_mode_skips_counts_and_stops_after_max_skips(tiny_data, tmp_path, capsys):
    args = run_args(tiny_data, tmp_path, "--on-nonfinite", "skip", "--max-skips", "2")
    code, out, err = faulty_here(capsys, "nan-at", "3,5,6", *args)
    assert "step 3: non-finite loss or gradient norm, update skipped (1 in a row)" in out
    assert "step 6: non-finite loss or gradient norm, update skipped (2 in a row)" in out
    assert code == 1
    assert "fastpt: error: stopping at step 6: 2 consecutive non-finite steps (max_skips)" in err
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 4]  # step 4 trained on after the skip
    assert records[-1]["skipped_steps"] == 1 and np.isfinite(records[-1]["loss"])


def test_failed_checkpoint_write_is_reported_and_the_previous_one_kept(reference, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    args = run_args(tiny_data, run_dir, "--max-steps", "12", "--resume")
    result = run_faulty("file-size-limit", 1 << 20, *args)  # checkpoints are ~5 MB
    assert result.returncode == 1  # the final checkpoint is lost: not a success
    assert (
        f"could not write checkpoint {run_dir / 'ckpt_00000012.pt'}: File too large; ckpt_00000010.pt is intact"
    ) in result.stderr
    assert "Traceback" not in result.stderr
    assert checkpoint.latest(run_dir).name == "ckpt_00000010.pt"
    assert checkpoint.step_of(checkpoint.load(checkpoint.latest(run_dir))) == 10
    assert not list(run_dir.glob(".*.tmp*"))


# ---- history is never lost


def test_damaged_newest_checkpoints_fall_back_to_the_newest_intact_one(reference, tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)  # ckpt 8 and 10
    newest = run_dir / "ckpt_00000010.pt"
    os.truncate(newest, newest.stat().st_size // 2)
    (run_dir / "latest").write_bytes(b"\x00\xff not a name")  # a pointer that is not text is ignored
    torch.save({"weights": torch.ones(3)}, run_dir / "ckpt_00000011.pt")  # another program's torch file
    code, out, err = train_here(capsys, *run_args(tiny_data, run_dir, "--resume"))
    assert code == 0, err
    assert f"resumed from {run_dir / 'ckpt_00000008.pt'} at step 8" in out
    warnings = [line for line in err.splitlines() if "skipped a newer checkpoint" in line]
    assert len(warnings) == 2, err
    assert (
        f"{run_dir / 'ckpt_00000011.pt'} is not a fastpt checkpoint (no 'model_config', 'train_state')" in warnings[0]
    )
    assert f"could not read checkpoint {newest}" in warnings[1]
    assert losses(run_dir) == losses(reference)  # steps 9 and 10 trained again, identically


def test_a_fresh_run_never_erases_an_earlier_runs_metrics(tiny_data, tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    train_refuses(
        capsys,
        base_args(tiny_data, tmp_path),
        f"{tmp_path} holds an earlier run's metrics.jsonl (and no checkpoint): add --resume",
    )
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'


def test_metrics_rewind_is_atomic(tmp_path, monkeypatch):
    """A kill or a full disk while the resumed run drops the killed run's extra records must leave the
    old file whole: the rewrite goes to a temp file that replaces it only when complete."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 9)) + '{"step": 9, "lo')

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    def rewind() -> None:  # as write_run_folder rewrites it
        files.write_atomic(path, lambda f: f.write(metrics.rewound(path, 4)))

    monkeypatch.setattr(os, "replace", full_disk)
    before = path.read_text()
    with pytest.raises(OSError):
        rewind()
    assert path.read_text() == before and not list(tmp_path.glob(".*tmp*"))
    monkeypatch.undo()
    rewind()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


@pytest.fixture
def small_disk(tmp_path):
    """A real 24 MiB filesystem."""
    yield from mount_tmpfs(tmp_path / "disk", "24m")


def test_a_full_disk_is_survived_and_the_final_checkpoint_attempted(small_disk, tiny_data, capsys):
    """The disk fills after step 5: once the metrics file's last page is used up too, its writes
    become one warning; checkpoints fail with the OS's reason; the run still trains to the end and
    attempts its final checkpoint. Then, with space again, it resumes and relogs what was lost."""
    run_dir = small_disk / "run"
    args = run_args(tiny_data, run_dir, "--max-steps", "30")
    code, out, err = faulty_here(capsys, "fill-disk-after-step", 5, *args)
    assert code == 1, err  # the final checkpoint could not be written
    assert "Traceback" not in err
    assert err.count(f"fastpt: warning: could not write {run_dir / 'metrics.jsonl'}") == 1
    assert (
        f"could not write checkpoint {run_dir / 'ckpt_00000030.pt'}: No space left on device; "
        "ckpt_00000004.pt is intact"
    ) in err
    assert "Step    30/30" in out  # trained to the end
    logged = [s for s, _ in losses(run_dir)]
    assert logged[:5] == [1, 2, 3, 4, 5] and len(logged) < 30
    (run_dir / "filler").unlink()
    code, out, err = train_here(capsys, *args, "--resume")
    assert code == 0, err
    assert "at step 4" in out
    assert [s for s, _ in losses(run_dir)] == list(range(1, 31))


KILLED_REWIND = """
import os, signal, sys
from pathlib import Path
from fastpt import files, metrics
os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # the copy is complete, not yet renamed
path = Path(sys.argv[1])
files.write_atomic(path, lambda f: f.write(metrics.rewound(path, 4)))  # as write_run_folder rewrites it
"""


def test_a_rewind_killed_midway_keeps_the_history_and_the_next_resume_removes_its_copy(
    reference, tiny_data, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    history = (run_dir / "metrics.jsonl").read_bytes()
    killed = subprocess.run([sys.executable, "-c", KILLED_REWIND, str(run_dir / "metrics.jsonl")], cwd=REPO)
    assert killed.returncode == -signal.SIGKILL
    assert [p.name.split(".tmp")[0] for p in run_dir.glob(".metrics.jsonl.tmp*")] == [".metrics.jsonl"]
    assert (run_dir / "metrics.jsonl").read_bytes() == history
    code, _, err = train_here(capsys, *run_args(tiny_data, run_dir), "--resume")  # at step 10 of 10: nothing to train
    assert code == 0, err
    assert not list(run_dir.glob(".metrics.jsonl.tmp*"))
    assert (run_dir / "metrics.jsonl").read_bytes() == history


@pytest.mark.slow
def test_a_resume_refused_by_a_file_size_limit_changes_nothing_in_the_run_folder(bpe_data, tmp_path):
    """`ulimit -f 1`: the resume's writes fail (EFBIG), and it stops before training. The run
    folder's tokenizer.json (a BPE's, 21 KB: it was cut at 1 KiB, copied in place), metrics.jsonl and
    config.toml are as they were, no temporary file is left, and the next resume, without the limit, runs."""
    run_dir = tmp_path / "run"
    args = tiny_args(bpe_data, run_dir, max_steps=4, ckpt_every=2, log_every=1)
    assert run_train(*args, "--max-steps", "2").returncode == 0
    before = folder_bytes(run_dir)
    assert before["tokenizer.json"] == (bpe_data / "tokenizer.json").read_bytes()
    assert len(before["tokenizer.json"]) > 1024  # the limit falls inside it
    limited = run_command_line("train", *args, "--resume", fsize=1024)
    said = f"'out' = '{run_dir}': cannot write the run folder (File too large)"
    assert_one_line_error(limited.returncode, limited.stderr, said)
    after = folder_bytes(run_dir)
    assert after.pop(".lock") and before.pop(".lock")  # each trainer writes its pid there
    assert after == before
    resumed = run_train(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_the_soak_command_measures_and_resumes_exactly(tmp_path):
    """`python -m bench soak`, shortened: it samples the trainer, finds metrics.jsonl whole at every
    sample, and the run resumed from its second-newest checkpoint logs the same losses."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "soak",
            "--steps",
            "60",
            "--every",
            "20",
            "--warmup",
            "20",
            "--interval",
            "0.2",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "soak.json").read_text())
    assert summary["steps"] == 60 and summary["samples"] > 5 and summary["metrics_partial_samples"] == 0
    assert summary["resume"] == {"resumed_from": "ckpt_00000040.pt", "steps_redone": 20, "identical": True}
    assert summary["open_fds"]["max"] < 64 and summary["rss_mib"]["max"] > 0
    assert "per-step losses identical" in (tmp_path / "out" / "soak.md").read_text()
