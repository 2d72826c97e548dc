"""The run folder as a state machine: hypothesis drives random sequences of saves, kills mid-save,
resumes with another --keep-checkpoints, damage, foreign and unreadable files named like checkpoints,
links, FIFOs and a `latest` pointing elsewhere through the real run-folder code (config.toml,
cli.resumed_run, config.resolve, run_folder, checkpointer.start_or_resume and save_checkpoint, on a
tiny model), and checks after every step that
- the newest `keep` whole checkpoints of this run survive, with their bytes;
- nothing else of the user's in the folder or outside it is deleted or replaced (a file that reads
  as damage may be moved aside, whole, as NAME.damaged);
- a checkpoint of another model or another run is never resumed as this run;
- no step waits on a FIFO (a watchdog opens a FIFO a step waits on: the test fails, never hangs).

Budget: FASTPT_STATE_EXAMPLES examples (default 20, the same sequences every run: 6-8 s on this
project's 2-core machine at load 0.5-3) of up to FASTPT_STATE_STEPS steps (default 14); set either
for a random search, e.g. FASTPT_STATE_EXAMPLES=300 FASTPT_STATE_STEPS=40 (minutes).

Root reads a file whatever its mode, so where the tests run as root an unreadable file (mode 000)
is refused by the one function every checkpoint read opens files through (files.open_regular), as
the OS refuses it to any other user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import shutil
import stat
import tempfile
import threading
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

EXAMPLES = int(os.environ.get("FASTPT_STATE_EXAMPLES", "20"))
STEPS = int(os.environ.get("FASTPT_STATE_STEPS", "14"))
VOCAB = 16
WAIT_S = 10  # a step that takes longer waits on a FIFO: it is opened for it, and the test fails


class Killed(BaseException):
    """A process killed in the middle of a write: no handler of fastpt's catches it."""


@contextlib.contextmanager
def no_wait_on_fifos(folder: Path, seconds: float = WAIT_S):
    """Fail a body that waits on a FIFO under `folder` instead of hanging: after `seconds`, and every
    0.1 s from then on, a watchdog opens each FIFO there for writing and closes it (a reader waiting in
    open(), even inside C code that retries on a signal, then reads its end), and the body's end raises."""
    opened, done = [], threading.Event()

    def watch():
        delay = seconds
        while not done.wait(delay):
            delay = 0.1
            for path in folder.rglob("*"):
                with contextlib.suppress(OSError):  # ENXIO: nobody waits on this one
                    if stat.S_ISFIFO(os.lstat(path).st_mode):
                        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                        opened.append(path.name)

    watchdog = threading.Thread(target=watch, daemon=True)
    watchdog.start()
    try:
        yield
    finally:  # also when the body failed: the wait is what went wrong first
        done.set()
        watchdog.join()
        assert not opened, f"waited on the FIFO {opened[0]} for {seconds} s (the watchdog opened it)"


def _refusing_unreadable(real):
    """files.open_regular as a user other than root gets it: a file of mode 000 is refused."""

    def opener(path):
        try:
            unreadable = os.stat(path).st_mode & 0o444 == 0
        except OSError:  # real() says why
            unreadable = False
        if unreadable:
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
    _, ckpt, state, _ = start(folder, 1, **shape)
    state.step = 1000
    return ckpt.save(1000).read_bytes()


def with_run_id(ckpt_bytes: bytes, run_id: str, path: Path) -> None:
    """A checkpoint carrying the id of another run (written with its checksum, as fastpt writes one)."""
    ckpt = torch.load(io.BytesIO(ckpt_bytes), weights_only=True)
    ckpt["train_config"]["run_id"] = run_id
    checkpointer.write_file(path, ckpt)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> dict[str, bytes]:
    """Checkpoints of another run of the same model, and of another run of another model."""
    made = tmp_path_factory.mktemp("foreign")
    return {"other run": other_checkpoint(made / "a"), "other model": other_checkpoint(made / "b", dim=64, n_heads=2)}


KEEP = st.sampled_from([5, 1, 3, 7, 2])  # --keep-checkpoints: 5 and more first, which lost checkpoints
AHEAD = st.sampled_from([1, 2, -1, 3, -2])  # steps from the run's own: newer first, older too


def ckpt_name(step: int) -> str:
    return f"ckpt_{step:08d}.pt"


