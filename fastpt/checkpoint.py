"""The checkpoint format, all of it: names, atomic writes, the `latest` pointer, pruning, and
model / optimizer state that moves between layouts and world sizes.

A checkpoint is `ckpt_{step:08d}` in the run folder, one of two kinds:
- `ckpt_N.pt`, one file written by rank 0 when every rank holds the full state (one process, DDP);
- `ckpt_N/`, a directory of torch.distributed.checkpoint (DCP) shards written by every rank under
  FSDP, plus STATE_FILE with the rest of the state (step, loader, RNG, ...).
Model and optimizer state are keyed by parameter name in both, so either kind resumes in any
layout and world size: a file is sharded on load, a directory is resharded by DCP.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from fastpt.errors import CheckpointError
from fastpt.files import fsync_dir, write_atomic

__all__ = ["checkpoints", "find", "latest", "load", "load_state", "restore", "save", "state_of", "tokenizer_of"]

NAME = re.compile(r"^ckpt_(\d{8})(\.pt)?$")
STATE_FILE = "state.pt"
TENSOR_KEYS = ("model", "optimizer")  # what DCP shards; the rest of a checkpoint is small and replicated
REQUIRED_KEYS = ("model_config", "step")  # what tells a fastpt checkpoint from another program's torch file


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints (renamed into place), oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if NAME.match(p.name))


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint: the highest step on disk (checkpoints only appear there
    whole). The `latest` file beside them names it for people and tools; fastpt never needs it."""
    found = checkpoints(run_dir)
    return found[-1] if found else None


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state keyed by parameter name, the same for a plain, DDP or FSDP model
    (under FSDP the tensors are this rank's DTensor shards)."""
    return get_state_dict(model, optimizer)


def save(run_dir: str | Path, step: int, state: dict, keep: int = 3, is_main: bool = True) -> Path | None:
    """Write checkpoint `step` atomically, point `latest` at it, delete all but the newest `keep`.

    Sharded state (FSDP DTensors) is a DCP directory written by every rank; full state one file
    written by the main rank. Returns the path on the main rank, None elsewhere."""
    run_dir = Path(run_dir)
    sharded = any(isinstance(v, DTensor) for v in state["model"].values())
    path = run_dir / (f"ckpt_{step:08d}" if sharded else f"ckpt_{step:08d}.pt")
    previous = latest(run_dir)
    try:
        if sharded:
            _write_sharded(path, state, is_main)
        elif is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda f: torch.save(state, f))
        if not is_main:
            return None
        write_atomic(run_dir / "latest", lambda f: f.write(path.name.encode()))
    except (OSError, RuntimeError, CheckpointException) as e:  # torch.save reports a failed write as RuntimeError
        kept = f"{previous.name} is intact" if previous else "there is no earlier checkpoint"
        raise CheckpointError(f"could not write checkpoint {path}: {io_reason(e)}; {kept}") from None
    _clean(run_dir, keep)
    return path


def _write_sharded(path: Path, state: dict, is_main: bool) -> None:
    """Every rank writes its shards into a hidden directory; the main rank adds the rest of the
    state and renames the directory into place, so a reader sees a whole checkpoint or none."""
    tmp = path.with_name(f".{path.name}.partial")
    dcp.save({k: state[k] for k in TENSOR_KEYS}, checkpoint_id=tmp)
    if is_main:  # dcp.save returns on the coordinator once every rank has written
        rest = {k: v for k, v in state.items() if k not in TENSOR_KEYS}
        write_atomic(tmp / STATE_FILE, lambda f: torch.save(rest, f))
        shutil.rmtree(path, ignore_errors=True)  # the same step, from an attempt that was resumed
        os.replace(tmp, path)
        fsync_dir(path.parent)


def _clean(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, and temporaries of writers killed mid-save."""
    for old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    for stale in [*run_dir.glob(".ckpt_*.tmp*"), *run_dir.glob(".ckpt_*.partial"), *run_dir.glob(".latest.tmp*")]:
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


def io_reason(e: BaseException) -> str:
    """The OS's words for a failed write ('No space left on device'), also when torch wrapped them."""
    os_error = e if isinstance(e, OSError) else e.__context__
    if isinstance(os_error, OSError) and os_error.strerror:
        return os_error.strerror
    return str(e)


def find(path: Path) -> Path:
    """A checkpoint file or FSDP shard directory as given; of a run folder, its newest checkpoint."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file() or NAME.match(path.name):
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(f"no checkpoint in {path} (train with --out {path} first)")
    return found


def tokenizer_of(path: Path, ckpt: dict) -> Path | None:
    """The tokenizer.json of the run that wrote checkpoint `path`: the run folder's own copy, else
    the one in the data folder it trained on; None when neither exists."""
    candidates = [path.parent / "tokenizer.json"]
    if data := ckpt.get("train_config", {}).get("data"):
        candidates.append(Path(data) / "tokenizer.json")
    return next((p for p in candidates if p.is_file()), None)


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """The whole state of a file; of a shard directory, all but the model and optimizer
    (load_state reads those)."""
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    try:
        ckpt = torch.load(file, map_location=map_location, weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, AttributeError,
            ModuleNotFoundError) as e:
        raise CheckpointError(f"could not read checkpoint {file}: {str(e).splitlines()[0]}") from None
    missing = [k for k in REQUIRED_KEYS if not (isinstance(ckpt, dict) and k in ckpt)]
    if missing:
        raise CheckpointError(f"{file} is not a fastpt checkpoint (no {', '.join(map(repr, missing))})")
    return ckpt


def load_state(path: Path, ckpt: dict, model: nn.Module, optimizer=None) -> None:
    """Load model (and optimizer) state from either kind of checkpoint into this run's layout.

    `ckpt` is what `load` returned: a single file carries full tensors, which set_state_dict
    shards under FSDP; a directory's tensors are read by DCP, resharded to this world size (or
    gathered whole for a plain or DDP run, or for sampling).
    """
    # One optimizer, or several that iterate (fastpt.optim.Optimizers); their states are keyed by parameter name.
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer or ())
    try:
        if "model" in ckpt:
            set_state_dict(model, optimizers, model_state_dict=ckpt["model"],
                           optim_state_dict=ckpt["optimizer"] if optimizers else {},
                           options=StateDictOptions(full_state_dict=True))
            return
        model_state, optim_state = get_state_dict(model, optimizers)  # the layout to read into
        state = {"model": model_state, "optimizer": optim_state}
        with warnings.catch_warnings():  # reading a sharded checkpoint in one process is intended
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except (OSError, RuntimeError, KeyError, ValueError, CheckpointException) as e:
        raise CheckpointError(f"could not load model and optimizer state from {path}: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def restore(run_dir: str | Path, map_location: torch.device, apply) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads: `apply(path, ckpt)` puts it into the run (and may raise
    CheckpointError too). A damaged newer one is skipped with a warning that says why; None when
    the folder holds no checkpoint, CheckpointError when none of them loads."""
    reasons = []
    for path in reversed(checkpoints(run_dir)):
        try:
            ckpt = load(path, map_location)
            apply(path, ckpt)
        except CheckpointError as e:
            reasons.append(str(e))
            continue
        for reason in reasons:  # said only now: when nothing loads, the error below says it all
            print(f"fastpt: warning: skipped a newer checkpoint: {reason}", file=sys.stderr, flush=True)
        return path, ckpt
    if reasons:
        raise CheckpointError(f"no checkpoint in {run_dir} loads; newest: {reasons[0]}")
    return None
