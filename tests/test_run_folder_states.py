"""The run folder as a state machine: hypothesis drives random sequences of saves, kills mid-save,
resumes with another --keep-checkpoints, damage, foreign and unreadable files named like checkpoints,
links, FIFOs and a `latest` pointing elsewhere through the real run-folder code (config.toml,
cli.resumed_run, config.resolve, run_folder, checkpointer.start_or_resume and save_checkpoint, on a
tiny model), and checks after every step that
- the newest `keep` whole checkpoints of this run survive, with their bytes;
- nothing else of the user's in the folder or outside it is deleted or replaced (a file that reads
  as damage may be moved aside, whole, as NAME.damaged);
- a checkpoint of another model or another run is never resumed as this run;
- no step waits on a FIFO (each runs under an alarm: a hang fails the test).

Budget: FASTPT_STATE_EXAMPLES examples (default 6, ~15 s on one loaded core) of up to
FASTPT_STATE_STEPS steps (default 14); a long search: FASTPT_STATE_EXAMPLES=500 FASTPT_STATE_STEPS=40.

Root reads a file whatever its mode, so where the tests run as root an unreadable file (mode 000)
is refused by the one function every checkpoint read opens files through (files.open_regular), as
the OS refuses it to any other user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fastpt import checkpointer, files, integrity
from fastpt.checkpoint import NAME
from fastpt.cli import resumed_run
from fastpt.config import resolve, to_toml
from fastpt.errors import CheckpointError, ConfigError
from fastpt.model import Transformer
from fastpt.optim import optimizers_for
from fastpt.presets import model_config
from fastpt.run_folder import check_out, this_run_id
from fastpt.step import TrainState

EXAMPLES = int(os.environ.get("FASTPT_STATE_EXAMPLES", "6"))
STEPS = int(os.environ.get("FASTPT_STATE_STEPS", "14"))
VOCAB = 16
ALARM_S = 20  # a step that takes longer waits on something (a FIFO): fail, never hang


class Killed(BaseException):
    """A process killed in the middle of a write: no handler of fastpt's catches it."""


class Hung(Exception):
    pass


def _alarm(signum, frame):
    raise Hung(f"a step of the run folder's logic took over {ALARM_S} s: it waits on something (a FIFO?)")


