"""What fastpt.train checks about --out before any work: every refusal that depends only on the
flags and the folders (another trainer on it, a folder of runs, an occupied folder, a --resume
of a misspelt run, --resume-require with nothing to resume) comes before the data is prepared, the batch planned or
the model traced, and --resume says what it will do. The lock on the folder
(metrics.own_run_folder) is taken later, by the main rank only."""

from __future__ import annotations

import difflib
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from fastpt.checkpoint import latest
from fastpt.errors import ConfigError
from fastpt.files import check_unlocked, os_reason
from fastpt.typos import is_typo

if TYPE_CHECKING:
    from fastpt.config import TrainConfig


def is_run(folder: Path) -> bool:
    """A folder fastpt.train wrote: its config.toml or a checkpoint."""
    return (folder / "config.toml").is_file() or latest(folder) is not None


def has_checkpoint(run_dir: Path) -> bool:
    """A complete checkpoint, or one a killed save left aside (checkpointer.recover puts it back)."""
    return latest(run_dir) is not None or any(run_dir.glob(".ckpt_*.old"))


def held_runs(folder: Path) -> list[str]:
    """The run folders directly inside `folder`, by name."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and is_run(p))


def nearest_run(run_dir: Path) -> str:
    """The existing run folder beside `run_dir` whose name is closest to it (a typo), or ''."""
    close = difflib.get_close_matches(run_dir.name, held_runs(run_dir.parent), n=1, cutoff=0.6)
    return str(run_dir.parent / close[0]) if close else ""


def typo_of(run_dir: Path) -> str:
    """The run folder `run_dir` misspells, or '': at its first folder that does not exist, a folder
    beside it whose name that one is a typo of (typos.is_typo: one edit, not a sweep's next name), when
    the path through it is a run, or (a typo above the run's own folder) leads to a folder of runs."""
    parts = run_dir.parts
    at = next((i for i in range(len(parts)) if not Path(*parts[: i + 1]).exists()), None)
    if at is None:
        return ""
    missing, rest = Path(*parts[: at + 1]), parts[at + 1 :]
    try:
        beside = sorted(p.name for p in missing.parent.iterdir() if p.is_dir())
    except OSError:  # a folder that cannot be listed: no guess
        return ""
    for name in beside:
        meant = missing.parent.joinpath(name, *rest)
        if is_typo(missing.name, name) and (is_run(meant) or (rest and held_runs(meant.parent))):
            return str(meant)
    return ""


def nothing_to_resume(run_dir: Path) -> str:
    """Why --resume finds nothing in `run_dir`."""
    if run_dir.exists():
        return f"{run_dir} holds no checkpoint"
    near = nearest_run(run_dir)
    return f"{run_dir} does not exist" + (f" (did you mean {near}?)" if near else "")


def check_out(cfg: TrainConfig) -> str:
    """Refuse an --out this run must not use; returns, for a --resume that will start the run
    afresh, the line that says why (else '')."""
    run_dir = Path(cfg.out)
    try:
        return _check_out(cfg, run_dir)
    except OSError as e:  # a folder on the way that cannot be listed
        raise ConfigError(f"--out {run_dir}: cannot read it ({os_reason(e)})") from None


def _check_out(cfg: TrainConfig, run_dir: Path) -> str:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"'out' = {cfg.out!r} is a file, not a folder: give the run its own --out")
    check_unlocked(run_dir / ".lock", "trainer")  # metrics.own_run_folder takes it after this
    if runs := held_runs(run_dir):
        listed = ", ".join(runs[:3]) + (", ..." if len(runs) > 3 else "")
        raise ConfigError(
            f"--out {run_dir} holds other runs ({listed}): give one run's own folder, e.g. --out {run_dir / runs[0]}"
        )
    found = has_checkpoint(run_dir)
    if cfg.resume:
        if found:
            return ""
        if cfg.resume_require:
            raise ConfigError(f"--resume-require: nothing to resume, {nothing_to_resume(run_dir)}")
        if cfg.resume_or_start:  # a script's form: no guess at what else it may have meant
            return f"--resume-or-start: nothing to resume in {run_dir}; starting the run from step 0"
        if meant := typo_of(run_dir):  # training into the typo would start a second run beside the one meant
            raise ConfigError(
                f"--resume: nothing to resume, {run_dir} does not exist (did you mean {meant}?): give that run's "
                "folder, or drop --resume to start a new run here (scripts: --resume-or-start never refuses)"
            )
        return f"--resume: nothing to resume, {nothing_to_resume(run_dir)}; starting the run from step 0"
    if found:  # a fresh run would mix its checkpoints with the old ones
        raise ConfigError(
            f"{run_dir} already holds a run (newest checkpoint {latest_name(run_dir)}): "
            "add --resume to continue it, or choose another --out"
        )
    if (metrics := run_dir / "metrics.jsonl").is_file() and metrics.stat().st_size:
        raise ConfigError(
            f"{run_dir} holds an earlier run's metrics.jsonl (and no checkpoint): "
            "add --resume to start that run over, or choose another --out"
        )
    return ""


def this_run_id(cfg: TrainConfig) -> str:
    """The id this run's checkpoints carry: a --resume of a folder with checkpoints keeps its run's
    (config.toml's, or --run-id's; '' for a run begun before runs had ids, which then stays without);
    a new run makes one."""
    return cfg.run_id if cfg.resume and has_checkpoint(Path(cfg.out)) else uuid.uuid4().hex[:16]


def latest_name(run_dir: Path) -> str:
    """The newest checkpoint's name, counting one a killed save left aside."""
    path = latest(run_dir)
    return path.name if path else sorted(run_dir.glob(".ckpt_*.old"))[-1].name.removeprefix(".").removesuffix(".old")
