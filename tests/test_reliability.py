"""Reliability: exact resume after a hard kill, atomic checkpoints, preemption, the non-finite
guard, a full disk, one owner per run folder, and one clear line for every bad input.

Faults are injected from outside the trainer's code: FAULTY_TRAIN runs `fastpt.train` with a
SIGKILL at a chosen point (during a step, after a logged step, or halfway through writing a
checkpoint), NaN losses at chosen steps, a disk that fills up after a step, or a file-size limit
that makes big writes fail like a full disk (EFBIG, also for root).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import faults
from conftest import (
    REPO,
    TINY,
    assert_one_line_error,
    read_metrics,
    run_main,
    run_quietly,
    run_train,
    tiny_args,
    train_refuses,
)
from fastpt import checkpoint, files, metrics, train
from fastpt.config import FIELD_TYPES, FIELDS
from fastpt.data.shards import write_shard
from fastpt.errors import ELSEWHERE


def run_faulty(fault: str, at: int | str, *args: str) -> subprocess.CompletedProcess:
    """fastpt.train with `fault` in a real process (a kill, a file-size limit): tests/faults.py."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        faults.script_args(fault, at, *args), capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )


def faulty_here(capsys, fault: str, at: int | str, *args: str) -> tuple[int, str, str]:
    """fastpt.train with a fault that leaves the process alive (NaN losses, a full disk), in this
    process: (exit code, stdout, stderr)."""
    assert fault in faults.IN_PROCESS
    with pytest.MonkeyPatch.context() as mp:
        faults.install(fault, str(at), list(args), mp.setattr)
        return run_main(train.main, list(args), capsys)


def train_here(capsys, *args: str) -> tuple[int, str, str]:
    """python -m fastpt.train's work in this process: (exit code, stdout, stderr)."""
    return run_main(train.main, list(args), capsys)


def run_args(data: Path, out: Path, *extra: str) -> list[str]:
    """10 steps of 2 micro-batches, every step logged, checkpoints at 4 and 8 (keep 2) and the end."""
    flags = dict(max_steps=10, grad_accum=2, log_every=1, eval_every=5, ckpt_every=4, keep_checkpoints=2)
    return tiny_args(data, out, *extra, **flags)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


def ckpt_names(run_dir: Path) -> list[str]:
    return [p.name for p in checkpoint.checkpoints(run_dir)]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    code, _, err = run_quietly(train.main, run_args(tiny_data, out))
    assert code == 0, err
    return out


