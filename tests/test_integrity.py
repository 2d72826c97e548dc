"""Checkpoint checksums (fastpt/integrity.py): a byte flipped inside a saved tensor, which torch.load
reads without a word, is a damaged checkpoint for --resume (a warning, the newest intact one taken),
sample and export (one line, exit 2); every way a DCP folder's checksums can go wrong, and a kill
around the checksum's write, give the documented result; checkpoints written before checksums load."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves

from conftest import REPO, assert_one_line_error, read_metrics, run_main, tiny_args
from fastpt import checkpoint, checkpointer, export, integrity, sample, train
from fastpt.errors import CheckpointError, run_command

MANIFEST = integrity.MANIFEST


def run_args(data: Path, out: Path, *extra: str) -> list[str]:
    """6 steps, every step logged, checkpoints at 3 and 6."""
    return tiny_args(data, out, *extra, max_steps=6, log_every=1, eval_every=3, ckpt_every=3)


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> Path:
    """A run with checkpoint files at steps 3 and 6, and DCP folders of the same two in dcp/."""
    out = tmp_path_factory.mktemp("integrity") / "reference"
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as done:
        mp.setattr("sys.argv", ["fastpt.train"])
        run_command(lambda: train.main(run_args(tiny_data, out)))
    assert done.value.code == 0
    for step in (3, 6):
        as_dcp_folder(out / f"ckpt_{step:08d}.pt", out / "dcp" / f"ckpt_{step:08d}")
    return out


def as_dcp_folder(file: Path, folder: Path) -> Path:
    """A checkpoint file rewritten as an FSDP run writes it, by checkpointer's own writer."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP in one process, no process group: intended here
        checkpointer._write_sharded(folder, checkpoint.load(file), is_main=True)
    return folder


def run_copy(reference: Path, run_dir: Path, kind: str) -> Path:
    """A copy of the reference run holding checkpoints 3 and 6 of one kind ('file' or 'dcp')."""
    shutil.copytree(reference, run_dir, ignore=shutil.ignore_patterns("dcp", "ckpt_*"))
    source = reference / "dcp" if kind == "dcp" else reference
    for step in (3, 6):
        name = f"ckpt_{step:08d}" + ("" if kind == "dcp" else ".pt")
        (shutil.copytree if kind == "dcp" else shutil.copy)(source / name, run_dir / name)
    return run_dir / ("ckpt_00000006" if kind == "dcp" else "ckpt_00000006.pt")


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def tensor_data_offset(path: Path) -> int:
    """The middle of the largest tensor storage in a checkpoint file (a zip whose members
    `archive/data/N` are the raw storages), read from the member's local header."""
    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_length, extra_length = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_length + extra_length + info.file_size // 2


def shard_data_offset(folder: Path) -> tuple[Path, int]:
    """A DCP folder's shard file holding its largest model tensor, and the middle of that tensor's
    bytes in it (from the folder's own metadata)."""
    storage = checkpoint._safe_dcp()[0](folder).read_metadata().storage_data
    index, info = max(
        ((i, s) for i, s in storage.items() if i.fqn.startswith("model.")), key=lambda item: item[1].length
    )
    return folder / info.relative_path, info.offset + info.length // 2


def tensors_differing(a: object, b: object) -> int:
    """How many elements differ between the tensors of two checkpoints (or models' state)."""
    pairs = zip(tree_leaves(a), tree_leaves(b), strict=True)
    return sum(int((x != y).sum()) for x, y in pairs if isinstance(x, torch.Tensor))


def as_before_checksums(path: Path) -> None:
    """Rewrite a checkpoint as fastpt wrote it before checksums: torch.save straight into the file
    (of a folder, its state.pt), and no checksums file."""
    if path.is_dir():
        state = torch.load(path / checkpoint.STATE_FILE, weights_only=True)
        torch.save(state, path / checkpoint.STATE_FILE)
        (path / MANIFEST).unlink()
    else:
        torch.save(torch.load(path, weights_only=True), path)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


def model_state(path: Path) -> dict:
    return checkpoint.load_model(path, torch.device("cpu"))[0].state_dict()


# ---- a flipped byte in a tensor