class RunFolder(RuleBasedStateMachine):
    foreign: dict[str, bytes] = {}

    @initialize(keep=KEEP)
    def begin(self, keep):
        self.root = Path(tempfile.mkdtemp(prefix="fastpt-states-"))
        self.run, self.outside = self.root / "run", self.root / "outside"
        self.outside.mkdir()
        self.ours: dict[str, str] = {}  # name -> digest: this run's whole checkpoints on disk
        self.user: dict[str, tuple[str, str]] = {}  # name -> (kind, digest or link target): the user's
        self.elsewhere: dict[Path, str] = {}  # files outside the run folder -> digest
        self.process, self.run_id = None, ""
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
            with no_wait_on_fifos(self.root):
                cfg, ckpt, state, lines = start(self.run, keep)
        except (ConfigError, CheckpointError) as e:
            self.process = None
            assert self.snapshot() == before, f"a refused resume changed the folder: {e}"
            assert self.obstacles() or self.damaged_only(), f"refused with nothing in the way: {e}"
            return
        self.process, self.keep, self.run_id = (cfg, ckpt, state), keep, cfg.run_id
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

    @rule(keep=KEEP)
    def resume(self, keep):
        self.launch(keep)

    @precondition(lambda self: self.process is not None)
    @rule(ahead=st.integers(1, 3), times=st.integers(1, 4))
    def save(self, ahead, times):
        """`times` checkpoints, `ahead` steps apart."""
        cfg, ckpt, state = self.process
        for _ in range(times):
            state.step = self.step = self.step + ahead
            name = ckpt_name(self.step)
            with no_wait_on_fifos(self.root):
                saved = checkpointer.save_checkpoint(ckpt, self.step, lambda *a, **k: None)
            if name in self.user:
                assert not saved, f"{name} of the user's was there, the save replaced it"
                continue
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
            with no_wait_on_fifos(self.root):
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

    def free(self, ahead: int) -> Path | None:
        """The path of a checkpoint name `ahead` steps from the run's step, None when it is taken."""
        path = self.run / ckpt_name(max(1, self.step + ahead))
        return None if os.path.lexists(path) or not self.run.is_dir() else path

    @rule(kind=st.sampled_from(["other run", "other model", "this id, other model"]), ahead=AHEAD)
    def place_a_checkpoint_of_another_run(self, kind, ahead):
        if path := self.free(ahead):
            if kind == "this id, other model":  # none of fastpt's runs writes one: a resume must still refuse it
                with_run_id(self.foreign["other model"], self.run_id, path)
            else:
                path.write_bytes(self.foreign[kind])
            self.user[path.name] = (kind, digest(path))

    @rule(ahead=AHEAD, unreadable=st.booleans())
    def place_a_file_named_like_a_checkpoint(self, ahead, unreadable):
        """Bytes that are no checkpoint, or another run's checkpoint that the OS will not let us read."""
        if path := self.free(ahead):
            if unreadable:
                path.write_bytes(self.foreign["other run"])
                path.chmod(0)
                self.user[path.name] = ("unreadable", "")
            else:
                path.write_bytes(os.urandom(300))
                self.user[path.name] = ("junk", digest(path))

    @rule(ahead=AHEAD)
    def place_a_fifo(self, ahead):
        if path := self.free(ahead):
            os.mkfifo(path)
            self.user[path.name] = ("fifo", "")

    @rule(ahead=AHEAD, to=st.sampled_from(["other run", "ours", "junk", "nothing"]))
    def place_a_link(self, ahead, to):
        """A link named like a checkpoint to a file outside the run folder (a copy of one of this run's
        checkpoints, another run's, bytes that are none) or to nothing."""
        if not (path := self.free(ahead)):
            return
        outside = self.outside / f"{path.name}-{len(self.elsewhere)}"
        if to == "ours" and self.ours:
            shutil.copyfile(self.run / max(self.ours), outside)
        elif to in ("other run", "junk"):
            outside.write_bytes(self.foreign["other run"] if to == "other run" else os.urandom(300))
        if outside.exists():
            self.elsewhere[outside] = digest(outside)
        path.symlink_to(outside)
        kinds = {"ours": "link to ours", "other run": "link", "junk": "junk link", "nothing": "link"}
        self.user[path.name] = (kinds[to] if outside.exists() else "link", str(outside))

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
            derandomize="FASTPT_STATE_EXAMPLES" not in os.environ,  # the fast half: the same sequences every run
        )
        RunFolder.TestCase().runTest()