@contextlib.contextmanager
def no_hang():
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(ALARM_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _refusing_unreadable(real):
    """files.open_regular as a user other than root gets it: a file of mode 000 is refused."""

    def opener(path):
        with contextlib.suppress(OSError):
            if os.stat(path).st_mode & 0o444 == 0:
                raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    return opener


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def start(run_dir: Path, keep: int, **shape) -> tuple:
    """A `fastpt.train --resume --keep-checkpoints keep` process up to its first step, as train.main
    and train.train build it: the resolved config, the checkpointer and the loop's state."""
    cli = {"out": str(run_dir), "resume": True, "keep_checkpoints": keep, "preset": "tiny", **shape}
    cfg = resolve(cli, None, "cpu", resumed_run(cli, None, "cpu"))
    check_out(cfg)
    cfg = dataclasses.replace(cfg, run_id=this_run_id(cfg))
    mcfg = model_config(cfg, VOCAB)
    torch.manual_seed(0)
    model = Transformer(mcfg)
    state = TrainState()
    states = {
        "model": checkpointer.ModelState(model),
        "optimizer": checkpointer.OptimizerState(model, optimizers_for(model, cfg)),
        "train_state": state,
    }
    meta = {"model_config": mcfg.to_dict(), "train_config": dataclasses.asdict(cfg)}
    ckpt = checkpointer.Checkpointer(run_dir, states, meta, keep)
    resumed = []
    checkpointer.start_or_resume(cfg, ckpt, torch.device("cpu"), lambda line, **k: resumed.append(line))
    run_dir.mkdir(exist_ok=True)
    files.write_atomic(run_dir / "config.toml", lambda f: f.write(to_toml(cfg).encode()))  # as write_run_folder
    return cfg, ckpt, state, resumed


def other_checkpoint(folder: Path, **shape) -> bytes:
    """The bytes of a checkpoint of another run (a fresh one in `folder`) at step 1000."""
    _, ckpt, _, _ = start(folder, 1, **shape)
    return ckpt.save(1000).read_bytes()


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> dict[str, bytes]:
    """Checkpoints of another run of the same model, and of another run of another model."""
    made = tmp_path_factory.mktemp("foreign")
    return {"other run": other_checkpoint(made / "a"), "other model": other_checkpoint(made / "b", dim=64, n_heads=2)}


def ckpt_name(step: int) -> str:
    return f"ckpt_{step:08d}.pt"


class RunFolder(RuleBasedStateMachine):
    foreign: dict[str, bytes] = {}

    @initialize(keep=st.integers(1, 6))
    def begin(self, keep):
        self.root = Path(tempfile.mkdtemp(prefix="fastpt-states-"))
        self.run, self.outside = self.root / "run", self.root / "outside"
        self.outside.mkdir()
        self.ours: dict[str, str] = {}  # name -> digest: this run's whole checkpoints on disk
        self.user: dict[str, tuple[str, str]] = {}  # name -> (kind, digest or link target): the user's
        self.elsewhere: dict[Path, str] = {}  # files outside the run folder -> digest
        self.process = None
        self.step = 0
        self.keep = keep
        self.launch(keep)

    def teardown(self):
        if hasattr(self, "root"):
            for p in self.root.rglob("*"):
                with contextlib.suppress(OSError):
                    os.chmod(p, 0o700, follow_symlinks=False) if not p.is_symlink() else None
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- what the oracle knows

    def newest_ours(self) -> str:
        return max(self.ours, default="")

    def obstacles(self) -> list[str]:
        """The user's entries a resume may stop at: newer than this run's newest whole checkpoint."""
        return [n for n in self.user if NAME.match(n) and n > self.newest_ours()]

    def snapshot(self) -> dict[str, object]:
        out = {}
        for p in sorted(self.run.iterdir()) if self.run.is_dir() else []:
            mode = os.lstat(p).st_mode
            out[p.name] = (
                ("link", os.readlink(p))
                if stat.S_ISLNK(mode)
                else ("file", digest(p))
                if stat.S_ISREG(mode) and mode & 0o444
                else ("other", stat.S_IFMT(mode))
            )
        return out

    def launch(self, keep: int) -> None:
        before = self.snapshot()
        try:
            with no_hang():
                cfg, ckpt, state, lines = start(self.run, keep)
        except (ConfigError, CheckpointError) as e:
            self.process = None
            assert self.snapshot() == before, f"a refused resume changed the folder: {e}"
            assert self.obstacles() or self.damaged_only(), f"refused with nothing in the way: {e}"
            return
        self.process, self.keep = (cfg, ckpt, state), keep
        resumed = [line for line in lines if line.startswith("resumed from ")]
        newest = max([self.newest_ours(), *self.linked_copies()])  # a link to a copy of ours is this run's
        if newest:
            assert resumed, f"this run's checkpoints {sorted(self.ours)} were there, the run started over: {lines}"
            path = Path(resumed[0].split()[2])
            assert path.name == newest, f"resumed from {path.name}, not this run's newest whole checkpoint {newest}"
            assert path.name not in self.ours or digest(path) == self.ours[path.name]
        else:
            assert not resumed, lines
        self.step = state.step
        for name in set(before) - set(self.snapshot()):  # a resume moves aside only what reads as damaged
            if name in self.user:
                kind, content = self.user.pop(name)
                assert kind in ("junk", "junk link"), f"{name} ({kind}) was moved away by a resume"
                aside = [p for p in self.run.glob(name + ".damaged*") if p.is_symlink() or digest(p) == content]
                assert aside, f"{name} was moved aside, but no copy of it is there"

    def damaged_only(self) -> bool:
        return not self.ours and any(NAME.match(p.name) for p in self.run.iterdir())

    def linked_copies(self) -> set[str]:
        return {n for n, (kind, _) in self.user.items() if kind == "link to ours"}

    # ---- rules

    @rule(keep=st.integers(1, 7))
    def resume(self, keep):
        self.launch(keep)

    @precondition(lambda self: self.process is not None)
    @rule(ahead=st.integers(1, 3))
    def save(self, ahead):
        cfg, ckpt, state = self.process
        state.step = self.step = self.step + ahead
        name = ckpt_name(self.step)
        with no_hang():
            saved = checkpointer.save_checkpoint(ckpt, self.step, lambda *a, **k: None)
        if name in self.user:
            assert not saved, f"{name} of the user's was there, the save replaced it"
            return
        assert saved
        self.ours[name] = digest(self.run / name)
        self.pruned()

    def pruned(self) -> None:
        """Forget this run's checkpoints the save pruned; none of the newest `keep` may be among them."""
        kept = sorted(self.ours)[-self.keep :]
        for name in list(self.ours):
            if not (self.run / name).exists():
                assert name not in kept, f"{name}, one of the newest {self.keep} whole checkpoints, was deleted"
                del self.ours[name]

    @precondition(lambda self: self.process is not None)
    @rule(ahead=st.integers(1, 3), at=st.integers(1, 40), how=st.sampled_from(["exception", "SIGKILL"]))
    def kill_mid_save(self, ahead, at, how):
        cfg, ckpt, state = self.process
        state.step = self.step + ahead
        name = ckpt_name(state.step)
        self.process = None
        if how == "SIGKILL":  # its temporary stays, cut short; no handler ran
            (self.run / f".{name}.tmp{99999 + ahead}").write_bytes(b"PK\x03\x04" * at)
            return
        real_write, calls = integrity._ChecksumWriter.write, [0]

        def dying_write(writer, data):
            calls[0] += 1
            if calls[0] >= at:
                raise Killed()
            return real_write(writer, data)

        with mock.patch.object(integrity._ChecksumWriter, "write", dying_write), contextlib.suppress(Killed):
            with no_hang():
                checkpointer.save_checkpoint(ckpt, state.step, lambda *a, **k: None)
        if name in self.ours or calls[0] < at:  # finished before the kill: it is a whole checkpoint
            if name not in self.user:
                self.ours[name] = digest(self.run / name)
                self.pruned()
            return
        assert name in self.user or not (self.run / name).exists(), f"a save killed mid-write left {name}"

    @precondition(lambda self: self.ours)
    @rule(data=st.data(), how=st.sampled_from(["truncate", "flip"]))
    def damage(self, data, how):
        name = data.draw(st.sampled_from(sorted(self.ours)))
        path = self.run / name
        size = path.stat().st_size
        if how == "truncate":
            os.truncate(path, data.draw(st.integers(0, size - 1)))
        else:
            at = data.draw(st.integers(0, size - 1))
            with open(path, "r+b") as f:
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0xFF]))
        del self.ours[name]

    @rule(
        kind=st.sampled_from(["other run", "other model", "junk", "unreadable", "fifo", "link"]),
        ahead=st.integers(-3, 3),
        to=st.sampled_from(["ours", "other run", "junk", "nothing"]),
    )
    def place(self, kind, ahead, to):
        """Something of the user's named like a checkpoint, newer or older than this run's newest."""
        step = max(1, self.step + ahead)
        name = ckpt_name(step)
        path = self.run / name
        if os.path.lexists(path) or not self.run.is_dir():
            return
        if kind in ("other run", "other model", "junk", "unreadable"):
            content = os.urandom(300) if kind == "junk" else self.foreign["other run" if kind == "unreadable" else kind]
            path.write_bytes(content)
            if kind == "unreadable":
                path.chmod(0)
            self.user[name] = (kind, digest(path) if kind != "unreadable" else "")
        elif kind == "fifo":
            os.mkfifo(path)
            self.user[name] = (kind, "")
        else:
            outside = self.outside / f"{name}-{len(self.elsewhere)}"
            if to == "ours" and self.ours:
                shutil.copyfile(self.run / max(self.ours), outside)
            elif to in ("other run", "junk"):
                outside.write_bytes(self.foreign["other run"] if to == "other run" else os.urandom(300))
            if outside.exists():
                self.elsewhere[outside] = digest(outside)
            path.symlink_to(outside)
            kinds = {"ours": "link to ours", "other run": "link", "junk": "junk link", "nothing": "link"}
            self.user[name] = (kinds[to] if outside.exists() else "link", str(outside))

    @precondition(lambda self: self.run.is_dir())
    @rule(how=st.sampled_from(["link", "text"]))
    def point_latest_elsewhere(self, how):
        latest = self.run / "latest"
        with contextlib.suppress(FileNotFoundError):
            latest.unlink()
        if how == "text":
            latest.write_text(ckpt_name(1))
            return
        outside = self.outside / f"latest-{len(self.elsewhere)}"
        outside.write_bytes(self.foreign["other run"])
        self.elsewhere[outside] = digest(outside)
        latest.symlink_to(outside)

    @rule()
    def clear_away_the_users_files(self):
        for name in list(self.user):
            path = self.run / name
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            del self.user[name]
        for aside in self.run.glob("*.damaged*") if self.run.is_dir() else []:
            aside.unlink()

    # ---- invariants

    @invariant()
    def the_users_files_stay(self):
        for name, (kind, content) in self.user.items():
            path = self.run / name
            assert os.path.lexists(path), f"the user's {name} ({kind}) was deleted"
            if kind == "fifo":
                assert stat.S_ISFIFO(os.lstat(path).st_mode), f"the user's FIFO {name} was replaced"
            elif kind.endswith("link") or kind == "link to ours":
                assert path.is_symlink() and os.readlink(path) == content, f"the user's link {name} was replaced"
            elif kind != "unreadable":
                assert digest(path) == content, f"the user's {name} ({kind}) was replaced"
            else:
                assert os.stat(path).st_mode & 0o777 == 0 and path.stat().st_size == len(self.foreign["other run"])
        for path, content in self.elsewhere.items():
            assert digest(path) == content, f"{path}, outside the run folder, was written"

    @invariant()
    def this_runs_checkpoints_stay_whole(self):
        for name, content in self.ours.items():
            assert (self.run / name).is_file() and digest(self.run / name) == content, f"{name} of this run changed"


def test_the_run_folder_keeps_its_promises_under_any_sequence_of_events(foreign):
    RunFolder.foreign = foreign
    opener = _refusing_unreadable(files.open_regular)
    patches = [mock.patch.object(files, "open_regular", opener), mock.patch.object(integrity, "open_regular", opener)]
    with contextlib.ExitStack() as stack:
        if os.geteuid() == 0:
            for patch in patches:
                stack.enter_context(patch)
        RunFolder.TestCase.settings = settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=EXAMPLES <= 10,  # the fast half's budget: the same sequences every run
        )
        RunFolder.TestCase().runTest()