def test_a_flipped_byte_in_a_files_tensor_would_load_silently_and_is_damaged(reference, tmp_path):
    intact, newest = reference / "ckpt_00000006.pt", tmp_path / "ckpt_00000006.pt"
    shutil.copy(intact, newest)
    flip(newest, tensor_data_offset(newest))
    read = torch.load(newest, weights_only=True)  # what torch does without a checksum: no word, one element changed
    assert tensors_differing(read, torch.load(intact, weights_only=True)) == 1
    with pytest.raises(CheckpointError, match="its bytes do not match its checksum") as e:
        checkpoint.load(newest)
    assert str(e.value).startswith(f"could not read checkpoint {newest}: ")


def test_a_flipped_byte_in_a_dcp_shard_would_load_silently_and_is_damaged(reference, tmp_path):
    intact = reference / "dcp" / "ckpt_00000006"
    newest = tmp_path / "ckpt_00000006"
    shutil.copytree(intact, newest)
    shard, offset = shard_data_offset(newest)
    flip(shard, offset)
    with pytest.raises(CheckpointError, match=f"could not read checkpoint {shard}: its bytes do not match {MANIFEST}"):
        checkpoint.load(newest)
    as_before_checksums(newest)  # the same folder without checksums: DCP reads the changed element silently
    assert tensors_differing(model_state(newest), model_state(intact)) == 1


@pytest.mark.parametrize("kind", ["file", pytest.param("dcp", marks=pytest.mark.slow)])
def test_resume_warns_naming_the_damaged_checkpoint_and_takes_the_newest_intact_one(
    reference, tiny_data, tmp_path, capsys, kind
):
    run_dir = tmp_path / "run"
    newest = run_copy(reference, run_dir, kind)
    damaged, offset = (newest, tensor_data_offset(newest)) if kind == "file" else shard_data_offset(newest)
    flip(damaged, offset)
    code, out, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume", "--max-steps", "4"), capsys)
    assert code == 0, err
    assert f"resumed from {run_dir / checkpoint.checkpoints(run_dir)[0].name} at step 3" in out
    warning = (
        f"fastpt: warning: skipped a newer checkpoint: could not read checkpoint {damaged}: its bytes do not match"
    )
    assert err.count("\n") == 1 and err.startswith(warning), err
    assert losses(run_dir) == losses(reference)[:4]  # step 4 trained again, identically


def test_a_damaged_newest_checkpoint_is_set_aside_and_never_counts_toward_the_kept_ones(
    reference, tiny_data, tmp_path, capsys
):
    """Resumed from step 3 past a damaged step 6, the run saves 4 and 5 keeping one: pruning by step
    would keep the damaged 6 as the newest and delete what the run just saved."""
    run_dir = tmp_path / "run"
    newest = run_copy(reference, run_dir, "file")
    flip(newest, tensor_data_offset(newest))
    extra = ("--resume", "--max-steps", "5", "--ckpt-every", "1", "--keep-checkpoints", "1")
    code, out, err = run_main(train.main, run_args(tiny_data, run_dir, *extra), capsys)
    assert code == 0, err
    assert err.rstrip().endswith("; moved aside as ckpt_00000006.pt.damaged") and err.count("\n") == 1, err
    assert f"saved {run_dir / 'ckpt_00000005.pt'}" in out
    assert checkpoint.checkpoints(run_dir) == [run_dir / "ckpt_00000005.pt"]
    assert (run_dir / "latest").read_text() == "ckpt_00000005.pt"
    assert (run_dir / "ckpt_00000006.pt.damaged").read_bytes() != (reference / "ckpt_00000006.pt").read_bytes()
    assert losses(run_dir)[:4] == losses(reference)[:4]  # step 4 trained again, identically


def test_a_saved_checkpoint_is_on_disk_whatever_newer_one_the_folder_holds(tmp_path):
    """ "saved X" means X is there afterwards: a newer checkpoint (one this run did not write) is
    neither counted among the kept ones nor deleted."""
    newer = tmp_path / "ckpt_00000020.pt"
    newer.write_bytes(b"not this run's")
    state = {"model": {"w": torch.ones(2)}, "model_config": {}, "train_state": {"step": 16}}
    saved = checkpointer.save(tmp_path, 16, state, keep=1)
    assert saved == tmp_path / "ckpt_00000016.pt" and saved.is_file() and newer.is_file()
    assert checkpointer.save(tmp_path, 17, state, keep=1).is_file() and not saved.exists()


