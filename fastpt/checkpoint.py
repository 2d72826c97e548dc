"""A checkpoint on disk and reading it back: its names, the run folder's checkpoints (latest,
find), what a checkpoint holds under a name (Stateful; model and optimizer state keyed by parameter
name), and loading that never runs code. Writing checkpoints and a run's Checkpointer: checkpointer.py.

A checkpoint is `ckpt_{step:08d}` in the run folder, one of two kinds:
- `ckpt_N.pt`, one file written by rank 0 when every rank holds the full state (one process, DDP);
- `ckpt_N/`, a directory of torch.distributed.checkpoint (DCP) shards written by every rank under
  FSDP, plus STATE_FILE with the rest of the state (loader, RNG, the loop's state, ...).
Model and optimizer state are keyed by parameter name in both kinds, so either resumes in any
layout and world size: a file is sharded on load, a directory is resharded by DCP.

Every checkpoint carries checksums (integrity.py: a CRC-32 in a file's zip comment, a manifest in a
folder), checked before anything is read from it: a flipped bit is a damaged checkpoint, not a
changed weight. Loading never runs code from the file: `torch.load(weights_only=True)` for files, a
restricted unpickler for DCP's metadata and its non-tensor items. A checkpoint holds tensors and plain Python
values only (NumPy's RNG state as a tensor).
"""

from __future__ import annotations

import functools
import io
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from fastpt import files, integrity
from fastpt.errors import CheckpointError, DamagedCheckpoint, FastptError
from fastpt.model import Transformer
from fastpt.presets import ModelConfig

__all__ = [
    "ModelState",
    "OptimizerState",
    "Stateful",
    "apply",
    "checkpoints",
    "find",
    "latest",
    "load",
    "load_model",
    "restore",
    "step_of",
    "tokenizer_of",
]

if TYPE_CHECKING:  # annotations only
    from torch.distributed.checkpoint.state_dict import StateDictOptions

# torch.distributed.checkpoint and DTensor are imported where they are used: together they cost
# ~1.5 s of every command's start-up (python -m fastpt.train --help), and a run first needs them
# at its first checkpoint.


class Stateful(Protocol):
    """What a checkpoint holds under a name, as torch.distributed.checkpoint's (and torchtitan's)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


NAME = re.compile(r"^ckpt_(\d{8})(\.pt)?$")
STATE_FILE = "state.pt"
TENSOR_KEYS = ("model", "optimizer")  # what DCP shards; the rest of a checkpoint is small and replicated
REQUIRED_KEYS = ("model_config", "train_state")  # what tells a fastpt checkpoint from another program's file


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints (renamed into place), oldest first: the files and folders (a link's target
    counts) named as one. Anything else of such a name (a FIFO, a device, a link to nothing) is none:
    never opened, so no read waits on it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if NAME.match(p.name) and not files.special(p))


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint: the highest step on disk (checkpoints only appear there
    whole). The `latest` file beside them names it for people and tools; fastpt never needs it."""
    found = checkpoints(run_dir)
    return found[-1] if found else None


def _options(state: dict) -> StateDictOptions:
    """Full tensors (a checkpoint file) are sharded on load; DTensor shards (read by DCP) load as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.tensor import DTensor

    return StateDictOptions(full_state_dict=not any(isinstance(t, DTensor) for t in tree_leaves(state)))


class ModelState:
    """A model's parameters keyed by name, the same for a plain, DDP or FSDP model (under FSDP the
    tensors are this rank's DTensor shards)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state, options=_options(state))


class OptimizerState:
    """The state of one or more optimizers over the model's parameters (AdamW and Muon over
    disjoint parameters, say), merged into one dict keyed by parameter name by torch."""

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]):
        self.model, self.optimizers = model, list(optimizers)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizers)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizers, state, options=_options(state))


def find(path: Path) -> Path:
    """A checkpoint file or FSDP shard directory as given; of a run folder, its newest checkpoint."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file() or NAME.match(path.name):
        return path
    found = latest(path)
    if found is None and (any(path.glob("train_*.bin")) or (path / "train.bin").is_file()):
        raise CheckpointError(
            f"{path} is a data folder (token shards), not a run: "
            "give a run folder (fastpt.train's --out) or a checkpoint"
        )
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


def reason(e: BaseException) -> str:
    """An exception's first line, or its type when it has no message (torch's bare EOFError)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def unreadable_bytes(verified: bool) -> type[CheckpointError]:
    """What a checkpoint is whose bytes torch cannot make sense of: damaged (DamagedCheckpoint, which
    --resume skips) when nothing vouches for them; bytes that matched their checksum are exactly what
    fastpt wrote, so what fails is this code reading them (another torch or fastpt), not the file."""
    return CheckpointError if verified else DamagedCheckpoint


