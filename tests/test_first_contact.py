"""What a newcomer trips on: a --resume that says what it resumes or why it starts
afresh, --out refused before any work, the CPU thread count, and the silent mistakes of the tryout
(--parallel fsdp without torchrun, --init-from a run folder, a binary file in a prepared folder)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_one_line_error, run_main, run_quietly, tiny_args, train_refuses
from fastpt import cores, distributed, files, prepare, sample, train


@pytest.fixture(scope="module")
def finished(tiny_data, tmp_path_factory) -> Path:
    """A 1-step tiny run: its config.toml and checkpoint."""
    out = tmp_path_factory.mktemp("first") / "copyright"
    code, _, err = run_quietly(train.main, tiny_args(tiny_data, out, max_steps=1))
    assert code == 0, err
    return out


@pytest.fixture
def runs(finished, tmp_path) -> Path:
    """A folder of runs, as `runs/` after the quick start: runs/copyright."""
    shutil.copytree(finished, tmp_path / "runs" / "copyright")
    return tmp_path / "runs"


def test_resume_of_a_typo_refuses_naming_the_nearest_run(runs, tiny_data, capsys, no_work):
    """A --resume whose folder is missing and whose name is near a run's is a typo: refused
    (exit 2) before any work, not a new run trained into it."""
    typo = runs / "copyrigth"
    train_refuses(
        capsys,
        tiny_args(tiny_data, typo, "--resume", max_steps=1),
        f"--resume: nothing to resume, {typo} does not exist (did you mean {runs / 'copyright'}?): "
        "give that run's folder, or drop --resume to start a new run here",
    )
    assert not typo.exists()


def test_resume_of_the_next_numbered_run_starts_it_naming_the_nearest(runs, tiny_data, capsys):
    """A name that differs from a run's only in its digits (copyright2 beside copyright, seed2 beside
    seed1) is a sweep's next run, which a script that always passes --resume starts: it starts, saying so."""
    sibling = runs / "copyright2"
    code, out, err = run_main(train.main, tiny_args(tiny_data, sibling, "--resume", max_steps=1), capsys)
    assert code == 0, err
    assert out.startswith(
        f"--resume: nothing to resume, {sibling} does not exist (did you mean {runs / 'copyright'}?); "
        "starting the run from step 0\n"
    ), out


def test_resume_in_a_folder_without_checkpoint_says_so(runs, tiny_data, capsys):
    empty = runs.parent / "empty"
    empty.mkdir()
    code, out, err = run_main(train.main, tiny_args(tiny_data, empty, "--resume", max_steps=1), capsys)
    assert code == 0, err
    assert f"--resume: nothing to resume, {empty} holds no checkpoint; starting the run from step 0" in out


def test_resume_says_which_checkpoint(runs, tiny_data, capsys):
    run_dir = runs / "copyright"
    code, out, err = run_main(train.main, tiny_args(tiny_data, run_dir, "--resume", max_steps=2), capsys)
    assert code == 0, err
    assert f"resumed from {run_dir / 'ckpt_00000001.pt'} at step 1" in out


def test_resume_require_refuses_to_start_over(runs, tiny_data, capsys, no_work):
    typo = runs / "copyrigth"
    train_refuses(
        capsys,
        tiny_args(tiny_data, typo, "--resume", "--resume-require"),
        f"--resume-require: nothing to resume, {typo} does not exist (did you mean {runs / 'copyright'}?)",
    )
    assert not typo.exists()
    train_refuses(capsys, tiny_args(tiny_data, typo, "--resume=require"), "--resume-require: nothing to resume")
    assert not typo.exists()
    train_refuses(capsys, tiny_args(tiny_data, typo, "--resume-require"), "--resume-require: nothing to resume")
    assert not typo.exists()