@pytest.mark.parametrize("kind", ["file", "dcp"])
def test_sample_and_export_of_a_damaged_checkpoint_are_one_line(reference, tmp_path, capsys, kind):
    newest = run_copy(reference, tmp_path / "run", kind)
    damaged, offset = (newest, tensor_data_offset(newest)) if kind == "file" else shard_data_offset(newest)
    flip(damaged, offset)
    code, _, err = run_main(sample.main, ["--ckpt", str(newest), "--device", "cpu", "--max-new-tokens", "1"], capsys)
    assert_one_line_error(code, err, f"could not read checkpoint {damaged}: its bytes do not match")
    code, _, err = run_main(export.main, [str(newest), "--out", str(tmp_path / "hf")], capsys)
    assert_one_line_error(code, err, f"could not read checkpoint {damaged}: its bytes do not match")
    assert not (tmp_path / "hf").exists()


# ---- checkpoints written before checksums


@pytest.mark.parametrize("kind", ["file", pytest.param("dcp", marks=pytest.mark.slow)])
def test_a_checkpoint_written_before_checksums_loads_with_one_warning(reference, tiny_data, tmp_path, capsys, kind):
    run_dir = tmp_path / "run"
    newest = run_copy(reference, run_dir, kind)
    as_before_checksums(newest)
    unverified = f"fastpt: warning: {newest} carries no checksum (written before fastpt wrote them)"
    code, out, err = run_main(sample.main, ["--ckpt", str(newest), "--device", "cpu", "--max-new-tokens", "1"], capsys)
    assert code == 0 and err.startswith(unverified + ": loaded without checking its bytes\n"), err
    assert err.count("fastpt: warning") == 1, err
    code, out, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume", "--max-steps", "7"), capsys)
    assert code == 0 and f"resumed from {newest} at step 6" in out and err.count(unverified) == 1, err
    assert integrity.verify(checkpoint.latest(run_dir), checkpoint.STATE_FILE)  # what it wrote carries one


def test_a_checksum_is_an_ordinary_zip_comment(reference):
    """Any zip reader takes the file as it is, and the CRC covers every byte before the comment."""
    path = reference / "ckpt_00000006.pt"
    data = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        assert zf.comment == b"fastpt crc32 %08x" % zlib.crc32(data[: -integrity.TRAILER])


# ---- the campaign: every way a checksum or a DCP folder can go wrong


def truncate(path: Path, keep) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep(data)])


def set_tail(path: Path, tail: bytes) -> None:
    path.write_bytes(path.read_bytes()[: -len(tail)] + tail)


def swap_in(name: str):
    """Replace the newest checkpoint's `name` with the same file of the older checkpoint."""
    return lambda newest, older: shutil.copy(older / name, newest / name)


DCP_DAMAGE = {  # name -> (what is done to ckpt_6 given ckpt_3, what the one line says after "checkpoint ")
    "checksums file missing": (lambda new, old: (new / MANIFEST).unlink(), "{new}: its checksums.crc32 is missing"),
    "checksums file cut mid-line": (
        lambda new, old: truncate(new / MANIFEST, lambda d: len(d) // 2),
        "{new}: checksums.crc32 is damaged (line",
    ),
    "checksums file without its last line": (
        lambda new, old: truncate(new / MANIFEST, lambda d: d.rstrip(b"\n").rindex(b"\n") + 1),
        "{new}: state.pt is not listed in checksums.crc32",
    ),
    "checksums file of random bytes": (
        lambda new, old: (new / MANIFEST).write_bytes(os.urandom(64)),
        "{new}: checksums.crc32 is damaged (line 1)",
    ),
    "checksums file of another checkpoint": (swap_in(MANIFEST), "{new}/.metadata: its bytes do not match"),
    "a shard of another checkpoint": (swap_in("__0_0.distcp"), "{new}/__0_0.distcp: its bytes do not match"),
    "state.pt of another checkpoint": (swap_in("state.pt"), "{new}/state.pt: its bytes do not match"),
    "a truncated .distcp": (
        lambda new, old: truncate(new / "__0_0.distcp", lambda d: len(d) - 100),
        "{new}/__0_0.distcp: it has ",
    ),
    "a shard missing": (
        lambda new, old: (new / "__0_0.distcp").unlink(),
        "{new}: __0_0.distcp is missing; it is listed in checksums.crc32",
    ),
    "a file added": (
        lambda new, old: (new / "notes.txt").write_text("hi"),
        "{new}: notes.txt is not listed in checksums.crc32",
    ),
}

FILE_DAMAGE = {
    "checksum cut short": (lambda new, old: truncate(new, lambda d: len(d) - 3), "{new}: its checksum (zip comment)"),
    "checksum digits damaged": (lambda new, old: set_tail(new, b"g"), "{new}: its checksum (zip comment) is damaged"),
    "checksum of another checkpoint": (
        lambda new, old: set_tail(new, old.read_bytes()[-integrity.TRAILER :]),
        "{new}: its bytes do not match its checksum",
    ),
    # a weight changed too: taken for a file without a checksum, it would load with the change
    "checksum tag damaged": (
        lambda new, old: (flip(new, tensor_data_offset(new)), flip(new, new.stat().st_size - integrity.TRAILER)),
        "{new}: its checksum (zip comment) is damaged",
    ),
    "comment length damaged": (
        lambda new, old: (flip(new, tensor_data_offset(new)), flip(new, new.stat().st_size - integrity.TRAILER - 2)),
        "{new}: its checksum (zip comment) is damaged",
    ),
}


@pytest.mark.parametrize("case", [*DCP_DAMAGE, *FILE_DAMAGE])
def test_each_damaged_checksum_or_shard_is_one_line_for_sample(reference, tmp_path, capsys, case):
    kind = "dcp" if case in DCP_DAMAGE else "file"
    damage, said = {**DCP_DAMAGE, **FILE_DAMAGE}[case]
    newest = run_copy(reference, tmp_path / "run", kind)
    damage(newest, newest.with_name("ckpt_00000003" + newest.suffix))
    code, _, err = run_main(sample.main, ["--ckpt", str(newest), "--device", "cpu", "--max-new-tokens", "1"], capsys)
    assert_one_line_error(code, err, "could not read checkpoint " + said.format(new=newest))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["a shard of another checkpoint", "checksums file missing", "a truncated .distcp"])