def os_refused(path: Path, e: OSError) -> CheckpointError:
    """The OS would not let us read a checkpoint (a permission, an I/O error, a folder for a file):
    one line naming the file and why, never called damage (its bytes were never seen)."""
    return CheckpointError(f"could not read checkpoint {e.filename or path}: {e.strerror or e}")


def unpickling_error(
    file: Path, e: pickle.UnpicklingError, error: type[CheckpointError] = DamagedCheckpoint
) -> CheckpointError:
    """One line for a file that the weights-only unpickler would not read: refused, naming the
    global or class it would have called; a file that is no pickle at all, with the reason."""
    named = re.search(r"GLOBAL (\S+)|got <class '([^']+)'>", str(e))
    if named:
        name = named.group(1) or named.group(2)
        what = " (a NumPy array: fastpt saves NumPy's RNG state as a tensor)" if name.startswith("numpy") else ""
        return error(
            f"refused to load {file}: it names {name}{what}, which a fastpt "
            "checkpoint never holds and loading could run code (re-save a trusted one as plain "
            "tensors and values)"
        )
    lines = [line for line in str(e).splitlines() if line.strip()]
    after = [b for a, b in zip(lines, lines[1:]) if "WeightsUnpickler error" in a]  # torch's own reason
    reason = (after or lines or [type(e).__name__])[0]
    return error(f"could not read checkpoint {file}: {reason}")


