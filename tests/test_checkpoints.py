"""Checkpoints: loading one never runs code from it (a single file or a DCP folder, through every
command that loads one), and the checkpoints earlier releases wrote still load and resume exactly."""
from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import TINY, assert_one_line_error, read_metrics, run_main
from fastpt import checkpoint, export, sample, train


def run_args(data: Path, out: Path, *extra: str) -> list[str]:
    """6 steps, every step logged, checkpoints at 4 and 6."""
    return [*TINY, "--data", str(data), "--out", str(out), "--max-steps", "6", "--log-every", "1",
            "--eval-every", "3", "--ckpt-every", "4", *extra]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "reference"
    with pytest.MonkeyPatch.context() as mp:  # run_main needs capsys; a module fixture has none
        mp.setattr("sys.argv", ["fastpt.train"])
        with pytest.raises(SystemExit) as done:
            from fastpt.errors import run_command
            run_command(lambda: train.main(run_args(tiny_data, out)))
    assert done.value.code == 0
    return out


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


class CreatesAFile:
    """What a crafted checkpoint carries: unpickling it calls open(path, "w")."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def crafted_file(path: Path, marker: Path) -> Path:
    torch.save({"model_config": {}, "step": 1, "train_state": {"step": 1}, "payload": CreatesAFile(marker)}, path)
    return path


def crafted_dcp_folder(reference: Path, path: Path, marker: Path) -> Path:
    """A shard folder with a genuine state.pt and a .metadata pickle that runs code."""
    path.mkdir()
    ckpt = checkpoint.load(checkpoint.latest(reference))
    torch.save({k: v for k, v in ckpt.items() if k not in checkpoint.TENSOR_KEYS}, path / checkpoint.STATE_FILE)
    (path / ".metadata").write_bytes(pickle.dumps(CreatesAFile(marker)))
    return path


@pytest.mark.parametrize("kind", ["file", "dcp folder"])
@pytest.mark.parametrize("command", ["train --resume", "sample", "export"])
def test_a_crafted_checkpoint_is_refused_and_its_payload_never_runs(reference, tiny_data, tmp_path, capsys,
                                                                     kind, command):
    marker = tmp_path / "created-by-the-payload"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    name = "ckpt_00000004"
    path = (crafted_file(run_dir / f"{name}.pt", marker) if kind == "file"
            else crafted_dcp_folder(reference, run_dir / name, marker))
    argv = {"train --resume": (train.main, run_args(tiny_data, run_dir, "--resume")),
            "sample": (sample.main, ["--ckpt", str(path), "--device", "cpu", "--max-new-tokens", "2"]),
            "export": (export.main, [str(path), "--out", str(tmp_path / "hf")])}[command]
    code, _, err = run_main(*argv, capsys)
    payload = path if kind == "file" else path / ".metadata"
    assert_one_line_error(code, err, f"refused to load {payload}: it names ", "could run code")
    assert "open" in err  # the global the payload calls is named
    assert not marker.exists()
    assert not (tmp_path / "hf").exists()


def legacy(ckpt: dict) -> dict:
    """A checkpoint as the previous release wrote it: NumPy's RNG state as its legacy tuple (an
    array inside, which torch.load(weights_only=True) refuses by default), the step stored twice."""
    rng = ckpt["rng"]
    np_state = np.random.RandomState()
    np_state.set_state({**rng["numpy"], "state": {**rng["numpy"]["state"],
                                                  "key": rng["numpy"]["state"]["key"].numpy().astype(np.uint32)}})
    old = {k: ckpt[k] for k in ("model", "optimizer", "scaler", "loader", "model_config", "train_config")}
    return {**old, "rng": {**rng, "numpy": np_state.get_state()}, "step": ckpt["train_state"]["step"],
            "train_state": ckpt["train_state"]}


def test_a_checkpoint_of_the_previous_release_resumes_exactly(reference, tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = checkpoint.load(reference / "ckpt_00000004.pt")
    torch.save(legacy(ckpt), run_dir / "ckpt_00000004.pt")
    assert isinstance(torch.load(run_dir / "ckpt_00000004.pt", weights_only=False)["rng"]["numpy"][1], np.ndarray)
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    code, out, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume"), capsys)
    assert code == 0, err
    assert "at step 4" in out
    assert losses(run_dir) == losses(reference)  # the NumPy and Python RNG came back too


def as_dcp_folder(ckpt: dict, path: Path) -> None:
    """The checkpoint as an FSDP run writes it: model and optimizer as DCP shards, the rest in state.pt."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP in one process, no process group: intended here
        dcp.save({k: ckpt[k] for k in checkpoint.TENSOR_KEYS}, checkpoint_id=path)
    torch.save({k: v for k, v in ckpt.items() if k not in checkpoint.TENSOR_KEYS}, path / checkpoint.STATE_FILE)


def test_a_dcp_folder_resumes_through_the_safe_reader(reference, tiny_data, tmp_path, capsys):
    """The restricted metadata unpickler and the weights-only planner read a real DCP folder whole:
    model, and optimizer state with its non-tensor hyperparameters."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    as_dcp_folder(checkpoint.load(reference / "ckpt_00000004.pt"), run_dir / "ckpt_00000004")
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    code, out, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume"), capsys)
    assert code == 0, err
    assert f"resumed from {run_dir / 'ckpt_00000004'} at step 4" in out
    assert losses(run_dir) == losses(reference)
