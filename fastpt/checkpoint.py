"""Atomic checkpoints: temp file + fsync + rename, then a `latest` pointer; keep the last K."""
from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

import torch

# ckpt_N.pt is one file; ckpt_N/ is a directory of FSDP shards (torch.distributed.checkpoint)
# plus STATE_FILE with the rest of the state, written by fastpt.distributed.save_sharded.
NAME = re.compile(r"^ckpt_(\d{8})(\.pt)?$")
STATE_FILE = "state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write) -> None:
    """Call write(file) on a temp name, fsync, rename over path: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints (renamed into place), oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if NAME.match(p.name))


def save(run_dir: str | Path, step: int, state: dict, keep: int = 3) -> Path:
    """Write ckpt_{step}.pt atomically, point `latest` at it, delete all but the newest `keep`."""
    run_dir = Path(run_dir)
    path = run_dir / f"ckpt_{step:08d}.pt"
    previous = latest(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in run_dir.glob(".*.tmp*"):  # left behind by a process killed mid-write
            stale.unlink(missing_ok=True)
        write_atomic(path, lambda f: torch.save(state, f))
        write_atomic(run_dir / "latest", lambda f: f.write(path.name.encode()))
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        kept = f"{previous.name} is intact" if previous else "there is no earlier checkpoint"
        raise CheckpointError(f"could not write checkpoint {path}: {io_reason(e)}; {kept}") from None
    prune(run_dir, keep)
    return path


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, files or shard directories."""
    for old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)


def io_reason(e: BaseException) -> str:
    """The OS's words for a failed write ('No space left on device'), also when torch wrapped them."""
    os_error = e if isinstance(e, OSError) else e.__context__
    if isinstance(os_error, OSError) and os_error.strerror:
        return os_error.strerror
    return str(e)


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint: the `latest` pointer, else the highest step on disk."""
    run_dir = Path(run_dir)
    pointer = run_dir / "latest"
    if pointer.is_file():
        target = run_dir / pointer.read_text().strip()
        if NAME.match(target.name) and target.exists():
            return target
    found = checkpoints(run_dir)
    return found[-1] if found else None


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """The whole state of a file; of a shard directory, all but the model and optimizer
    (fastpt.distributed.load_state reads those)."""
    path = Path(path)
    if path.is_dir():
        path = path / STATE_FILE
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"could not read checkpoint {path}: {e}") from None