def test_reference_run_keeps_the_last_k_checkpoints(reference):
    assert ckpt_names(reference) == ["ckpt_00000008.pt", "ckpt_00000010.pt"]
    assert (reference / "latest").read_text() == "ckpt_00000010.pt"
    state = checkpoint.load(checkpoint.latest(reference))
    assert checkpoint.step_of(state) == 10 and state["loader"]["windows_consumed"] == 10 * 2 * 4
    assert not any(k.startswith("_orig_mod.") for k in state["model"])  # loads into eager and compiled
    assert [s for s, _ in losses(reference)] == list(range(1, 11))


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields: what a resumed run must reproduce exactly."""
    timing = {"tok_s", "tok_s_per_gpu", "mfu", "peak_mem_gib", "data_wait_pct"}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in lines]


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


# ---- bad input: one line on stderr, exit code 2, no traceback


def set_header(index: int, value: int):
    def edit(shard: Path) -> None:
        with open(shard, "r+b") as f:
            f.seek(4 * index)
            f.write(np.int32(value).tobytes())

    return edit


BAD_SHARDS = {
    "bad magic": (set_header(0, 12345), "bad magic 12345"),
    "bad version": (set_header(1, 3), "version 3 does not match magic 20240520"),
    "truncated": (lambda p: os.truncate(p, p.stat().st_size - 2), "header says"),
    "dangling symlink (beside meta.json)": (
        lambda p: (p.unlink(), p.symlink_to(p.with_name("gone.bin"))),
        "a dangling symlink",
    ),
    "token id out of range": (
        lambda p: write_shard(p, np.arange(301)),
        "token id 300 is out of range for vocab size 257",
    ),
}

BAD_ARGS = {
    "unknown flag": (
        ["--max-stpes", "5"],
        "command line: unrecognized argument '--max-stpes' (did you mean '--max-steps'?)",
    ),
    "bad flag value": (["--lr", "fast"], "command line: argument --lr: invalid float value: 'fast'"),
    "zero lr": (["--lr", "0"], "'lr' must be in (0, 10], got 0.0"),
    "negative lr": (["--lr", "-0.001"], "'lr' must be in (0, 10], got -0.001"),
    "warmup > max_steps": (["--warmup-steps", "20"], "'warmup_steps' (20) is larger than 'max_steps' (10)"),
    "zero micro-batch": (["--micro-batch", "0"], "'micro_batch' must be in [1, 65_536], got 0"),
    "fp16 on cpu": (["--dtype", "fp16"], "'dtype' = 'fp16' needs a CUDA device (got cpu)"),
    "seq_len > data": (["--seq-len", "100000"], "seq_len 100000 is longer than the data"),
    "nan lr": (["--lr", "nan"], "'lr' must be in (0, 10] (a finite number), got nan"),
    "inf lr": (["--lr", "inf"], "'lr' must be in (0, 10] (a finite number), got inf"),
    "beta1 1.5": (["--beta1", "1.5"], "'beta1' must be in [0, 1), got 1.5"),
    "negative seed": (["--seed", "-1"], "'seed' must be in [0, 4_294_967_295], got -1"),
    "floor above peak": (["--min-lr-ratio", "2"], "'min_lr_ratio' must be in [0, 1], got 2.0"),
    "zero eps": (["--eps", "0"], "'eps' must be in (0, 1], got 0.0"),
    "negative clip": (["--max-grad-norm", "-1"], "'max_grad_norm' must be in [0, 1_000_000], got -1.0"),
    "zero eval tokens": (["--eval-tokens", "0"], "'eval_tokens' must be in [1, 1_000_000_000_000], got 0"),
    # issue 55: values past a flag's range that overflowed fp32, a float or the machine once accepted
    "a softcap past fp32 (NaN losses)": (
        ["--logit-softcap", "1e39"],
        "'logit_softcap' must be 0 (off) or in [1, 1000], got 1e+39",
    ),
    "a softcap that rounds to 0 in fp32": (["--logit-softcap", "1e-50"], "'logit_softcap' must be 0 (off) or in"),
    "a Muon LR past fp32 (a traceback)": (
        ["--optimizer", "muon", "--muon-lr", "1e39"],
        "'muon_lr' must be in (0, 10], got 1e+39",
    ),
    "a weight decay past fp32": (["--weight-decay", "1e39"], "'weight_decay' must be in [0, 10], got 1e+39"),
    "a z-loss past fp32": (["--z-loss", "1e39"], "'z_loss' must be in [0, 1], got 1e+39"),
    "steps past a float (a traceback)": (
        ["--max-steps", "1" + "0" * 400],
        "'max_steps' must be in [1, 1_000_000_000_000]",
    ),
    "a count past a float (a traceback)": (["--keep-checkpoints", "1" + "0" * 400], "'keep_checkpoints' must be in"),
    "a micro-batch that filled the memory": (
        ["--micro-batch", "100000000"],
        "'micro_batch' must be in [1, 65_536], got 100000000",
    ),
    "a sequence past max_seq_len's bound": (["--seq-len", "1" + "0" * 400], "'seq_len' must be in [0, 1_048_576]"),
    "threads past a C int": (["--threads", str(2**31)], "'threads' must be in [0, 2_147_483_647], got 2147483648"),
    "bad choice": (["--decay-rule", "all"], "'decay_rule' = 'all' is not one of 'ndim', 'strict'"),
    "another trainer's dtype": (
        ["--dtype", "bfloat16"],
        "'dtype' = 'bfloat16' is not one of 'bf16', 'fp16', 'fp32' (did you mean 'bf16'?)",
    ),
    "float32": (["--dtype", "float32"], "(did you mean 'fp32'?)"),
    "another command's flag": (
        ["--tokenizer", "bpe"],
        "unrecognized argument '--tokenizer' (a flag of python -m fastpt.prepare, which makes the folder that --data",
    ),
    "another trainer's flag": (
        ["--learning-rate", "1e-3"],
        "unrecognized argument '--learning-rate' (did you mean '--lr'?)",
    ),
    "heads do not divide dim": (["--n-heads", "3"], "'dim' = 128 is not divisible by 'n_heads' = 3"),
    "kv heads do not divide heads": (["--n-kv-heads", "3"], "'n_heads' = 4 is not divisible by 'n_kv_heads' = 3"),
    "odd head dim": (["--dim", "100"], "head dim 25 (dim 100 / n_heads 4) must be even for RoPE"),
    "no layers": (["--n-layers", "0"], "'n_layers' must be > 0, got 0"),
    "an empty out (unset variable)": (["--out", ""], "'out' is empty"),
    "a dim with zeros too many": (["--dim", "1000000000"], "parameters, beyond fastpt's 100,000,000,000"),
    "a sequence table too long": (["--max-seq-len", "10000000000"], "'max_seq_len' = 10,000,000,000 is beyond"),
    "vocab below the data's": (["--vocab-size", "100"], "'vocab_size' = 100 is smaller than the data's vocab (257)"),
    "seq_len > max_seq_len": (["--max-seq-len", "16"], "'seq_len' = 32 is longer than 'max_seq_len' = 16"),
    "nan norm eps": (["--norm-eps", "nan"], "'norm_eps' must be in (0, 0.01] (a finite number), got nan"),
}


def base_args(data: Path, out: Path) -> list[str]:
    return [*TINY, "--data", str(data), "--out", str(out), "--max-steps", "10"]


@pytest.mark.parametrize("case", BAD_SHARDS)
def test_bad_shard_is_reported_with_its_file(case, tiny_data, tmp_path, capsys):
    edit, expected = BAD_SHARDS[case]
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data, ignore=shutil.ignore_patterns(".*"))  # without the token-id caches
    edit(data / "train_000000.bin")
    train_refuses(capsys, base_args(data, tmp_path / "run"), f"{data / 'train_000000.bin'}: {expected}")


@pytest.mark.parametrize("case", BAD_ARGS)
def test_bad_argument_is_one_line(case, tiny_data, tmp_path, capsys):
    extra, expected = BAD_ARGS[case]
    train_refuses(capsys, base_args(tiny_data, tmp_path) + extra, expected)


def test_every_numeric_setting_has_a_finite_range():
    """issue 55: a flag without a ceiling took 1e39 (a NaN loss, a traceback) or a 400-digit number (a
    traceback). The shape keys' bounds are ModelConfig.check's (MAX_PARAMS, MAX_SEQ_LEN), which
    --init-from's and a checkpoint's shapes meet too."""
    unbounded = [
        name
        for name, f in FIELDS.items()
        if FIELD_TYPES[name] in (int, float)
        and f.default is not None
        and not (f.metadata["domain"] and math.isfinite(f.metadata["domain"].high))
    ]
    assert unbounded == []


def test_another_commands_flags_are_its_own(capsys):
    """Each flag fastpt.train sends to another command (errors.ELSEWHERE) is that command's, not train's."""
    for key, command in ELSEWHERE.items():
        module = importlib.import_module(re.search(r"fastpt\.\w+", command)[0])
        with pytest.raises(SystemExit):
            module.parse_args(["--help"])
        assert f"--{key.replace('_', '-')} " in capsys.readouterr().out and key not in FIELDS, key


def test_a_missing_data_folder_names_the_nearest_one(tiny_data, tmp_path, capsys):
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    (tmp_path / "data" / "bpe").mkdir()
    for typo in ("data/tny", "dta/tiny", "data/bpee"):
        want = tmp_path / typo.replace("tny", "tiny").replace("dta", "data").replace("bpee", "bpe")
        train_refuses(capsys, base_args(tmp_path / typo, tmp_path / "run"), f"does not exist (did you mean '{want}'?)")
    train_refuses(capsys, base_args(tmp_path / "data" / "zzzzzz", tmp_path / "run"), "does not exist")
    mixture = f"{tiny_data}:1,{tmp_path / 'data' / 'tny'}:1"
    train_refuses(
        capsys,
        [*TINY, "--out", str(tmp_path / "run"), "--data", mixture],
        f"(did you mean '{tmp_path / 'data' / 'tiny'}'?)",
    )


def test_triton_kernels_without_a_gpu_or_the_interpreter(tiny_data, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    train_refuses(
        capsys, base_args(tiny_data, tmp_path) + ["--kernels", "triton"], "'kernels' = 'triton' cannot run here"
    )


BAD_TOML = {
    "wrong type": ('lr = "fast"\n', "'lr' must be float, got 'fast'"),
    "not TOML": ("lr = = 1\n", "not valid TOML"),
    "binary": ("\x00\xff\xfe garbage", "not valid TOML"),
    "another command's key": (
        'tokenizer = "bpe"\n',
        "unknown config key 'tokenizer' (a flag of python -m fastpt.prepare",
    ),
    "unknown key": (
        "max_steps = 10\nwarmup_step = 2\n",
        "unknown config key 'warmup_step' (did you mean 'warmup_steps'?)",
    ),
    "another trainer's key": ("learning_rate = 1e-3\n", "unknown config key 'learning_rate' (did you mean 'lr'?)"),
    "another trainer's steps": ("max_iters = 5\n", "unknown config key 'max_iters' (did you mean 'max_steps'?)"),
    "bad shape": ("n_layers = 0\n", "'n_layers' must be > 0, got 0"),
}


@pytest.mark.parametrize("case", BAD_TOML)
def test_bad_config_file_is_one_line(case, tiny_data, tmp_path, capsys):
    text, expected = BAD_TOML[case]
    config = tmp_path / "run.toml"
    config.write_bytes(text.encode("latin-1"))
    train_refuses(capsys, base_args(tiny_data, tmp_path / "run") + ["--config", str(config)], expected)
    train_refuses(
        capsys,
        base_args(tiny_data, tmp_path / "run") + ["--config", str(tmp_path / "missing.toml")],
        f"config file not found: {tmp_path / 'missing.toml'}",
    )


def test_missing_or_empty_data_folder(tmp_path, capsys):
    train_refuses(
        capsys, base_args(tmp_path / "nope", tmp_path / "run"), f"data folder {tmp_path / 'nope'} does not exist"
    )
    (tmp_path / "empty").mkdir()
    train_refuses(
        capsys,
        base_args(tmp_path / "empty", tmp_path / "run"),
        f"data folder {tmp_path / 'empty'} has no *train_*.bin files",
    )


def test_unusable_run_folder(tiny_data, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    train_refuses(
        capsys,
        base_args(tiny_data, tmp_path / "file" / "run"),
        f"'out' = '{tmp_path / 'file' / 'run'}': cannot write the run folder (Not a directory)",
    )
    (tmp_path / "ckpt_00000004.pt").write_bytes(b"not a checkpoint")
    train_refuses(
        capsys,
        base_args(tiny_data, tmp_path),
        "already holds a run (newest checkpoint ckpt_00000004.pt): add --resume to continue it",
    )
    train_refuses(
        capsys,
        base_args(tiny_data, tmp_path) + ["--resume"],
        f"no checkpoint in {tmp_path} loads (ckpt_00000004.pt); newest: could not read checkpoint",
        f"checkpoint {tmp_path / 'ckpt_00000004.pt'}",
    )


def test_resume_with_another_model_names_the_difference(reference, tiny_data, capsys):
    train_refuses(
        capsys,
        base_args(tiny_data, reference) + ["--resume", "--n-layers", "3", "--no-tie-embeddings"],
        "ckpt_00000010.pt was written for another model (n_layers 2 != 3, tie_embeddings True != False)",
    )


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


def mount_tmpfs(mount: Path, size: str):
    """A real filesystem of `size` (tmpfs) at `mount`, where the machine lets the tests mount one."""
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("mounting a tmpfs is not permitted here (the RLIMIT_FSIZE tests cover failed writes)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A real 24 MiB filesystem."""
    yield from mount_tmpfs(tmp_path / "disk", "24m")


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 3 MiB filesystem."""
    yield from mount_tmpfs(tmp_path / "disk", "3m")


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


# ---- fastpt.plot on what a crash leaves


def train_record(step: int) -> str:
    return json.dumps({"step": step, "loss": 5.0 / step, "tokens": 128 * step, "lr": 1e-3, "tok_s": 1000.0})


DAMAGED_LINES = [
    b"\xff\xfe not UTF-8",
    bytes(range(14, 256)) * 4,
    b"[1, 2, 3]",
    b'{"loss": 1.0, "tokens": 1}',
    b'{"step": "3", "loss": 1.0, "tokens": 1, "lr": 0.1, "tok_s": 1.0}',
    b'{"step": 4, "loss": "low"}',
]


def test_plot_skips_damaged_lines_and_says_how_many(tmp_path, capsys):
    from fastpt import plot

    lines = [
        train_record(1).encode(),
        *DAMAGED_LINES,
        train_record(2).encode(),
        b'{"step": 2, "val_loss": 2.5, "val_ppl": 12.2}',
        train_record(3).encode()[:20],
    ]  # cut by a kill
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines))
    code, out, err = run_main(plot.main, [str(tmp_path)], capsys)
    assert code == 0, err
    assert err == (
        f"fastpt: warning: {tmp_path / 'metrics.jsonl'}: skipped 7 damaged lines (line 2, 3, 4, ...); "
        "plotted 2 train and 1 eval records\n"
    )
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(DAMAGED_LINES))
    assert_one_line_error(
        *run_main(plot.main, [str(tmp_path)], capsys)[::2],
        f"{tmp_path / 'metrics.jsonl'} has no train records (6 damaged lines, the first line 1)",
    )


def test_plot_into_a_folder_it_cannot_write_is_one_line(tmp_path, capsys):
    from fastpt import plot

    (tmp_path / "metrics.jsonl").write_text(train_record(1) + "\n" + train_record(2) + "\n")
    code, _, err = run_main(plot.main, [str(tmp_path), "--out", "/proc/loss.png"], capsys)
    assert_one_line_error(code, err, "cannot write /proc/loss.png", "--out", expected_code=1)
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        shutil.copy(tmp_path / "metrics.jsonl", disk)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)  # a read-only run folder
        code, _, err = run_main(plot.main, [str(disk)], capsys)
        assert_one_line_error(code, err, f"cannot write {disk / 'loss.png'}: Read-only file system", expected_code=1)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


# ---- output paths that are not regular files: written through, never replaced (issue 55)


def plot_to(tmp_path: Path, out: Path, capsys) -> None:
    from fastpt import plot

    (tmp_path / "metrics.jsonl").write_text(train_record(1) + "\n" + train_record(2) + "\n")
    code, _, err = run_main(plot.main, [str(tmp_path), "--out", str(out)], capsys)
    assert code == 0, err


def test_plot_out_a_symlink_to_a_device_writes_through_it_and_keeps_both(tmp_path, capsys):
    """Replaced atomically, the link would become a regular file (and, as root, a device named
    directly would be replaced: `--plan-json /dev/full`)."""
    link = tmp_path / "loss.png"
    link.symlink_to(os.devnull)
    plot_to(tmp_path, link, capsys)
    assert os.readlink(link) == os.devnull and stat.S_ISCHR(os.stat(os.devnull).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["loss.png", "metrics.jsonl"]
    assert not [name for name in os.listdir("/dev") if name.startswith(".null.tmp")]


def test_plot_out_a_fifo_writes_into_it(tmp_path, capsys):
    fifo = tmp_path / "loss.png"
    os.mkfifo(fifo)
    held = os.open(fifo, os.O_RDWR)  # a writer until the plot is done: the reader's open never waits
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        plot_to(tmp_path, fifo, capsys)
    finally:
        os.close(held)  # the reader then reads to the end of what the plot wrote
        reader.join(30)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert received[0][:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_out_a_symlink_to_a_file_replaces_the_file_and_keeps_the_link(tmp_path, capsys):
    (tmp_path / "plots").mkdir()
    target = tmp_path / "plots" / "loss.png"
    target.write_bytes(b"an earlier plot")
    (tmp_path / "loss.png").symlink_to(target)
    plot_to(tmp_path, tmp_path / "loss.png", capsys)
    assert (tmp_path / "loss.png").is_symlink() and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path / "plots") == ["loss.png"]


@pytest.mark.slow
def test_plan_json_to_a_link_to_stdout_appends_to_what_stdout_is(tmp_path):
    """`--plan-json /dev/stdout >> plans.log` (here a link to it, so that a regression replaces a link
    in tmp_path, never the machine's /dev/stdout): the JSON follows what the log held and the plan's
    own lines, through the shell's descriptor (opened anew, /dev/stdout would truncate the log)."""
    link = tmp_path / "plan.json"
    link.symlink_to("/dev/stdout")
    log = tmp_path / "plans.log"
    log.write_text("an earlier plan\n")
    with open(log, "a") as stdout:
        result = subprocess.run(
            [sys.executable, "-m", "fastpt.train", "--plan", *TINY[:4], "--plan-json", str(link)],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert result.returncode == 0, result.stderr
    assert os.readlink(link) == "/dev/stdout" and sorted(os.listdir(tmp_path)) == ["plan.json", "plans.log"]
    text = log.read_text()
    assert text.startswith("an earlier plan\nplan for a CPU run | preset tiny"), text
    assert json.loads(text[text.index("\n{") :])["fits"] is True


def test_prepare_out_a_symlink_to_a_folder_fills_the_folder_and_keeps_the_link(tmp_path):
    from fastpt.prepare import prepare

    (tmp_path / "input.txt").write_text("a small corpus\n" * 100)
    (tmp_path / "disk").mkdir()
    (tmp_path / "data").symlink_to(tmp_path / "disk")
    for _ in range(2):  # a new dataset, then one replacing it
        prepare([tmp_path / "input.txt"], tmp_path / "data", "bytes", workers=1, overwrite=True)
    assert os.readlink(tmp_path / "data") == str(tmp_path / "disk")
    assert (tmp_path / "disk" / "meta.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["data", "disk", "input.txt"]


# ---- caches and leftovers


def test_a_damaged_or_fooled_token_id_cache_is_recomputed(tmp_path):
    """The cache beside a shard: cut off after its key, garbage, or keyed to bytes since rewritten
    (same size, mtime set back): each is recomputed, never trusted or fatal."""
    from fastpt.data.dataset import max_token_id

    shard = write_shard(tmp_path / "train_000000.bin", np.arange(2000) % 250, 257)
    cache = tmp_path / ".train_000000.bin.maxid"
    assert max_token_id(shard, False) == 249 and cache.is_file()
    key = cache.read_text().split(" ")[0]
    for damaged in (key.encode(), key.encode() + b" ", b"\xff\x00garbage", b""):
        cache.write_bytes(damaged)
        assert max_token_id(shard, False) == 249
        assert cache.read_text() == f"{key} 249"
    before = shard.stat()
    tokens = np.arange(2000) % 250
    tokens[1234] = 256
    write_shard(shard, tokens, 257)  # the same size ...
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # ... and the same mtime
    assert shard.stat().st_size == before.st_size and shard.stat().st_mtime_ns == before.st_mtime_ns
    assert max_token_id(shard, False) == 256


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


# ---- a full disk in prepare and export: one line naming the path and the OS's reason, exit 1


def run_command_line(module: str, *args: str, fsize: int = 0) -> subprocess.CompletedProcess:
    """python -m fastpt.MODULE as a real process; fsize > 0 sets RLIMIT_FSIZE (`ulimit -f`) in it."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))

    return subprocess.run(
        [sys.executable, "-m", f"fastpt.{module}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=limit if fsize else None,
    )


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_a_resume_refused_by_a_file_size_limit_changes_nothing_in_the_run_folder(bpe_data, tmp_path):
    """`ulimit -f 1` (issue 55): the resume's writes fail (EFBIG), and it stops before training. The run
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


def big_corpus(tmp_path: Path) -> Path:
    text = (REPO / "fastpt" / "train.py").read_text()
    (tmp_path / "big.txt").write_text(text * (3 * 2**20 // len(text)))  # 3 MB: 6 MB of uint16 shards
    return tmp_path / "big.txt"


def test_prepare_onto_a_disk_that_fills_is_one_line_and_keeps_the_earlier_dataset(tiny_disk, tmp_path):
    out = tiny_disk / "data"
    (tmp_path / "small.txt").write_text("a small corpus\n" * 500)
    first = run_command_line("prepare", str(tmp_path / "small.txt"), "--out", str(out), "--tokenizer", "bytes")
    assert first.returncode == 0, first.stderr
    earlier = folder_bytes(out)
    result = run_command_line(
        "prepare", str(big_corpus(tmp_path)), "--out", str(out), "--tokenizer", "bytes", "--workers", "1", "--overwrite"
    )
    assert_one_line_error(
        result.returncode,
        result.stderr,
        f"fastpt.prepare could not write {out}: "
        "No space left on device (nothing published; its earlier contents are intact)",
        expected_code=1,
    )
    assert os.listdir(tiny_disk) == ["data"] and folder_bytes(out) == earlier  # no temporary folder left


def test_prepare_past_a_file_size_limit_is_one_line_not_a_silent_death(tmp_path):
    """`ulimit -f`: a write past it raises SIGXFSZ, which kills a process without a word by default."""
    out = tmp_path / "data"
    result = run_command_line(
        "prepare", str(big_corpus(tmp_path)), "--out", str(out), "--tokenizer", "bytes", "--workers", "1", fsize=1 << 20
    )
    assert_one_line_error(result.returncode, result.stderr, f"could not write {out}: File too large", expected_code=1)
    assert sorted(os.listdir(tmp_path)) == ["big.txt"]


def test_export_onto_a_disk_that_fills_is_one_line_and_keeps_the_earlier_export(reference, tiny_disk, capsys):
    from fastpt import export

    out = tiny_disk / "hf"
    code, _, err = run_main(export.main, [str(reference), "--out", str(out), "--dtype", "bf16"], capsys)  # ~1 MB
    assert code == 0, err
    earlier = folder_bytes(out)
    free = os.statvfs(tiny_disk).f_bavail * os.statvfs(tiny_disk).f_frsize
    (tiny_disk / "filler").write_bytes(b"\0" * (free - 100_000))  # a nearly full disk
    assert_one_line_error(
        *run_main(export.main, [str(reference), "--out", str(out), "--overwrite"], capsys)[::2],
        f"fastpt.export could not write {out}: "
        "No space left on device (nothing published; its earlier contents are intact)",
        expected_code=1,
    )
    assert sorted(os.listdir(tiny_disk)) == ["filler", "hf"] and folder_bytes(out) == earlier
    limited = run_command_line("export", str(reference), "--out", str(reference.parent / "hf-limited"), fsize=100_000)
    assert_one_line_error(limited.returncode, limited.stderr, "hf-limited: File too large", expected_code=1)
    assert not list(reference.parent.glob("*hf-limited*"))


def test_export_overwrite_never_deletes_a_users_file(reference, tmp_path, capsys):
    from fastpt import export

    out = tmp_path / "hf"
    assert run_main(export.main, [str(reference), "--out", str(out)], capsys)[0] == 0
    (out / "notes.md").write_text("my eval results")
    before = folder_bytes(out)
    code, _, err = run_main(export.main, [str(reference), "--out", str(out), "--overwrite", "--dtype", "bf16"], capsys)
    assert_one_line_error(
        code, err, f"--out {out} holds files that fastpt.export did not write (notes.md): nothing deleted"
    )
    assert folder_bytes(out) == before
    (out / "notes.md").unlink()
    assert run_main(export.main, [str(reference), "--out", str(out), "--overwrite", "--dtype", "bf16"], capsys)[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["hf"]


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


# ---- publish: a folder replaced in one step, or put back after a kill between two renames

KILLED_PUBLISH = r"""
import os, signal, sys
from pathlib import Path
from fastpt import files
mode, tmp, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
if mode == "two renames":
    files.exchange = lambda a, b: False  # an OS or filesystem without renameat2's RENAME_EXCHANGE
    real_rename = Path.rename
    def rename(self, target):
        real_rename(self, target)
        os.kill(os.getpid(), signal.SIGKILL)  # `out` is aside, the new folder not yet in
    Path.rename = rename
else:  # killed right after the swap, before the old folder (now under tmp's name) is deleted
    real_remove = files.remove
    files.remove = lambda p: os.kill(os.getpid(), signal.SIGKILL) if p == tmp else real_remove(p)
files.publish(tmp, out)
"""


def killed_publish(mode: str, tmp: Path, out: Path) -> None:
    killed = subprocess.run([sys.executable, "-c", KILLED_PUBLISH, mode, str(tmp), str(out)], cwd=REPO)
    assert killed.returncode == -signal.SIGKILL


def folder(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "a").write_text(text)
    return path


@pytest.mark.parametrize("mode", ["exchange", "two renames"])
def test_a_publish_killed_midway_leaves_one_whole_folder_and_the_next_start_recovers_it(tmp_path, mode):
    from fastpt import files

    if mode == "exchange" and not files.exchange(folder(tmp_path / "x", "x"), folder(tmp_path / "y", "y")):
        pytest.skip("this filesystem has no RENAME_EXCHANGE (the two-rename fallback is tested)")
    out, tmp = folder(tmp_path / "out", "old"), folder(tmp_path / ".out.tmp", "new")
    killed_publish(mode, tmp, out)
    if mode == "exchange":  # never a moment without `out`: the new one is in, the old one under tmp's name
        assert (out / "a").read_text() == "new" and (tmp / "a").read_text() == "old"
        assert not files.recover(out)
    else:
        assert not out.exists() and (tmp_path / ".out.old" / "a").read_text() == "old"
        assert files.recover(out) and (out / "a").read_text() == "old"
        assert not (tmp_path / ".out.old").exists()


def test_a_checkpoint_resaved_and_killed_between_the_renames_is_resumed_from(reference, tiny_data, tmp_path, capsys):
    """A sharded checkpoint of step 10 saved again over itself (a resumed attempt) and killed with the
    old one aside and the new one not yet in, the only checkpoint of the run (keep 1): --resume
    puts it back and resumes at step 10 (deleting it as a leftover lost the whole run)."""
    from test_checkpoints import as_dcp_folder

    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    ckpt = checkpoint.load(run_dir / "ckpt_00000010.pt")
    for path in run_dir.glob("ckpt_*.pt"):
        path.unlink()
    as_dcp_folder(ckpt, run_dir / "ckpt_00000010")
    as_dcp_folder(ckpt, run_dir / ".ckpt_00000010.partial")
    killed_publish("two renames", run_dir / ".ckpt_00000010.partial", run_dir / "ckpt_00000010")
    assert ckpt_names(run_dir) == [] and (run_dir / ".ckpt_00000010.old").is_dir()
    code, out, err = train_here(capsys, *run_args(tiny_data, run_dir, "--resume", "--keep-checkpoints", "1"))
    assert code == 0, err
    assert f"resumed from {run_dir / 'ckpt_00000010'} at step 10" in out
    assert ckpt_names(run_dir) == ["ckpt_00000010"] and not (run_dir / ".ckpt_00000010.old").exists()


def test_an_export_killed_between_the_renames_is_put_back_before_out_is_checked(reference, tmp_path, capsys):
    from fastpt import export

    out = tmp_path / "hf"
    assert run_main(export.main, [str(reference), "--out", str(out)], capsys)[0] == 0
    earlier = folder_bytes(out)
    shutil.copytree(out, tmp_path / ".hf.export-tmp")  # a complete new export, being published
    killed_publish("two renames", tmp_path / ".hf.export-tmp", out)
    assert not out.exists()
    code, _, err = run_main(export.main, [str(reference), "--out", str(out)], capsys)
    assert_one_line_error(code, err, f"--out {out} already holds the output of an earlier fastpt.export")
    assert folder_bytes(out) == earlier and not (tmp_path / ".hf.old").exists()


# ---- a refused run leaves the disk as it found it


class RunsAShell:
    """What a crafted meta.pkl carries: unpickling it would call os.system."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def refusal_data(tiny_data, bpe_data, tmp_path_factory) -> dict[str, Path]:
    """Data folders for refused runs: shards with no document token and no tokenizer; nanoGPT bins
    with a meta.pkl that would run a shell command; MC files with every mistake."""
    import pickle

    root = tmp_path_factory.mktemp("refusals")
    bare = root / "bare"
    bare.mkdir()
    write_shard(bare / "train_000000.bin", np.arange(2000) % 250, 257)
    write_shard(bare / "val_000000.bin", np.arange(500) % 250, 257)
    crafted = root / "crafted"
    crafted.mkdir()
    for split in ("train", "val"):
        (np.arange(3000) % 60).astype(np.uint16).tofile(crafted / f"{split}.bin")
    (crafted / "meta.pkl").write_bytes(pickle.dumps(RunsAShell(f"touch {root / 'payload-ran'}")))
    row = {"ctx": "a", "endings": ["b", "c"], "label": 0}
    mc = {
        "empty": "",
        "malformed": json.dumps(row) + "\n{oops\n",
        "label-out-of-range": json.dumps({**row, "label": 2}),
        "label-a-string": json.dumps({**row, "label": "0"}),
        "one-ending": json.dumps({**row, "endings": ["b"]}),
        "empty-ending": json.dumps({**row, "endings": ["b", ""]}),
        "good": json.dumps(row),
    }
    for name, text in mc.items():
        (root / f"{name}.jsonl").write_text(text)
    (root / "latin1.jsonl").write_bytes(json.dumps(row).replace("a", "\xe9").encode("latin-1"))
    (root / "a-folder.jsonl").mkdir()
    return {"tiny": tiny_data, "bpe": bpe_data, "root": root, "bare": bare, "crafted": crafted}


REFUSALS = {  # name -> (flags, with {tiny}, {bpe}, {root}, {bare}, {crafted} filled in; what the error names)
    "weight negative": (["--data", "{tiny}:1,{tiny}:-1"], "'-1'"),
    "weight zero": (["--data", "{tiny}:1,{tiny}:0"], "'0'"),
    "weight inf": (["--data", "{tiny}:1,{tiny}:inf"], "'inf'"),
    "weight nan": (["--data", "{tiny}:1,{tiny}:nan"], "'nan'"),
    "weight text": (["--data", "{tiny}:1,{tiny}:lots"], "'lots'"),
    "weight a TOML string": (["--config", "{root}/string-weight.toml"], "'0.5x'"),
    "a missing folder": (["--data", "{tiny}:1,{root}/nothing:1"], "{root}/nothing"),
    "two tokenizers": (["--data", "{tiny}:1,{bpe}:1"], "{bpe}"),
    "eval-mc missing": (["--eval-mc", "{root}/missing.jsonl"], "{root}/missing.jsonl"),
    "eval-mc empty": (["--eval-mc", "{root}/empty.jsonl"], "no rows"),
    "eval-mc malformed line": (["--eval-mc", "{root}/malformed.jsonl"], "{root}/malformed.jsonl:2"),
    "eval-mc label out of range": (["--eval-mc", "{root}/label-out-of-range.jsonl"], '"label" 2'),
    "eval-mc label a string": (["--eval-mc", "{root}/label-a-string.jsonl"], "\"label\" '0'"),
    "eval-mc one ending": (["--eval-mc", "{root}/one-ending.jsonl"], "{root}/one-ending.jsonl:1"),
    "eval-mc empty ending": (["--eval-mc", "{root}/empty-ending.jsonl"], "{root}/empty-ending.jsonl:1"),
    "eval-mc not UTF-8": (["--eval-mc", "{root}/latin1.jsonl"], "{root}/latin1.jsonl"),
    "eval-mc a folder": (["--eval-mc", "{root}/a-folder.jsonl"], "{root}/a-folder.jsonl"),
    "eval-mc on data without a tokenizer": (["--data", "{bare}", "--eval-mc", "{root}/good.jsonl"], "tokenizer.json"),
    "packing bos without a document token": (["--data", "{bare}", "--packing", "bos"], "'packing' = 'bos' needs"),
    "attention document without a document token": (
        ["--data", "{bare}", "--attention", "document"],
        "'attention' = 'document' needs",
    ),
    "a crafted nanoGPT meta.pkl": (["--data", "{crafted}", "--data-format", "nanogpt"], "{crafted}/meta.pkl"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_run_leaves_no_run_folder_behind(case, refusal_data, tmp_path, capsys):
    """Each refusal: one line naming it, exit 2, and --out as it was: a new one (two folders deep) not
    made, an empty one still empty (no .lock)."""
    flags, named = REFUSALS[case]
    names = {k: str(v) for k, v in refusal_data.items()}
    (refusal_data["root"] / "string-weight.toml").write_text(f'[data]\n"{names["tiny"]}" = "0.5x"\n')
    flags = [f.format(**names) for f in flags]
    flags = flags if "--data" in flags or "--config" in flags else ["--data", names["tiny"], *flags]
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new" / "run", tmp_path / "empty"):
        train_refuses(capsys, [*TINY, "--out", str(out), "--max-steps", "1", *flags], named.format(**names))
    assert os.listdir(tmp_path) == ["empty"] and os.listdir(tmp_path / "empty") == []
    assert not (refusal_data["root"] / "payload-ran").exists()


def test_a_refused_resume_keeps_the_run_folder_and_its_lock_file(reference, tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = sorted(os.listdir(run_dir))
    train_refuses(capsys, [*run_args(tiny_data, run_dir, "--resume"), "--data", "/nothing"], "/nothing")
    assert sorted(os.listdir(run_dir)) == before