def test_resume_skips_a_dcp_folder_whose_checksums_fail(reference, tiny_data, tmp_path, capsys, case):
    run_dir = tmp_path / "run"
    newest = run_copy(reference, run_dir, "dcp")
    damage, said = DCP_DAMAGE[case]
    damage(newest, run_dir / "ckpt_00000003")
    code, out, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume", "--max-steps", "4"), capsys)
    assert code == 0 and f"resumed from {run_dir / 'ckpt_00000003'} at step 3" in out, err
    assert err.startswith(
        "fastpt: warning: skipped a newer checkpoint: could not read checkpoint " + said.format(new=newest)
    )
    assert err.count("\n") == 1, err


# ---- a kill around the checksum's write

KILLED_SAVE = r"""
import os, signal, sys, warnings
from pathlib import Path
from fastpt import checkpoint, checkpointer, files, integrity
point, source, run_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if point == "file: data written, checksum not":
    integrity._ChecksumWriter.close = lambda self: (self.f.write(self.held), self.f.flush(), die())
elif point == "folder: shards and state written, checksums not":
    integrity.write_manifest = die
elif point == "folder: checksums written, not yet published":
    checkpointer.publish = die
state = checkpoint.load(source)
warnings.simplefilter("ignore")
if point.startswith("folder"):
    checkpointer._write_sharded(run_dir / source.name.removesuffix(".pt"), state, True)
else:
    checkpointer.save(run_dir, checkpoint.step_of(state), state)
"""


@pytest.mark.parametrize(
    "point",
    [
        "file: data written, checksum not",
        pytest.param("folder: shards and state written, checksums not", marks=pytest.mark.slow),
        pytest.param("folder: checksums written, not yet published", marks=pytest.mark.slow),
    ],
)
def test_a_save_killed_around_its_checksum_leaves_the_old_checkpoint_intact(reference, tmp_path, point):
    """A resumed attempt re-saving step 6 is SIGKILLed between writing the data and its checksum:
    the step-6 checkpoint on disk is the old one, whole and verified (never a false "damaged"), and
    what the killed save left is never taken for a checkpoint."""
    kind = "dcp" if point.startswith("folder") else "file"
    run_dir = tmp_path / "run"
    newest = run_copy(reference, run_dir, kind)
    before = {p.name: p.read_bytes() for p in ([newest] if kind == "file" else sorted(newest.iterdir()))}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_SAVE, point, str(reference / "ckpt_00000006.pt"), str(run_dir)],
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert checkpoint.latest(run_dir) == newest
    assert {p.name: p.read_bytes() for p in ([newest] if kind == "file" else sorted(newest.iterdir()))} == before
    assert integrity.verify(newest, checkpoint.STATE_FILE)
    leftovers = [p.name for p in run_dir.iterdir() if p.name.startswith(".ckpt_")]
    assert leftovers and all(".tmp" in name or name.endswith(".partial") for name in leftovers), leftovers
