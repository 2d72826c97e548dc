"""torchrun with real processes (gloo on CPU): DDP and FSDP follow a one-process run step for step,
and checkpoints move between world sizes and layouts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import TINY, run_train

pytestmark = pytest.mark.slow

# Global batch 8 windows per step: 1 process x 4 x accum 2, or 2 processes x 2 x accum 2, so the
# two-process runs also exercise the no-sync micro-steps. Eval and checkpoints land at step 3.
COMMON = (*TINY, "--max-steps", "6", "--warmup-steps", "1", "--lr", "3e-3", "--log-every", "1",
          "--eval-every", "3", "--eval-tokens", "512", "--ckpt-every", "3")
ONE_PROC = ("--micro-batch", "4", "--grad-accum", "2")
TWO_PROCS = ("--micro-batch", "2", "--grad-accum", "2")


def train(data: Path, out: Path, nproc: int, *extra: str) -> Path:
    result = run_train(*COMMON, "--data", str(data), "--out", str(out),
                       *(TWO_PROCS if nproc else ONE_PROC), *extra, nproc=nproc)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return out


def curve(run_dir: Path) -> dict[tuple[int, str], float]:
    """(step, 'loss' | 'val_loss') -> value, from metrics.jsonl."""
    out = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        for key in ("loss", "val_loss"):
            if key in record:
                assert (record["step"], key) not in out, "metrics written twice: more than one rank logs"
                out[record["step"], key] = record[key]
    return out


def assert_same_curve(run_dir: Path, reference: Path, from_step: int = 0) -> None:
    got, want = curve(run_dir), {k: v for k, v in curve(reference).items() if k[0] > from_step}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert abs(got[k] - v) <= 1e-3 * abs(v), (k, got[k], v)


def resume_from(run_dir: Path, checkpoint: str, out: Path) -> Path:
    """A fresh run folder holding only run_dir's checkpoint at step 3 (the run went on to step 6)."""
    out.mkdir(parents=True)
    src = run_dir / checkpoint
    (shutil.copytree if src.is_dir() else shutil.copy)(src, out / checkpoint)
    return out


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """The same 6 steps in one process, under DDP and under FSDP (2 processes each)."""
    root = tmp_path_factory.mktemp("dist")
    return {"one": train(tiny_data, root / "one", 0),
            "ddp": train(tiny_data, root / "ddp", 2),
            "fsdp": train(tiny_data, root / "fsdp", 2, "--parallel", "fsdp")}


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_two_processes_follow_one_process(runs, layout):
    assert_same_curve(runs[layout], runs["one"])


@pytest.mark.parametrize("layout, checkpointing", [("fsdp", "selective"), ("ddp", "full")])
def test_compiled_with_activation_checkpointing_follows_one_process(runs, tiny_data, tmp_path, layout, checkpointing):
    """FSDP compiles each block before sharding it, DDP the whole model before wrapping it; with
    activation checkpointing inside the blocks both still train as the eager one-process run."""
    out = train(tiny_data, tmp_path / layout, 2, "--parallel", layout, "--compile",
                "--activation-checkpointing", checkpointing)
    assert_same_curve(out, runs["one"])
    assert {r["recompiles"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r} == {0}


def test_checkpoint_kinds(runs):
    assert (runs["ddp"] / "ckpt_00000006.pt").is_file()  # one copy, from rank 0
    assert (runs["fsdp"] / "ckpt_00000006").is_dir()  # DCP shards from every rank
    assert (runs["fsdp"] / "latest").read_text() == "ckpt_00000006"


@pytest.mark.parametrize("layout, checkpoint", [("ddp", "ckpt_00000003.pt"), ("fsdp", "ckpt_00000003")])
def test_two_process_checkpoint_resumes_in_one_process(runs, tiny_data, tmp_path, layout, checkpoint):
    out = train(tiny_data, resume_from(runs[layout], checkpoint, tmp_path / "resumed"), 0, "--resume")
    assert_same_curve(out, runs["one"], from_step=3)


def test_one_process_checkpoint_resumes_sharded_in_two(runs, tiny_data, tmp_path):
    out = resume_from(runs["one"], "ckpt_00000003.pt", tmp_path / "resumed")
    train(tiny_data, out, 2, "--resume", "--parallel", "fsdp")
    assert_same_curve(out, runs["one"], from_step=3)
