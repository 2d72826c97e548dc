"""A file a user names for a command's output (fastpt.plot --out, --plan-json, bench's --json and
--markdown) keeps what it replaces: its permissions, a read-only file, a training run's own files and
folders are refused before any work, and a FIFO nobody reads is said to be waited on."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from conftest import TINY, assert_one_line_error, run_main
from fastpt import files, plot, train
from fastpt.errors import ConfigError

PNG = b"\x89PNG\r\n\x1a\n"


def a_run(folder: Path) -> Path:
    """A run folder as fastpt.train leaves it (its own files, as far as an output is concerned)."""
    folder.mkdir()
    record = '{"step": %d, "loss": 3.0, "tokens": %d, "lr": 0.001, "tok_s": 100.0}\n'
    (folder / "metrics.jsonl").write_text(record % (1, 64) + record % (2, 128))
    (folder / "config.toml").write_text('preset = "tiny"\n')
    (folder / "ckpt_00000002.pt").write_bytes(b"a checkpoint")
    return folder


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755])
def test_a_replaced_output_keeps_its_permissions(tmp_path, mode):
    out = tmp_path / "plan.json"
    out.write_text("earlier")
    out.chmod(mode)
    files.write_output(out, lambda f: f.write(b"new"))
    assert out.read_bytes() == b"new" and out.stat().st_mode & 0o777 == mode


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.toml", "ckpt_00000002.pt", "ckpt_00000009.pt"])
def test_plot_out_one_of_the_runs_own_files_is_refused_and_it_stays(tmp_path, capsys, name):
    run_dir = a_run(tmp_path / "run")
    before = contents(run_dir)
    code, _, err = run_main(plot.main, [str(run_dir), "--out", str(run_dir / name)], capsys)
    assert_one_line_error(code, err, f"--out {run_dir / name}", f"training run {run_dir}")
    assert contents(run_dir) == before


def test_an_output_linked_to_a_runs_metrics_is_refused(tmp_path, capsys):
    run_dir = a_run(tmp_path / "run")
    link = tmp_path / "loss.png"
    link.symlink_to(run_dir / "metrics.jsonl")
    before = contents(run_dir)
    code, _, err = run_main(plot.main, [str(run_dir), "--out", str(link)], capsys)
    assert_one_line_error(code, err, f"--out {link}", "training run")
    assert contents(run_dir) == before and link.is_symlink()


def test_a_read_only_output_is_refused_and_kept(tmp_path, capsys):
    run_dir = a_run(tmp_path / "run")
    out = tmp_path / "loss.png"
    out.write_bytes(b"a plot kept on purpose")
    out.chmod(0o444)
    code, _, err = run_main(plot.main, [str(run_dir), "--out", str(out)], capsys)
    assert_one_line_error(code, err, f"--out {out} is read-only (mode 444)")
    assert out.read_bytes() == b"a plot kept on purpose" and out.stat().st_mode & 0o777 == 0o444


def test_the_output_is_refused_before_the_work(tmp_path, capsys):
    """Before the metrics are read (they are missing here) and before a plan is traced."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text('preset = "tiny"\n')
    code, _, err = run_main(plot.main, [str(run_dir), "--out", str(run_dir / "config.toml")], capsys)
    assert_one_line_error(code, err, "--out", "training run")
    for target in (run_dir / "metrics.jsonl", tmp_path):
        argv = [*TINY, "--plan", "--plan-json", str(target), "--out", str(tmp_path / "planned")]
        code, out, err = run_main(train.main, argv, capsys)
        assert_one_line_error(code, err, f"--plan-json {target}")
        assert out == "", out  # no plan was printed: none was made


def test_bench_refuses_a_runs_file_before_it_measures(tmp_path, capsys):
    from bench import kernel_table

    run_dir = a_run(tmp_path / "run")
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        kernel_table.main(["--device", "cpu", "--json", str(run_dir / "metrics.jsonl")])
    assert exit_info.value.code == 2 and time.monotonic() - started < 5
    assert "training run" in capsys.readouterr().err and (run_dir / "metrics.jsonl").read_bytes().startswith(b'{"step')


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
@pytest.mark.parametrize("kind", ["folder", "read-only file"])
def test_bench_refuses_a_folder_or_a_read_only_file_in_one_line_before_it_measures(tmp_path, capsys, flag, kind):
    from bench.__main__ import main as bench_main

    out = tmp_path / "out"
    if kind == "folder":
        out.mkdir()
    else:
        out.write_text("kept")
        out.chmod(0o444)
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--preset", "tiny", "--device", "cpu", "--steps", "2", flag, str(out)])
    said = capsys.readouterr()
    assert exit_info.value.code == 2 and "tok/s" not in said.out and "bench: eager" not in said.err, said
    assert flag in said.err and str(out) in said.err and "Traceback" not in said.err
    assert out.is_dir() if kind == "folder" else out.read_text() == "kept"


def test_a_fifo_that_nothing_reads_is_said_to_be_waited_on(tmp_path, capfd):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    writer = threading.Thread(target=files.write_output, args=(fifo, lambda f: f.write(b"the plan")), daemon=True)
    writer.start()
    deadline = time.monotonic() + 30
    while "waiting for a reader" not in (said := capfd.readouterr().err) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"fastpt: {fifo} is a FIFO that nothing reads yet: waiting for a reader" in said
    assert fifo.read_bytes() == b"the plan"
    writer.join(10)
    assert not writer.is_alive()


def test_check_output_names_the_flag_and_the_path(tmp_path):
    with pytest.raises(ConfigError, match=f"--json {tmp_path} is a folder: name a file"):
        files.check_output(tmp_path, "--json")
