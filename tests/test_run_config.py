"""A run's config.toml, which a resume starts from: written atomically and only by a run that will
start, and checked against the checkpoint's own train_config (the source of truth) on a resume."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import faults
from conftest import REPO, TINY, assert_one_line_error, read_metrics, run_main, run_quietly, tiny_args
from fastpt import checkpoint, hf, metrics, train
from fastpt.config import resolve
from fastpt.model import Transformer
from fastpt.plan.planner import planned_model
from fastpt.presets import ModelConfig


def short_run(data: Path, out: Path, *extra: str, max_steps: int = 2) -> list[str]:
    """A run whose cadences are not the CPU profile's, so a lost key would show."""
    return tiny_args(data, out, *extra, max_steps=max_steps, log_every=1, ckpt_every=1, eval_every=2)


def ckpt_names(run_dir: Path) -> list[str]:
    return [p.name for p in checkpoint.checkpoints(run_dir)]


@pytest.fixture(scope="module")
def finished(tiny_data, tmp_path_factory) -> Path:
    """A 2-step run with its checkpoints and config.toml."""
    out = tmp_path_factory.mktemp("finished") / "run"
    code, _, err = run_quietly(train.main, short_run(tiny_data, out))
    assert code == 0, err
    return out


@pytest.fixture
def run_dir(finished, tmp_path) -> Path:
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def test_a_resume_refused_by_a_read_only_folder_leaves_config_toml_as_it_was(run_dir, tiny_data, capsys, monkeypatch):
    """The run folder refuses a write (of its tokenizer, metrics and config): the resume stops with one
    line, and config.toml still says the old max_steps (root writes anywhere, so the refusal is patched in)."""
    before = (run_dir / "config.toml").read_text()

    def read_only(*args: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(metrics, "write_atomic_all", read_only)
    code, _, err = run_main(train.main, short_run(tiny_data, run_dir, "--resume", max_steps=4), capsys)
    assert_one_line_error(code, err, "cannot write the run folder", "Permission denied")
    assert (run_dir / "config.toml").read_text() == before


def test_a_resume_under_a_file_size_limit_does_not_cut_config_toml(run_dir, tiny_data):
    """`ulimit -f 1`: the resume's writes fail (EFBIG); config.toml stays whole, and the next resume,
    without the limit, runs."""
    before = (run_dir / "config.toml").read_text()
    assert len(before) > 1024  # the limit falls inside it
    args = short_run(tiny_data, run_dir, "--resume", max_steps=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    limited = subprocess.run(
        faults.script_args("file-size-limit", 1024, *args), capture_output=True, text=True, env=env, cwd=REPO
    )
    assert limited.returncode != 0 and "Traceback" not in limited.stderr, limited.stderr
    assert (run_dir / "config.toml").read_text() == before
    assert not list(run_dir.glob(".config.toml.tmp*"))
    code, _, err = run_quietly(train.main, args)
    assert code == 0, err


def test_a_config_toml_cut_at_a_line_end_resumes_with_the_checkpoints_values(run_dir, tiny_data, capsys):
    """config.toml cut before log_every (valid TOML, the rest lost): the checkpoint's train_config
    fills in what it lacks, said in a warning; the run logs and saves every step as before, not at
    the CPU profile's defaults."""
    lines = (run_dir / "config.toml").read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if line.startswith("log_every"))
    (run_dir / "config.toml").write_text("".join(lines[:cut]))
    code, _, err = run_main(train.main, [*TINY, "--out", str(run_dir), "--resume", "--max-steps", "4"], capsys)
    assert code == 0, err
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert ckpt_names(run_dir)[-2:] == ["ckpt_00000003.pt", "ckpt_00000004.pt"]
    assert f"fastpt: warning: {run_dir / 'config.toml'} lacks log_every, " in err, err
    assert "the checkpoint's values apply" in err
    assert "log_every = 1\n" in (run_dir / "config.toml").read_text()


@pytest.mark.parametrize(
    ("damage", "says"),
    [(lambda path: path.write_text("max_steps = 2\nlr = 5e-"), "is unreadable"), (Path.unlink, "is missing")],
    ids=["cut-mid-line", "deleted"],
)
def test_a_config_toml_that_does_not_parse_or_is_gone_gives_way_to_the_checkpoint(
    run_dir, tiny_data, capsys, damage, says
):
    """A config.toml an older fastpt cut mid-line (not TOML), or none at all: the checkpoint's
    train_config is the run's, said in a warning, and the resume goes on at the run's cadence."""
    damage(run_dir / "config.toml")
    code, _, err = run_main(train.main, [*TINY, "--out", str(run_dir), "--resume", "--max-steps", "3"], capsys)
    assert code == 0, err
    assert f"fastpt: warning: {run_dir / 'config.toml'} {says}" in err and "the checkpoint's values apply" in err
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_a_resume_never_needs_the_init_from_folder(tiny_data, tmp_path, capsys):
    """A run started with --init-from HF_FOLDER resumes after that folder is gone: the checkpoint
    holds the whole model and its config."""
    shape = ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, ffn_dim=96, max_seq_len=64)
    hf.save_hf(tmp_path / "hf", shape, Transformer(shape).state_dict())
    args = short_run(tiny_data, tmp_path / "run", "--init-from", str(tmp_path / "hf"))
    code, _, err = run_main(train.main, args, capsys)
    assert code == 0, err
    shutil.rmtree(tmp_path / "hf")
    code, out, err = run_main(
        train.main, [*TINY, "--out", str(tmp_path / "run"), "--resume", "--max-steps", "3"], capsys
    )
    assert code == 0, err
    assert f"resumed from {tmp_path / 'run' / 'ckpt_00000002.pt'} at step 2" in out
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    given = {"init_from": str(tmp_path / "hf"), "out": str(tmp_path / "run"), "resume": True, "data": str(tiny_data)}
    assert planned_model(resolve(given, None, "cpu")).dim == 64  # what --micro-batch auto plans
