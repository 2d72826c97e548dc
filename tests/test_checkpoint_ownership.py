"""A run folder's checkpoints are its own: pruning keeps the newest --keep-checkpoints of them and
deletes nothing else, a checkpoint of another run or model is never resumed as this run, an old
run folder without a run id still resumes, and nothing named like a checkpoint that is no file
(a FIFO) is ever opened."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import tomllib
import torch
from test_run_folder_states import no_wait_on_fifos

import faults
from conftest import REPO, assert_one_line_error, failure_of, read_metrics, run_main, run_quietly, tiny_args
from fastpt import checkpoint, checkpointer, sample, train


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if checkpoint.NAME.match(p.name))


def state(step: int, run_id: str = "run-a") -> dict:
    return {
        "model": {"w": torch.zeros(2)},
        "model_config": {"dim": 16},
        "train_config": {"run_id": run_id},
        "train_state": {"step": step},
    }


@pytest.mark.parametrize("keep", [1, 3, 5, 7])
def test_keep_n_saving_every_step_keeps_the_newest_n(tmp_path, keep):
    for step in range(1, 11):
        checkpointer.save(tmp_path, step, state(step), keep)
    assert names(tmp_path) == [f"ckpt_{s:08d}.pt" for s in range(11 - keep, 11)]


def test_a_resume_with_keep_5_keeps_every_earlier_checkpoint_it_has_room_for(tmp_path):
    for step in (10, 15, 20):
        checkpointer.save(tmp_path, step, state(step), keep=3)
    checkpointer.save(tmp_path, 25, state(25), keep=5)
    assert names(tmp_path) == [f"ckpt_{s:08d}.pt" for s in (10, 15, 20, 25)]


def test_pruning_deletes_only_this_runs_checkpoints_and_counts_only_whole_ones(tmp_path):
    for step in (1, 3):
        checkpointer.save(tmp_path, step, state(step), keep=9)
    checkpointer.write_file(tmp_path / "ckpt_00000000.pt", state(0, run_id="run-b"))  # another run's
    (tmp_path / "ckpt_00000002.pt").symlink_to(tmp_path / "ckpt_00000001.pt")  # the user's link, to one of ours
    data = bytearray((tmp_path / "ckpt_00000003.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged: not one of the `keep` whole ones
    (tmp_path / "ckpt_00000003.pt").write_bytes(data)
    checkpointer.save(tmp_path, 4, state(4), keep=2)
    assert names(tmp_path) == ["ckpt_00000000.pt", "ckpt_00000001.pt", "ckpt_00000002.pt", "ckpt_00000004.pt"]
    assert (tmp_path / "ckpt_00000002.pt").is_symlink()


def test_a_save_never_replaces_a_file_of_that_name_that_is_not_this_runs(tmp_path):
    os.mkfifo(tmp_path / "ckpt_00000002.pt")
    (tmp_path / "ckpt_00000003.pt").write_bytes(b"the user's")
    for step in (2, 3):
        with pytest.raises(checkpoint.CheckpointError, match=f"did not write checkpoint .*ckpt_0000000{step}.pt"):
            checkpointer.save(tmp_path, step, state(step))
    assert stat.S_ISFIFO(os.lstat(tmp_path / "ckpt_00000002.pt").st_mode)
    assert (tmp_path / "ckpt_00000003.pt").read_bytes() == b"the user's"


# ---- fastpt.train --resume over a real run folder


def run_args(data: Path, out: Path, *extra: str, steps: int = 4) -> list[str]:
    return tiny_args(data, out, *extra, max_steps=steps, log_every=1, eval_every=100, ckpt_every=2)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """Run a (tiny, checkpoints 2 and 4), run b: the same model in another folder, run c: another model."""
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for name, extra in (("a", ()), ("b", ()), ("c", ("--dim", "64", "--n-heads", "2"))):
        code, _, err = run_quietly(train.main, run_args(tiny_data, root / name, *extra))
        assert code == 0, err
        made[name] = root / name
    return made


def folder_state(folder: Path) -> dict[str, bytes]:
    return {p.name: b"fifo" if stat.S_ISFIFO(os.lstat(p).st_mode) else p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("other", ["b", "c"], ids=["another run of the model", "another model"])
@pytest.mark.parametrize("how", ["copy", "symlink"])
def test_another_runs_checkpoint_placed_as_the_newest_is_never_resumed(runs, tiny_data, tmp_path, capsys, other, how):
    """Run c's preset shape is the same as a's but for the keys given on its command line, which a's
    config.toml leaves out (the preset's): read from the newest checkpoint, they made a's run c's."""
    run_dir = tmp_path / "a"
    shutil.copytree(runs["a"], run_dir)
    placed = run_dir / "ckpt_00000006.pt"
    source = checkpoint.latest(runs[other])
    shutil.copy(source, placed) if how == "copy" else placed.symlink_to(source)
    before = folder_state(run_dir)
    code, _, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume", steps=8), capsys)
    assert_one_line_error(code, err, str(placed), "another run", "nothing was changed")
    assert folder_state(run_dir) == before


def test_an_old_run_folder_without_a_run_id_resumes_and_stays_without_one(runs, tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "old"
    shutil.copytree(runs["a"], run_dir)
    toml = run_dir / "config.toml"
    toml.write_text("".join(line for line in toml.read_text().splitlines(True) if not line.startswith("run_id")))
    for path in checkpoint.checkpoints(run_dir):  # as the release before run ids wrote them
        ckpt = torch.load(path, weights_only=True)
        del ckpt["train_config"]["run_id"]
        checkpointer.write_file(path, ckpt)
    code, out, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume", steps=6), capsys)
    assert code == 0 and f"resumed from {run_dir / 'ckpt_00000004.pt'}" in out, err
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 7))
    assert '\nrun_id = ""\n' in toml.read_text()  # none, as before
    assert checkpoint.run_id_of(torch.load(checkpoint.latest(run_dir), weights_only=True)) == ""


