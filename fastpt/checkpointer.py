"""Writing a run's checkpoints and resuming from them: atomic saves, the `latest` pointer, pruning,
checkpoints a killed save left aside put back; the Checkpointer over the run's Stateful objects,
registered once (build_checkpointer), and a run's start_or_resume. The format and loading it:
checkpoint.py.

What a checkpoint holds is registered once, as torchtitan's CheckpointManager takes it: a name ->
Stateful (an object with state_dict() / load_state_dict()) mapping that `Checkpointer` saves and
restores, plus plain values saved beside them (the configs). The step is the `train_state`'s.
Every write carries its checksums (integrity.py), in the same atomic write as the checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from fastpt import files, integrity
from fastpt.checkpoint import (
    NAME,
    STATE_FILE,
    TENSOR_KEYS,
    ModelState,
    OptimizerState,
    Stateful,
    apply,
    checkpoints,
    header,
    latest,
    restore,
    run_id_of,
)
from fastpt.errors import CheckpointError, ConfigError, DamagedCheckpoint
from fastpt.files import os_reason, publish, remove, write_atomic
from fastpt.optim import changed_settings, reapply_settings
from fastpt.presets import ModelConfig

__all__ = [
    "DAMAGED",
    "Checkpointer",
    "RNGState",
    "build_checkpointer",
    "recover",
    "save",
    "save_checkpoint",
    "start_or_resume",
]

if TYPE_CHECKING:  # annotations only: the run's pieces are built above this module
    from fastpt.config import TrainConfig
    from fastpt.data.dataset import Data
    from fastpt.step import Net, TrainState

# torch.distributed.checkpoint and DTensor are imported where they are used, as in checkpoint.py.

DAMAGED = ".damaged"  # the suffix of a checkpoint a resume skipped as damaged (set_aside)


class RNGState:
    """Python's, NumPy's and torch's generators (and CUDA's), as tensors and plain values that
    torch.load(weights_only=True) reads."""

    def state_dict(self) -> dict:
        numpy = np.random.get_state(legacy=False)  # {"bit_generator", "state": {"key": uint32 array, "pos"}, ...}
        numpy["state"]["key"] = torch.from_numpy(numpy["state"]["key"].astype(np.int64))
        state = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Generators take their state as CPU byte tensors only; a checkpoint loaded onto the GPU
        (map_location=device) brings these back as CUDA tensors."""
        random.setstate(state["python"])
        numpy = state["numpy"]
        key = numpy["state"]["key"].cpu().numpy().astype(np.uint32)
        np.random.set_state({**numpy, "state": {**numpy["state"], "key": key}})
        torch.set_rng_state(state["torch"].cpu())
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


@dataclasses.dataclass(frozen=True)
class Owner:
    """What tells this run's checkpoints from anything else named like one: the run's id (config.toml's
    run_id, '' for a run begun before runs had one) and its model config (None: not checked)."""

    run_id: str
    model: dict | None

    @classmethod
    def of(cls, state: dict) -> Owner:
        """The owner of the checkpoint `state` is about to be written as."""
        return cls(run_id_of(state), state.get("model_config"))

    def disowns(self, path: Path) -> str:
        """Why `path`, named like a checkpoint, is not this run's to replace or delete ('' when it is):
        a link (the user's, whatever it points to), a FIFO or device, what does not read as a fastpt
        checkpoint, or one of another run or model."""
        if path.is_symlink():
            return "a link"
        if kind := files.special(path):
            return kind
        if (ckpt := header(path)) is None:
            return "not a checkpoint that reads"
        if (run_id := run_id_of(ckpt)) != self.run_id:
            return f"a checkpoint of another run (run id {run_id or 'none'}, this run's {self.run_id or 'none'})"
        try:
            diff = model_mismatch(ckpt["model_config"], self.model) if self.model is not None else ""
        except Exception as e:  # a model config this code cannot read
            diff = f"its model config does not read: {e}"
        return f"a checkpoint of another model ({diff})" if diff else ""


