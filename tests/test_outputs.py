"""What fastpt's commands write, when things go wrong: fastpt.plot on what a crash leaves, output
paths that are not regular files (written through, never replaced), caches that lie, a full disk
or a file-size limit in prepare and export, and folders published in one step or put back after a
kill between two renames."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    REPO,
    TINY,
    assert_one_line_error,
    ckpt_names,
    folder_bytes,
    mount_tmpfs,
    run_args,
    run_command_line,
    run_main,
    train_here,
)
from fastpt import checkpoint, files
from fastpt.data.shards import write_shard

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


# ---- output paths that are not regular files: written through, never replaced


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


# ---- a full disk in prepare and export: one line naming the path and the OS's reason, exit 1


def big_corpus(tmp_path: Path) -> Path:
    text = (REPO / "fastpt" / "train.py").read_text()
    (tmp_path / "big.txt").write_text(text * (3 * 2**20 // len(text)))  # 3 MB: 6 MB of uint16 shards
    return tmp_path / "big.txt"


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 3 MiB filesystem."""
    yield from mount_tmpfs(tmp_path / "disk", "3m")


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