def test_a_new_run_records_its_id_in_config_toml_and_every_checkpoint(runs):
    run_id = next(line for line in (runs["a"] / "config.toml").read_text().splitlines() if line.startswith("run_id"))
    for path in checkpoint.checkpoints(runs["a"]):
        assert run_id == f'run_id = "{checkpoint.run_id_of(torch.load(path, weights_only=True))}"'
    other = (runs["b"] / "config.toml").read_text()
    assert run_id not in other and "run_id" in other


def test_a_fifo_named_like_the_newest_checkpoint_is_never_opened(runs, tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "a"
    shutil.copytree(runs["a"], run_dir)
    fifo = run_dir / "ckpt_00000008.pt"
    os.mkfifo(fifo)
    with no_wait_on_fifos(run_dir, 60):
        code, out, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume", steps=6), capsys)
        assert code == 0 and f"resumed from {run_dir / 'ckpt_00000004.pt'}" in out, err
        sample_args = ["--device", "cpu", "--max-new-tokens", "2", "--ckpt"]
        code, _, err = run_main(sample.main, [*sample_args, str(run_dir)], capsys)
        assert code == 0, err
        code, _, err = run_main(sample.main, [*sample_args, str(fifo)], capsys)
        assert_one_line_error(code, err, str(fifo), "a FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert names(run_dir) == ["ckpt_00000002.pt", "ckpt_00000004.pt", "ckpt_00000006.pt", "ckpt_00000008.pt"]


@pytest.mark.slow  # a torchrun launch of two processes
def test_every_rank_of_a_torchrun_run_carries_rank_0s_run_id(tiny_data, tmp_path):
    """Rank 1 checks the step's checkpoint name only once rank 0 has written it (late-save-on-rank):
    it finds its own run's checkpoint, not another run's, and the run ends as it should."""
    out = tmp_path / "run"
    args = [*tiny_args(tiny_data, out, max_steps=2), "--micro-batch", "2", "--kernels", "torch"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = faults.script_args("late-save-on-rank", 1, *args, nproc=2)
    result = subprocess.run(launch, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0 and "another run" not in result.stderr, failure_of(result)
    run_id = tomllib.loads((out / "config.toml").read_text())["run_id"]
    assert checkpoint.run_id_of(checkpoint.load(out / "ckpt_00000002.pt")) == run_id
