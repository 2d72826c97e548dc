"""What fastpt.train says about a --data that is not prepared data, or an --out that lies in it: one
line that names what to give instead, before any run folder is made."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import run_quietly, tiny_args, train_refuses
from fastpt import train


@pytest.fixture(scope="module")
def finished_run(tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data_inputs") / "run"
    code, _, err = run_quietly(train.main, tiny_args(tiny_data, out, max_steps=1))
    assert code == 0, err
    return out


@pytest.mark.parametrize("inside", ["", "run", "runs/a"])
def test_out_equal_to_or_inside_data_is_refused(tiny_data, tmp_path, capsys, inside):
    """A run into the data folder trained among its shards (its checkpoints, config and metrics beside them)."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    before = sorted(data.rglob("*"))
    out = data / inside
    where = "is" if not inside else "is inside"
    train_refuses(capsys, tiny_args(data, out), f"--out {out} {where} the data folder {data}")
    assert sorted(data.rglob("*")) == before


def test_out_given_another_way_into_data_is_refused(tiny_data, tmp_path, capsys, monkeypatch):
    """Relative, with `..`, through a mixture: the folder is what counts, not its spelling."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    monkeypatch.chdir(tmp_path)
    args = tiny_args(Path("data"), Path("./data/x/../y"))
    train_refuses(capsys, args, "--out data/x/../y is inside the data folder data")
    train_refuses(capsys, tiny_args(Path(f"{tiny_data}:1,data:1"), Path("data/run")), "is inside the data folder data")
    assert not (data / "y").exists() and not (data / "run").exists()


def test_a_run_folder_as_data_is_named_as_one(finished_run, tmp_path, capsys):
    """Not 'prepare it first with fastpt.prepare': a run folder holds checkpoints, not text to tokenize."""
    out = tmp_path / "new"
    train_refuses(
        capsys,
        tiny_args(finished_run, out),
        f"--data {finished_run} is a training run's folder (config.toml, checkpoints), not data",
    )
    assert not out.exists()


def test_nanogpt_format_on_llmc_shards_says_drop_it(tiny_data, tmp_path, capsys):
    out = tmp_path / "new"
    train_refuses(
        capsys,
        tiny_args(tiny_data, out, "--data-format", "nanogpt"),
        f"data folder {tiny_data} holds llm.c-format shards (train_*.bin): drop --data-format nanogpt",
    )
    assert not out.exists()


def test_a_folder_of_folders_of_text_is_told_to_prepare_it(tmp_path, capsys):
    """Text one folder down (a corpus checked out as it came) got only 'has no *train_*.bin files'."""
    text = tmp_path / "corpus"
    (text / "books").mkdir(parents=True)
    (text / "books" / "a.txt").write_text("Call me Ishmael.\n")
    out = tmp_path / "new"
    train_refuses(capsys, tiny_args(text, out), f"data folder {text} holds text", "python -m fastpt.prepare")
    (text / "books" / "a.txt").unlink()
    train_refuses(capsys, tiny_args(text, out), f"data folder {text} has no *train_*.bin files")
    assert not out.exists()