# A checkpoint's signature (its files' inodes, sizes and times) -> whether its bytes matched their
# checksums: each is read once per process, and any write to it since (damage) makes a new signature.
_verified: dict[tuple, bool] = {}


def _signature(path: Path) -> tuple:
    parts = sorted(path.iterdir()) if path.is_dir() else [path]
    stats = [(p.name, p.stat()) for p in parts]
    return (str(path), *((name, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for name, s in stats))


def is_good(path: Path) -> bool | None:
    """Whether a checkpoint's bytes are whole (one without checksums counts as whole); None when the
    OS will not let us read it, which proves nothing."""
    try:
        key = _signature(path)
        if key not in _verified:
            try:
                integrity.verify(path, STATE_FILE)
                _verified[key] = True
            except DamagedCheckpoint:
                _verified[key] = False
        return _verified[key]
    except OSError:
        return None


def save(run_dir: str | Path, step: int, state: dict, keep: int = 3, is_main: bool = True) -> Path | None:
    """Write checkpoint `step` atomically, point `latest` at it, delete this run's older checkpoints
    but the newest `keep` whole ones (counting this one). Anything of that name that is not this
    run's (Owner) is never replaced: CheckpointError.

    Sharded state (FSDP DTensors) is a DCP directory written by every rank; full state one file
    written by the main rank. Returns the path on the main rank, None elsewhere."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.tensor import DTensor

    run_dir = Path(run_dir)
    sharded = any(isinstance(v, DTensor) for v in state["model"].values())
    path = run_dir / (f"ckpt_{step:08d}" if sharded else f"ckpt_{step:08d}.pt")
    previous, owner = latest(run_dir), Owner.of(state)
    if os.path.lexists(path) and (why := owner.disowns(path)):  # every rank sees the same: all stop here
        raise CheckpointError(f"did not write checkpoint {path}: one of that name is there, {why}; left as it is")
    try:
        if sharded:
            _write_sharded(path, state, is_main)
        elif is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_file(path, state)
        if not is_main:
            return None
        write_atomic(run_dir / "latest", lambda f: f.write(path.name.encode()))
    except (OSError, RuntimeError, CheckpointException) as e:  # torch.save reports a failed write as RuntimeError
        kept = f"{previous.name} is intact" if previous else "there is no earlier checkpoint"
        raise CheckpointError(f"could not write checkpoint {path}: {os_reason(e)}; {kept}") from None
    _verified[_signature(path)] = True  # just written whole: the next prune need not read it again
    _clean(run_dir, keep, path, owner)
    return path


def write_file(path: Path, state: dict) -> None:
    """torch.save(state) into `path` atomically, its checksum in the same write."""
    write_atomic(path, lambda f: integrity.write_zip(f, lambda out: torch.save(state, out)))


def _write_sharded(path: Path, state: dict, is_main: bool) -> None:
    """Every rank writes its shards into a hidden directory; the main rank adds the rest of the
    state and renames the directory into place, so a reader sees a whole checkpoint or none."""
    import torch.distributed.checkpoint as dcp

    tmp = path.with_name(f".{path.name}.partial")
    dcp.save({k: state[k] for k in TENSOR_KEYS}, checkpoint_id=tmp)
    if is_main:  # dcp.save returns on the coordinator once every rank has written
        rest = {k: v for k, v in state.items() if k not in TENSOR_KEYS}
        write_file(tmp / STATE_FILE, rest)
        integrity.write_manifest(tmp)  # inside the folder before it is renamed: one publish with it
        publish(tmp, path)  # over the same step from an attempt that was resumed, if any


def recover(run_dir: Path) -> None:
    """Put back every checkpoint that a save killed between publish's two renames left aside
    (files.recover); only the run folder's owner calls it, before anything lists or cleans."""
    for old in run_dir.glob(".ckpt_*.old"):
        name = old.name.removeprefix(".").removesuffix(".old")
        if NAME.match(name):
            files.recover(old.with_name(name))


def _clean(run_dir: Path, keep: int, saved: Path, owner: Owner) -> None:
    """Keep the newest `keep` whole checkpoints of this run up to the one just `saved` and delete its
    others older than that one (a newer one is not this run's to count), and temporaries of writers
    killed mid-save (a checkpoint left aside is put back first). Nothing that is not this run's
    (Owner.disowns) is counted or deleted, nor a checkpoint the OS will not let us read."""
    recover(run_dir)
    kept = 1  # the one just saved
    for path in reversed(checkpoints(run_dir)):
        if path.name >= saved.name or owner.disowns(path):
            continue
        whole = is_good(path) if kept < keep else False  # past `keep`: deleted without reading it
        if whole is None:
            continue
        if whole:
            kept += 1
        else:
            remove(path)
    for pattern in (".ckpt_*.tmp*", ".ckpt_*.partial", ".ckpt_*.old", ".latest.tmp*"):
        for path in run_dir.glob(pattern):
            remove(path)


class Checkpointer:
    """A run's checkpointed state, registered once: `states` maps each name to a Stateful (model,
    optimizers, scaler, loader, RNG, the loop's TrainState, ...), `meta` holds plain values saved
    beside them (the model and train configs). A new piece of state is one more entry here."""

    def __init__(self, run_dir: Path, states: dict[str, Stateful], meta: dict, keep: int = 3, is_main: bool = True):
        self.run_dir, self.states, self.meta, self.keep, self.is_main = run_dir, states, meta, keep, is_main

    def recover(self) -> None:
        """Put back checkpoints a killed save left aside (`recover`, on the main rank, which owns the
        run folder); every rank waits for it, so all of them then list the same checkpoints."""
        if self.is_main:
            recover(self.run_dir)
        if dist.is_initialized():
            dist.barrier()

    def save(self, step: int) -> Path | None:
        """Checkpoint `step` (see `save`): the path on the main rank, None elsewhere."""
        state = {name: stateful.state_dict() for name, stateful in self.states.items()}
        return save(self.run_dir, step, {**state, **self.meta}, self.keep, self.is_main)

    def restore(
        self, map_location: torch.device, check: Callable[[Path, dict], None] = lambda path, ckpt: None
    ) -> Path | None:
        """Load every registered state from the newest checkpoint that loads (`check(path, ckpt)`
        first, to refuse one that does not fit); None when the run folder has none."""

        def put(path: Path, ckpt: dict) -> None:
            check(path, ckpt)
            apply(path, ckpt, self.states)

        found = restore(self.run_dir, map_location, put)
        if not found:
            return None
        if dist.is_initialized():
            dist.barrier()  # every rank has read what it needs before the main rank renames anything
        for path, reason in found[2]:  # said only now: when nothing loads, restore's error says it all
            moved = f"; {set_aside(path)}" if self.is_main else ""
            print(f"fastpt: warning: skipped a newer checkpoint: {reason}{moved}", file=sys.stderr, flush=True)
        return found[0]


def set_aside(path: Path) -> str:
    """Rename a damaged checkpoint out of the checkpoints' names (`ckpt_N.pt.damaged`): left as it was, it
    would stay the newest, the one `latest` and sample name. Says what was done (a folder the OS
    will not let us rename keeps it, and pruning still never counts it: `_clean`)."""
    aside = path.with_name(path.name + DAMAGED)
    for n in range(2, 1000):  # one set aside by an earlier resume of the same step stays too
        if not os.path.lexists(aside):
            break
        aside = path.with_name(f"{path.name}{DAMAGED}.{n}")
    try:
        path.rename(aside)
    except OSError as e:
        return f"could not move it aside: {os_reason(e)}"
    return f"moved aside as {aside.name}"


# ---- a training run's checkpointer


def build_checkpointer(cfg: TrainConfig, data: Data, net: Net, state: TrainState, is_main: bool) -> Checkpointer:
    """Every piece of state a run's checkpoint holds, registered once (a new one is one more entry)."""
    states = {
        "model": ModelState(net.raw),
        "optimizer": OptimizerState(net.raw, net.optimizers),
        "scaler": net.scaler,
        "loader": data.loader,
        "rng": RNGState(),
        "train_state": state,
    }
    meta = {"model_config": data.model_config.to_dict(), "train_config": dataclasses.asdict(cfg)}
    return Checkpointer(Path(cfg.out), states, meta, cfg.keep_checkpoints, is_main)


def start_or_resume(
    cfg: TrainConfig, ckpt: Checkpointer, device: torch.device, log: Callable, fresh_note: str = ""
) -> None:
    """--resume: every registered state from the newest checkpoint that loads, checked to be of this
    run's model and optimizer, whose groups then take the config's settings (optim.reapply_settings);
    with none, `fresh_note` (run_folder.check_out's) says why the run starts from step 0. A fresh
    run's folder was checked before any work (run_folder.check_out)."""
    state, saved_config = ckpt.states["train_state"], {}

    def same_model(path: Path, saved: dict) -> None:
        saved_config.update(saved.get("train_config", {}))
        if (run_id := run_id_of(saved)) != cfg.run_id:
            raise ConfigError(
                f"{path} is a checkpoint of another run (run id {run_id or 'none'}; this run's, in "
                f"{ckpt.run_dir / 'config.toml'}, is {cfg.run_id or 'none'}): nothing was changed; move it out "
                f"of {ckpt.run_dir} to resume this run"
                + (f", or add --run-id {run_id} to adopt that run's checkpoints" if run_id else "")
            )
        recipe = saved_config.get("recipe", "seed")  # when the recipe differs, it is what to repeat
        again = f"--recipe {recipe} (this run says --recipe {cfg.recipe})" if recipe != cfg.recipe else ""
        if diff := model_mismatch(saved["model_config"], ckpt.meta["model_config"]):
            raise ConfigError(
                f"{path} was written for another model ({diff}); "
                f"resume with {again or 'the same preset, shape keys and data'}"
            )
        if (optimizer := saved_config.get("optimizer", "adamw")) != cfg.optimizer:
            raise ConfigError(
                f"{path} was written with --optimizer {optimizer}: resume with {again or 'the same optimizer'}"
            )

    run_dir = ckpt.run_dir
    ckpt.recover()  # a checkpoint a killed save left aside counts for --resume
    # Read on the CPU one tensor at a time, each copied into its live tensor (apply): no copy on the device.
    if cfg.resume and (path := ckpt.restore(torch.device("cpu"), same_model)):
        log(f"resumed from {path} at step {state.step}")
        optimizers = ckpt.states["optimizer"].optimizers
        reapply_settings(optimizers, cfg, ckpt.meta["model_config"]["dim"], ckpt.meta["model_config"]["tie_embeddings"])
        if changed := changed_settings(saved_config, cfg):
            log(f"resume: {changed} (the config's values apply)")
    elif cfg.resume:  # run_folder.check_out said why, before the folder was made
        log(fresh_note or f"--resume: nothing to resume, {run_dir} holds no checkpoint; starting the run from step 0")
    state.to(device)


def model_mismatch(saved: dict, current: dict) -> str:
    """The architecture fields a checkpoint's model config disagrees on ('dim 512 != 128')."""
    saved, current = (dataclasses.asdict(ModelConfig.from_dict(c)) for c in (saved, current))
    return ", ".join(f"{k} {v} != {current[k]}" for k, v in saved.items() if current[k] != v)


def save_checkpoint(ckpt: Checkpointer, step: int, log) -> bool:
    """Checkpoint `step`; a failed write (a full disk) is a warning, and False."""
    try:
        if path := ckpt.save(step):
            log(f"saved {path}")
        return True
    except CheckpointError as e:
        print(f"fastpt: warning: {e}", file=sys.stderr)
        return False