@pytest.mark.parametrize("resume", ["--resume", "--resume=require"])
def test_a_run_whose_every_checkpoint_is_damaged_never_starts_over(runs, tiny_data, capsys, resume):
    """Damaged is not absent: plain --resume refuses too (a copy damaged in transfer can be fetched
    again), in one line naming every checkpoint it tried, and changes nothing in the folder."""
    run_dir = runs / "copyright"
    shutil.copy(run_dir / "ckpt_00000001.pt", run_dir / "ckpt_00000002.pt")
    for path in run_dir.glob("ckpt_*.pt"):
        with open(path, "r+b") as f:  # a bit flipped inside the checksummed bytes
            f.seek(path.stat().st_size // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 1]))
    files = lambda: {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"}  # noqa: E731
    before = files()
    train_refuses(
        capsys,
        tiny_args(tiny_data, run_dir, resume, max_steps=3),
        f"no checkpoint in {run_dir} loads (ckpt_00000002.pt, ckpt_00000001.pt); newest: could not read checkpoint",
        "nothing was changed: mend or move them away to start the run over, or choose another --out",
    )
    assert files() == before


@pytest.mark.parametrize("resume", [[], ["--resume"]])
def test_a_folder_of_runs_is_refused_as_out(runs, tiny_data, capsys, no_work, resume):
    before = sorted(p.name for p in runs.rglob("*"))
    train_refuses(
        capsys,
        tiny_args(tiny_data, runs, *resume),
        f"--out {runs} holds other runs (copyright): give one run's own folder, e.g. --out {runs / 'copyright'}",
    )
    assert sorted(p.name for p in runs.rglob("*")) == before


def test_an_occupied_out_is_refused_before_any_work(runs, tiny_data, capsys, no_work):
    train_refuses(
        capsys,
        tiny_args(tiny_data, runs / "copyright", "--micro-batch", "auto"),
        f"{runs / 'copyright'} already holds a run (newest checkpoint ckpt_00000001.pt): add --resume",
    )


def test_a_folder_another_trainer_holds_is_refused_before_any_work(runs, tiny_data, capsys, no_work):
    run_dir = runs / "copyright"
    with files.lock(run_dir / ".lock", "trainer"):
        train_refuses(
            capsys,
            tiny_args(tiny_data, run_dir, "--resume", "--micro-batch", "auto"),
            f"{run_dir} is in use by another trainer (pid {os.getpid()}",
        )


def test_a_checkpoint_a_killed_save_left_aside_occupies_the_folder(runs, tiny_data, capsys, no_work):
    run_dir = runs / "copyright"
    (run_dir / "ckpt_00000001.pt").rename(run_dir / ".ckpt_00000001.pt.old")
    train_refuses(capsys, tiny_args(tiny_data, run_dir), "already holds a run (newest checkpoint ckpt_00000001.pt)")


def test_an_out_that_cannot_be_listed_is_one_line(runs, tiny_data, capsys, monkeypatch, no_work):
    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "iterdir", denied)  # as chmod 000 would, which root ignores
    train_refuses(capsys, tiny_args(tiny_data, runs), f"--out {runs}: cannot read it (Permission denied)")


def test_default_threads_keep_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torch took it at start (conftest sets both)
    monkeypatch.setattr(distributed.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert distributed.cpu_threads(0) == torch.get_num_threads() == 1


def test_default_threads_leave_the_busy_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cores, "all_cores", lambda: 16)
    monkeypatch.setattr(distributed.os, "getloadavg", lambda: (3.4, 0.0, 0.0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert distributed.cpu_threads(0) == 13
    assert distributed.cpu_threads(5) == 5 and distributed.cpu_threads(100_000) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert distributed.cpu_threads(0) == 6
    monkeypatch.setattr(distributed.os, "getloadavg", lambda: (40.0, 0.0, 0.0))
    assert distributed.cpu_threads(0) == 1
    monkeypatch.setattr(cores, "all_cores", lambda: 2)
    monkeypatch.setattr(distributed.os, "getloadavg", lambda: (0.7, 0.0, 0.0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert distributed.cpu_threads(0) == 2  # a partly busy core still counts: 1.45x faster than 1 thread
    monkeypatch.setattr(distributed.os, "getloadavg", lambda: (2.1, 0.0, 0.0))
    assert distributed.cpu_threads(0) == 1


def test_threads_are_capped_at_the_cores_set_and_named_in_the_summary(tiny_data, tmp_path, capsys, monkeypatch):
    """--threads beyond the cores this process may use (5,000 starved a 2-core machine, 100,000 crashed
    torch and left the run's lock behind) is capped at them, with one line saying so."""
    monkeypatch.setattr(cores, "all_cores", lambda: 1)
    before = torch.get_num_threads()
    try:
        code, out, err = run_main(train.main, tiny_args(tiny_data, tmp_path / "run", threads=5000, max_steps=1), capsys)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert code == 0, err
    assert "| kernels torch (auto) | threads 1 | MFU" in out
    warning = "fastpt: warning: --threads 5000 is more than the 1 core this process may use: using 1\n"
    assert err.startswith(warning) and err.count(warning) == 1, err


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp_without_torchrun_says_so_once(tiny_data, tmp_path, capsys, optimizer):
    args = tiny_args(tiny_data, tmp_path / "run", parallel="fsdp", optimizer=optimizer, max_steps=2, log_every=1)
    code, _, err = run_main(train.main, args, capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "--parallel fsdp" in line]
    assert warnings == [
        "fastpt: warning: --parallel fsdp shards over torchrun's processes (torchrun --nproc-per-node N, N >= 2); "
        "this run is one process, unsharded"
    ], err


@pytest.mark.parametrize("plan", [[], ["--plan"]])
def test_init_from_a_run_folder_suggests_resume_or_export(runs, tiny_data, tmp_path, capsys, plan):
    run_dir = runs / "copyright"
    train_refuses(
        capsys,
        tiny_args(tiny_data, tmp_path / "new", "--init-from", str(run_dir), *plan),
        f"{run_dir} is a fastpt run folder, not a Hugging Face model folder: continue it with --resume --out {run_dir}",
        f"python -m fastpt.export {run_dir} --out DIR",
    )


def test_prepare_names_a_binary_file_and_skips_it_when_asked(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n" * 200)
    (corpus / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    args = [str(corpus), "--tokenizer", "bytes", "--workers", "1", "--out", str(tmp_path / "data")]
    code, _, err = run_main(prepare.main, args, capsys)
    assert_one_line_error(code, err, f"{corpus / 'logo.png'}: not text", "--skip-binary")
    assert not (tmp_path / "data").exists()
    code, out, err = run_main(prepare.main, [*args, "--skip-binary"], capsys)
    assert code is None or code == 0, err
    assert f"--skip-binary: left out 1 file(s) that are not text: {corpus / 'logo.png'}" in out
    assert (tmp_path / "data" / "meta.json").is_file()


def test_prepare_without_inputs_says_it_reads_the_standard_library(tmp_path, capsys, monkeypatch):
    """A newcomer who gives no inputs learns what the corpus is (here two of its files)."""
    monkeypatch.setattr(prepare, "stdlib_sources", lambda: [Path(os.__file__), Path(os.__file__).with_name("abc.py")])
    code, out, err = run_main(prepare.main, ["--tokenizer", "bytes", "--workers", "1", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert out.startswith("no inputs given: the corpus is the Python standard library's source (2 .py files in "), out


def test_sample_of_a_data_folder_says_it_is_one(tiny_data, capsys):
    """Not 'train with --out DATA first', which would train into the data folder."""
    code, _, err = run_main(sample.main, ["--ckpt", str(tiny_data), "--device", "cpu"], capsys)
    assert_one_line_error(code, err, f"{tiny_data} is a data folder (token shards), not a run")


@pytest.mark.parametrize("garbled", [b"garbage" * 100, b"PK\x03\x04" + bytes(range(256)) * 4])
def test_a_garbled_checkpoint_is_one_line_of_fastpts_own(tmp_path, capsys, garbled):
    """No torch advice on torch.save's zipfile option for a file that is no checkpoint."""
    bad = tmp_path / "ckpt_00000001.pt"
    bad.write_bytes(garbled)
    code, _, err = run_main(sample.main, ["--ckpt", str(bad), "--device", "cpu"], capsys)
    assert_one_line_error(code, err, f"could not read checkpoint {bad}: not a whole checkpoint (cut short, or another")
    assert "torch.save" not in err and "zip" not in err, err