def load(path: str | Path, map_location: str | torch.device = "cpu", *, deferred: bool = False) -> dict:
    """The whole state of a file; of a shard directory, all but the model and optimizer
    (`apply` reads those). Nothing in the file runs: see the module's docstring. On the CPU the
    file is memory-mapped: its tensors are the file's pages, not a copy in memory. `deferred` (a
    resume): a file's model and optimizer tensors are placeholders on the meta device, read one at a
    time by `apply` as it copies each into its live tensor, so the checkpoint is never held whole."""
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    for entry in (path, file):  # torch.load would wait on a FIFO for a writer that never comes
        if kind := files.special(entry):
            raise CheckpointError(f"could not read checkpoint {entry}: it is {kind}, not a checkpoint")
    try:
        verified = integrity.verify(path, STATE_FILE)  # damaged bytes: DamagedCheckpoint, before torch reads any
    except OSError as e:
        raise os_refused(path, e) from None
    bad = unreadable_bytes(verified)
    if file.is_file() and not zipfile.is_zipfile(file):  # torch's own error would advise on torch.save's options
        raise bad(f"could not read checkpoint {file}: not a whole checkpoint (cut short, or another file)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on odd pickle protocols: the error below says it all
            if deferred:  # every tensor a placeholder that knows where its bytes are in the file
                ckpt = torch.load(file, map_location="meta", weights_only=True)
            else:
                mmap = torch.device(map_location).type == "cpu"
                ckpt = torch.load(file, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise unpickling_error(file, e, bad) from None
    except Exception as e:  # damaged bytes fail anywhere in torch's reader: IndexError, EOFError, zip errors,
        # OSError(EINVAL) ... (`verify` opened and read the file, so the OS lets us read it)
        raise bad(f"could not read checkpoint {file}: {reason(e)}") from None
    missing = [k for k in REQUIRED_KEYS if not (isinstance(ckpt, dict) and isinstance(ckpt.get(k), dict))]
    if missing:
        raise bad(f"{file} is not a fastpt checkpoint (no {', '.join(map(repr, missing))})")
    if deferred:  # the rest is small (the loader's, RNG, the loop's state): read now
        read = deferred_reader(file, map_location)
        ckpt = {k: v if k in TENSOR_KEYS else tree_map(read, v) for k, v in ckpt.items()}
    return ckpt


def deferred_reader(file: Path, map_location: str | torch.device = "cpu") -> Callable[[object], object]:
    """read(t): a placeholder tensor of `load(deferred=True)` read from `file` (its storage's bytes,
    at the offset torch's meta load noted), on `map_location`; anything else as it is."""

    def read(t: object) -> object:
        if not (isinstance(t, torch.Tensor) and t.is_meta):
            return t
        storage = t.untyped_storage()
        data = torch.empty(storage.nbytes(), dtype=torch.uint8)
        with open(file, "rb") as f:
            f.seek(storage._checkpoint_offset)
            if f.readinto(data.numpy()) != storage.nbytes():
                raise DamagedCheckpoint(f"could not read checkpoint {file}: it is cut short")
        return data.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset()).to(map_location)

    return read


@functools.cache
def _safe_dcp() -> tuple[type, type]:
    """DCP's reader and load planner, made safe (SafeReader, SafePlanner); defined on first use, as
    their bases come from torch.distributed.checkpoint."""
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo

    # The classes DCP's .metadata pickle is made of; anything else in it is refused.
    DCP_GLOBALS = {
        **{
            ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "BytesStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        },
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("pathlib", "PosixPath"): Path,
    }

    class _MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if (module, name) in DCP_GLOBALS:
                return DCP_GLOBALS[module, name]
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not part of a DCP checkpoint's metadata")

    class SafeReader(FileSystemReader):
        """DCP's reader, its metadata read by _MetadataUnpickler instead of pickle.load."""

        def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
            file = Path(self.path) / ".metadata"
            bad = unreadable_bytes(integrity.carries_checksums(Path(self.path)))  # `load` verified the folder
            try:
                with open(file, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
                if not isinstance(metadata, dcp_metadata.Metadata):
                    raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
            except OSError as e:
                raise os_refused(file, e) from None
            except pickle.UnpicklingError as e:
                raise unpickling_error(file, e, bad) from None
            except Exception as e:  # damaged bytes: EOFError, IndexError, ...
                raise bad(f"could not read checkpoint {file}: {reason(e)}") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp_metadata.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        """DCP's planner, its non-tensor items (optimizer hyperparameters) read with weights_only=True."""

        def __init__(self, path: Path):
            super().__init__()
            self.path = path

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                bad = unreadable_bytes(integrity.carries_checksums(self.path))
                raise unpickling_error(self.path / f"item {read_item.dest_index.fqn!r}", e, bad) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeReader, SafePlanner


def apply(path: Path, ckpt: dict, states: dict[str, Stateful]) -> None:
    """Load each registered state from checkpoint `ckpt` (what `load` returned for `path`).

    A file carries full tensors, which the model and optimizer shard under FSDP; a directory's
    are read by DCP into each state's own layout, resharded to this world size (or gathered whole
    for a plain or DDP run, or for sampling)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    SafeReader, SafePlanner = _safe_dcp()
    for name, stateful in states.items():
        try:
            if name in TENSOR_KEYS and path.is_dir():
                reader = SafeReader(path)
                reader.read_metadata()  # damaged or refused: our one line, before DCP logs it as a traceback
                layout = {name: stateful.state_dict()}  # what to read into
                with warnings.catch_warnings():  # reading a sharded checkpoint in one process is intended
                    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                    dcp.load(layout, checkpoint_id=path, storage_reader=reader, planner=SafePlanner(path))
                stateful.load_state_dict(layout[name])
            elif name in TENSOR_KEYS:  # into the live tensors (the optimizer's made now, as a first step would)
                stateful.load_state_dict(copied_into(stateful.state_dict(), ckpt[name], deferred_reader(path)))
            else:
                stateful.load_state_dict(ckpt[name])
        except (Exception, CheckpointException) as e:
            if isinstance(e, CheckpointException):  # DCP wraps what each rank raised
                e = next(iter(e.failures.values()))[0]
            if isinstance(e, FastptError):  # a refused or damaged file, a loader that does not fit the data
                raise type(e)(str(e) if str(path) in str(e) else f"{path}: {e}") from None
            if isinstance(e, OSError):
                raise os_refused(path, e) from None
            # Bytes read whole (and verified, when they carry checksums) in a state of another shape or
            # kind: the code or config that reads them differs from the one that wrote them. Not damage.
            raise CheckpointError(
                f"could not load the {name} state from {path}: {reason(e)} (it does not fit this run's {name})"
            ) from None
    integrity.warn_if_unverified(path)  # a checkpoint written before checksums: loaded, said once


def copied_into(live: object, saved: object, read: Callable[[object], object] = lambda t: t) -> object:
    """`saved` with each tensor copied into the live tensor of the same place and shape (a
    parameter, an optimizer state), which then stands in for it: loading it copies nothing more, so
    a resume holds no second model or optimizer state on the device. `read` turns a deferred
    placeholder into its tensor (`deferred_reader`), one at a time, each dropped once copied. A DTensor shard
    (known by full_tensor) is left to torch to fill from the full tensor."""
    if isinstance(saved, dict):
        live = live if isinstance(live, dict) else {}
        return {k: copied_into(live.get(k), v, read) for k, v in saved.items()}
    fits = isinstance(live, torch.Tensor) and not hasattr(live, "full_tensor") and isinstance(saved, torch.Tensor)
    if fits and live.shape == saved.shape:
        with torch.no_grad():
            return live.copy_(read(saved))
    return tree_map(read, saved)


def load_model(path: Path, device: torch.device) -> tuple[Transformer, dict]:
    """The model of a checkpoint (a file, or an FSDP shard directory gathered whole) in eval mode,
    and the checkpoint. Kernels follow this device ("auto"): a run that forced Triton on a GPU
    still samples on a CPU."""
    ckpt = load(path, device)
    model = Transformer(ModelConfig.from_dict(ckpt["model_config"])).to(device)
    apply(path, ckpt, {"model": ModelState(model)})
    return model.eval(), ckpt


def restore(
    run_dir: str | Path, map_location: torch.device, apply: Callable[[Path, dict], None]
) -> tuple[Path, dict, list[tuple[Path, str]]] | None:
    """The newest checkpoint that loads: `apply(path, ckpt)` puts it into the run (and may raise
    CheckpointError too). Returns it, its contents and each newer one skipped as damaged with why;
    None when the folder holds no checkpoint, CheckpointError when none of them loads. Only proven
    damage (DamagedCheckpoint) is skipped: any other failure (the OS refused to read it, it does not
    fit this code) stops here, as an older checkpoint would silently cost the newer one's steps."""
    skipped = []
    for path in reversed(checkpoints(run_dir)):
        try:
            ckpt = load(path, map_location, deferred=True)
            apply(path, ckpt)
        except DamagedCheckpoint as e:
            skipped.append((path, str(e)))
            continue
        except CheckpointError as e:
            raise CheckpointError(
                f"{e}; not known to be damaged, so --resume takes no older checkpoint in its place: "
                "nothing was changed (fix the cause and resume again)"
            ) from None
        return path, ckpt, skipped
    if skipped:  # the run's history is damaged, not absent: left as it is for a person to mend, never started over
        names = ", ".join(path.name for path, _ in skipped)
        raise CheckpointError(
            f"no checkpoint in {run_dir} loads ({names}); newest: {skipped[0][1]}; "
            "nothing was changed: mend or move them away to start the run over, or choose another --out"
        )
    return None


def step_of(ckpt: dict) -> int:
    return ckpt["train_state"]["step"]


def header(path: Path) -> dict | None:
    """A checkpoint's plain values (its configs, the loop's state) from its pickle alone, every tensor a
    placeholder none of whose bytes are read; None when it cannot tell: not a regular file (or a
    folder holding one), refused by the OS, damaged, or not a fastpt checkpoint."""
    file = path / STATE_FILE if path.is_dir() else path
    try:
        with files.open_regular(file) as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = torch.load(f, map_location="meta", weights_only=True)
    except Exception:  # damaged or refused: restore says which when it gets there
        return None
    return ckpt if isinstance(ckpt, dict) and all(isinstance(ckpt.get(k), dict) for k in REQUIRED_KEYS) else None


def run_id_of(ckpt: dict) -> str:
    """The id of the run that wrote a checkpoint (config.toml's run_id); '' for one written before runs had one."""
    return ckpt.get("train_config", {}).get("run_id") or ""


def saved_config(run_dir: str | Path, key: str, run_id: str | None = None) -> dict:
    """`key` ('train_config', 'model_config') of the run folder's newest checkpoint that reads (of run
    `run_id` when given), {} without one: what a resume continues, whatever became of config.toml or
    the --init-from folder. restore verifies what it loads."""
    for path in reversed(checkpoints(run_dir)):
        ckpt = header(path)
        if ckpt and isinstance(ckpt.get(key), dict) and run_id in (None, run_id_of(ckpt)):
            return ckpt[key]
    return {}


def resumed_model(run_dir: str | Path, resume: bool) -> ModelConfig | None:
    """The model a --resume of `run_dir` continues: its newest checkpoint's; None for a fresh run or
    a folder without one. A run from --init-from needs that folder only until its first checkpoint."""
    saved = saved_config(run_dir, "model_config") if resume else {}
    return ModelConfig.from_dict(saved) if saved else None
