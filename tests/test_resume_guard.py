"""--resume of a run folder that does not exist: a typo of a run's name is refused (the run folder's own
name or a folder above it), a sweep's next run starts, and --resume-or-start, the scripts' form, never
refuses and never guesses. --resume-require and --resume-or-start each mean --resume on their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_main, tiny_args, train_refuses
from fastpt import train
from fastpt.cli import parse_args, resumed_run
from fastpt.config import resolve
from fastpt.run_folder import check_out
from fastpt.typos import is_typo, one_edit_apart, sweep_siblings


def make_runs(root: Path, *names: str) -> None:
    """Run folders (a config.toml is what makes one) at these paths under root."""
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "config.toml").write_text('preset = "tiny"\n')


def checked(out: Path, *flags: str) -> str:
    """run_folder.check_out of a CPU run into `out` with these flags: the line a --resume starts with."""
    cli, config_file = parse_args(["--device", "cpu", "--out", str(out), *flags])
    return check_out(resolve(cli, config_file, "cpu", resumed_run(cli, config_file, "cpu")))


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("copyright", "copyrigth"),  # two letters swapped
        ("adamw", "adam"),  # one dropped
        ("run_a", "run-a"),  # a separator replaced
        ("runs", "run"),
    ],
)
def test_one_edit_inside_a_word_is_a_typo(typed, meant):
    assert one_edit_apart(typed, meant) and is_typo(typed, meant) and is_typo(meant, typed)


@pytest.mark.parametrize(
    "a, b", [("run-a", "run-b"), ("seed1", "seed2"), ("run", "run2"), ("lr3e-4", "lr1e-3"), ("bs64", "bs128")]
)
def test_names_that_differ_in_numbers_and_one_letter_labels_are_a_sweeps(a, b):
    assert sweep_siblings(a, b) and not is_typo(a, b) and not is_typo(b, a)


@pytest.mark.parametrize("a, b", [("copyright", "copyleft"), ("run", "runs-old"), ("abc", "cab"), ("x", "x")])
def test_more_than_one_edit_is_no_typo(a, b):
    assert not one_edit_apart(a, b) and not is_typo(a, b)


@pytest.mark.parametrize(
    "existing, typed, meant",
    [
        ("copyright", "copyrigth", "copyright"),
        ("runs8/x", "run8/x", "runs8/x"),
        ("runs8/x", "run8/y", "runs8/y"),
        ("exp/sweep/a", "epx/sweep/b", "exp/sweep/b"),
    ],
    ids=["run", "parent", "parent-new-run", "grandparent"],
)
def test_resume_of_a_typo_is_refused_before_any_work(tmp_path, capsys, no_work, existing, typed, meant):
    """A typo in the run folder's name, or in a folder above it (run8/x when runs8/x exists; the run
    need not exist there, its folder of runs does): one line naming the path meant, nothing made."""
    make_runs(tmp_path, existing)
    before = sorted(tmp_path.rglob("*"))
    train_refuses(
        capsys,
        ["--device", "cpu", "--out", str(tmp_path / typed), "--resume"],
        f"nothing to resume, {tmp_path / typed} does not exist (did you mean {tmp_path / meant}?)",
        "--resume-or-start never refuses",
    )
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    "existing, typed",
    [("run-a", "run-b"), ("seed1", "seed2"), ("sweep-a/x", "sweep-b/x"), ("lr3e-4", "lr1e-3"), ("runs/x", "other/x")],
)
def test_resume_of_a_sweeps_next_run_starts_it(tmp_path, existing, typed):
    make_runs(tmp_path, existing)
    out = tmp_path / typed
    assert checked(out, "--resume").endswith("; starting the run from step 0")


def test_resume_or_start_never_refuses_and_never_guesses(tmp_path):
    """The scripts' form: a typo'd name starts the run, the line names no other folder."""
    make_runs(tmp_path, "copyright", "runs8/x")
    for typed in ("copyrigth", "run8/x"):
        out = tmp_path / typed
        line = checked(out, "--resume-or-start")
        assert line == f"--resume-or-start: nothing to resume in {out}; starting the run from step 0"
    (tmp_path / "copyright" / "ckpt_00000001.pt").write_bytes(b"")
    assert checked(tmp_path / "copyright", "--resume-or-start") == ""  # a checkpoint: resumed


def test_resume_require_and_resume_or_start_alone_mean_resume(tmp_path, capsys, no_work):
    """As docs/training.md writes it: a script adds --resume-require (no --resume beside it)."""
    out = tmp_path / "missing"
    train_refuses(capsys, ["--device", "cpu", "--out", str(out), "--resume-require"], "--resume-require: nothing")
    assert not out.exists()
    cli, _ = parse_args(["--resume-or-start"])
    assert resolve(cli, None, "cpu").resume
    train_refuses(capsys, ["--device", "cpu", "--resume-require", "--no-resume"], "'resume_require' is a kind")
    train_refuses(capsys, ["--device", "cpu", "--resume-require", "--resume-or-start"], "disagree")


def test_resume_or_start_is_not_taken_from_a_run(tmp_path):
    """How a run was started is not what it is: a resume of it without the flag is plain --resume."""
    make_runs(tmp_path, "run")
    (tmp_path / "run" / "config.toml").write_text('preset = "tiny"\nresume = true\nresume_or_start = true\n')
    cli, config_file = parse_args(["--out", str(tmp_path / "run"), "--resume"])
    assert "resume_or_start" not in resumed_run(cli, config_file, "cpu")


def test_resume_to_fewer_steps_than_done_is_refused_and_changes_nothing(tiny_data, tmp_path, capsys):
    """--max-steps below the run's step rewrote config.toml's max_steps (and ended at once): refused in
    one line once the checkpoint is read, the folder as it was; at the step itself there is nothing to do."""
    out = tmp_path / "run"
    code, _, err = run_main(train.main, tiny_args(tiny_data, out, max_steps=2, ckpt_every=2), capsys)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    train_refuses(
        capsys,
        ["--device", "cpu", "--out", str(out), "--resume", "--max-steps", "1"],
        f"'max_steps' = 1 is below step 2, where --resume continues {out} from",
        "give --max-steps 2 or more",
    )
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    code, stdout, err = run_main(train.main, ["--device", "cpu", "--out", str(out), "--resume"], capsys)
    assert code == 0 and "nothing to do: the run is already at step 2 of max_steps 2" in stdout, err
