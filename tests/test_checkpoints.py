"""Checkpoints: loading one never runs code from it (a single file or a DCP folder, through every
command that loads one)."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import faults
from conftest import REPO, assert_one_line_error, read_metrics, run_main, run_quietly, run_train, tiny_args
from fastpt import checkpoint, checkpointer, export, sample, train


def run_args(data: Path, out: Path, *extra: str) -> list[str]:
    """6 steps, every step logged, checkpoints at 4 and 6."""
    return tiny_args(data, out, *extra, max_steps=6, log_every=1, eval_every=3, ckpt_every=4)


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "reference"
    code, _, err = run_quietly(train.main, run_args(tiny_data, out))
    assert code == 0, err
    return out


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


class CreatesAFile:
    """What a crafted checkpoint carries: unpickling it calls open(path, "w")."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def crafted_file(path: Path, marker: Path) -> Path:
    torch.save({"model_config": {}, "step": 1, "train_state": {"step": 1}, "payload": CreatesAFile(marker)}, path)
    return path


def crafted_dcp_folder(reference: Path, path: Path, marker: Path) -> Path:
    """A shard folder with a genuine state.pt and a .metadata pickle that runs code."""
    path.mkdir()
    ckpt = checkpoint.load(checkpoint.latest(reference))
    torch.save({k: v for k, v in ckpt.items() if k not in checkpoint.TENSOR_KEYS}, path / checkpoint.STATE_FILE)
    (path / ".metadata").write_bytes(pickle.dumps(CreatesAFile(marker)))
    return path


@pytest.mark.parametrize("kind", ["file", "dcp folder"])
@pytest.mark.parametrize("command", ["train --resume", "sample", "export"])
def test_a_crafted_checkpoint_is_refused_and_its_payload_never_runs(
    reference, tiny_data, tmp_path, capsys, kind, command
):
    marker = tmp_path / "created-by-the-payload"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    name = "ckpt_00000004"
    path = (
        crafted_file(run_dir / f"{name}.pt", marker)
        if kind == "file"
        else crafted_dcp_folder(reference, run_dir / name, marker)
    )
    argv = {
        "train --resume": (train.main, run_args(tiny_data, run_dir, "--resume")),
        "sample": (sample.main, ["--ckpt", str(path), "--device", "cpu", "--max-new-tokens", "2"]),
        "export": (export.main, [str(path), "--out", str(tmp_path / "hf")]),
    }[command]
    code, _, err = run_main(*argv, capsys)
    payload = path if kind == "file" else path / ".metadata"
    assert_one_line_error(code, err, f"refused to load {payload}: it names ", "could run code")
    assert "open" in err  # the global the payload calls is named
    assert not marker.exists()
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_holding_a_numpy_array_is_refused_naming_it(reference, tiny_data, tmp_path, capsys):
    """fastpt writes NumPy's RNG state as a tensor; an array (NumPy's legacy RNG tuple) is no fastpt
    checkpoint's, and unpickling one needs NumPy's reconstruct global: refused in one line."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = checkpoint.load(reference / "ckpt_00000004.pt")
    ckpt["rng"]["numpy"] = np.random.RandomState(0).get_state()
    torch.save(ckpt, run_dir / "ckpt_00000004.pt")
    code, _, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume"), capsys)
    assert_one_line_error(code, err, "refused to load", "numpy", "(a NumPy array: fastpt saves NumPy's RNG state as")


def as_dcp_folder(ckpt: dict, path: Path) -> None:
    """The checkpoint as an FSDP run writes it (checkpointer's own writer): model and optimizer as DCP
    shards, the rest in state.pt, and the folder's checksums."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP in one process, no process group: intended here
        checkpointer._write_sharded(path, ckpt, is_main=True)


def test_a_dcp_folder_resumes_through_the_safe_reader(reference, tiny_data, tmp_path, capsys):
    """The restricted metadata unpickler and the weights-only planner read a real DCP folder whole:
    model, and optimizer state with its non-tensor hyperparameters."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    as_dcp_folder(checkpoint.load(reference / "ckpt_00000004.pt"), run_dir / "ckpt_00000004")
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    code, out, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume"), capsys)
    assert code == 0, err
    assert f"resumed from {run_dir / 'ckpt_00000004'} at step 4" in out
    assert losses(run_dir) == losses(reference)


# ---- state registered once


class Counter:
    """A Stateful of a feature's own (what a new piece of loop state looks like)."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def two_optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW on the matrices and SGD with momentum on the rest: state of two kinds over disjoint parameters."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return [torch.optim.AdamW(matrices, lr=1e-2), torch.optim.SGD(others, lr=1e-2, momentum=0.9)]


def test_a_checkpointer_saves_and_restores_every_registered_state_with_several_optimizers(tmp_path):
    from test_core import small_model

    from fastpt.model import Transformer

    torch.manual_seed(0)
    model, x = small_model(), torch.randint(0, 97, (2, 16))
    optimizers = two_optimizers(model)
    for _ in range(2):
        model(x, labels=x).loss.backward()
        for opt in optimizers:
            opt.step()
    meta = {"model_config": {"dim": 128}, "note": "plain values beside the states"}
    states = {
        "model": checkpoint.ModelState(model),
        "optimizer": checkpoint.OptimizerState(model, optimizers),
        "counter": Counter(7),
        "train_state": Counter(2),
    }
    path = checkpointer.Checkpointer(tmp_path, states, meta).save(2)
    assert path == tmp_path / "ckpt_00000002.pt"
    saved = torch.load(path, weights_only=True)
    assert saved["note"] == meta["note"] and saved["counter"] == {"n": 7}

    fresh = Transformer(model.cfg)
    fresh_optimizers = two_optimizers(fresh)
    counter = Counter()
    restored = checkpointer.Checkpointer(
        tmp_path,
        {
            "model": checkpoint.ModelState(fresh),
            "optimizer": checkpoint.OptimizerState(fresh, fresh_optimizers),
            "counter": counter,
            "train_state": Counter(),
        },
        meta,
    ).restore(torch.device("cpu"))
    assert restored == path and counter.n == 7
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    for before, after in zip(optimizers, fresh_optimizers):
        for p, q in zip(before.param_groups[0]["params"], after.param_groups[0]["params"]):
            assert before.state[p].keys() == after.state[q].keys()
            assert all(torch.equal(before.state[p][k], after.state[q][k]) for k in before.state[p])
    assert isinstance(
        fresh_optimizers[1].state[fresh_optimizers[1].param_groups[0]["params"][0]]["momentum_buffer"], torch.Tensor
    )


def test_a_state_the_checkpoint_lacks_is_one_line_naming_it(tmp_path):
    from test_core import small_model

    model = small_model()
    checkpointer.Checkpointer(
        tmp_path, {"model": checkpoint.ModelState(model), "train_state": Counter()}, {"model_config": {}}
    ).save(1)
    with pytest.raises(checkpoint.CheckpointError, match="could not load the counter state from .*ckpt_00000001.pt"):
        checkpointer.Checkpointer(
            tmp_path, {"model": checkpoint.ModelState(model), "counter": Counter(), "train_state": Counter()}, {}
        ).restore(torch.device("cpu"))


# ---- process state: what an in-process train.main leaves behind


def test_in_process_train_main_leaves_handlers_and_lock_as_it_found_them(tiny_data, tmp_path, capsys):
    import fcntl
    import signal
    import sys

    def ours(signum, frame):
        pass

    previous = {sig: signal.signal(sig, ours) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        hook = sys.excepthook
        code, out, err = run_main(train.main, run_args(tiny_data, tmp_path / "run", "--max-steps", "2"), capsys)
        assert code == 0, err
        assert signal.getsignal(signal.SIGTERM) is ours and signal.getsignal(signal.SIGINT) is ours
        assert sys.excepthook is hook and "interrupt" not in getattr(sys.excepthook, "__qualname__", "")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert out.startswith(f"run {tmp_path / 'run'} | device cpu")  # the summary names the run folder
    with open(tmp_path / "run" / ".lock") as f:  # the run lock was released when main returned
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_eta_follows_the_steady_pace_after_the_warm_up(monkeypatch):
    from fastpt import metrics

    now = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    pace = metrics.Pace()
    now[0] += 100.0  # the first window: 10 steps and a compilation
    pace.lap(10)
    assert pace.eta(90) is None  # no steady pace yet: the first window holds the compilation
    assert (
        metrics.Dashboard(100, 1, 1, 0.0, None, None, False, False)
        .line(
            {
                "step": 10,
                "loss": 1.0,
                "ppl": 2.7,
                "lr": 0.1,
                "grad_norm": 1.0,
                "peak_mem_gib": 0.5,
                "tok_s": 1.0,
                "mfu": None,
            },
            pace.eta(90),
        )
        .endswith("| ETA after warm-up")
    )
    for seconds in (10.0, 14.0, 6.0):  # then 1 s a step on average, an eval paused out of one window
        with pace.paused():
            now[0] += 50.0
        now[0] += seconds
        pace.lap(10)
    assert pace.eta(60) == pytest.approx(60.0)  # not the 600 s the first window's pace would say
    assert pace.eta(0) == 0.0


# ---- damaged bytes: whatever torch raises reading them, the file is damaged, never a traceback


def random_bytes(seed: int, n: int = 4096) -> bytes:
    return np.random.default_rng(seed).bytes(n)


# Seeds whose bytes make torch's weights-only unpickler raise each of its exception classes:
# 0 UnpicklingError, 17 IndexError ('pop from empty list'), 21 IndexError, 54 UnicodeDecodeError, 62 KeyError.
DAMAGE = {
    **{f"random bytes (seed {seed})": lambda data, seed=seed: random_bytes(seed) for seed in (0, 17, 21, 54, 62)},
    "empty": lambda data: b"",
    "a zip header, then random bytes": lambda data: b"PK\x03\x04" + random_bytes(1),
    "cut after 10 bytes": lambda data: data[:10],
    "cut in half": lambda data: data[: len(data) // 2],
    "cut by one byte": lambda data: data[:-1],
}


def damaged_run(reference: Path, run_dir: Path, case: str) -> Path:
    """A copy of the reference run (checkpoints 4 and 6) whose newest checkpoint is damaged."""
    shutil.copytree(reference, run_dir)
    newest = run_dir / "ckpt_00000006.pt"
    newest.write_bytes(DAMAGE[case](newest.read_bytes()))
    return newest


def test_resume_skips_a_damaged_newest_checkpoint_of_any_kind(reference, tiny_data, tmp_path, capsys):
    """Every damage through --resume: one warning naming the file, resumed from the intact step 4."""
    for i, case in enumerate(DAMAGE):
        run_dir = tmp_path / f"run{i}"
        newest = damaged_run(reference, run_dir, case)
        code, out, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume", "--max-steps", "4"), capsys)
        assert code == 0 and "Traceback" not in err, (case, err)
        assert f"resumed from {run_dir / 'ckpt_00000004.pt'} at step 4" in out, case
        assert err.startswith(f"fastpt: warning: skipped a newer checkpoint: could not read checkpoint {newest}: ")
        assert err.count("\n") == 1, (case, err)


@pytest.mark.parametrize("case", DAMAGE)
def test_sample_and_export_of_a_damaged_checkpoint_are_one_line(reference, tmp_path, capsys, case):
    newest = damaged_run(reference, tmp_path / "run", case)
    code, _, err = run_main(sample.main, ["--ckpt", str(newest), "--device", "cpu", "--max-new-tokens", "2"], capsys)
    assert_one_line_error(code, err, f"could not read checkpoint {newest}: ")
    code, _, err = run_main(export.main, [str(newest), "--out", str(tmp_path / "hf")], capsys)
    assert_one_line_error(code, err, f"could not read checkpoint {newest}: ")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("damaged", [".metadata", checkpoint.STATE_FILE, "__0_0.distcp"])
def test_resume_skips_a_dcp_folder_with_a_damaged_file(reference, tiny_data, tmp_path, damaged):
    """In a real process: what DCP logs about a damaged folder would reach stderr there."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    newest = run_dir / "ckpt_00000006"
    as_dcp_folder(checkpoint.load(run_dir / "ckpt_00000006.pt"), newest)
    (run_dir / "ckpt_00000006.pt").unlink()
    (newest / damaged).write_bytes(random_bytes(17))
    result = run_train(*run_args(tiny_data, run_dir, "--resume", "--max-steps", "4"))
    assert result.returncode == 0, result.stderr
    assert f"resumed from {run_dir / 'ckpt_00000004.pt'} at step 4" in result.stdout
    assert result.stderr.startswith("fastpt: warning: skipped a newer checkpoint: ") and str(newest) in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


# ---- what a resume holds


def cpu_allocator_peak(run, mapped: bool = False) -> int:
    """Bytes: the CPU allocator's peak while run() runs, from the running total that torch.profiler's
    allocation events carry. A memory-mapped file's tensors are the file's pages, not the
    allocator's: their events carry no total, and they count nothing, unless `mapped`: then every
    allocation event is summed in time order, a mapped file counted at its size (the profiler's view
    of a whole `fastpt.train.main`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    allocation = torch._C._profiler._EventType.Allocation
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack += e.children
        if e.tag == allocation and (mapped or e.extra_fields.total_allocated):
            events.append((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size))
    events.sort()
    if mapped:
        totals = np.cumsum([size for _, _, size in events])
        return int(totals.max()) if events else 0
    return max(total for _, total, _ in events) - (events[0][1] - events[0][2]) if events else 0


def test_a_resumed_main_peaks_as_a_fresh_one_by_the_profiler(tiny_data, tmp_path):
    """The whole command, as the profiler sees it: a resume read the checkpoint memory-mapped, which
    the profiler counts at the file's size (model and both AdamW moments) beside the live model and
    the optimizer state being filled: +74% at 13M parameters (199.1 against 346.8 MiB). Read one
    tensor at a time into the live ones, it peaks as a fresh run, within 5%."""
    shape = ("--dim", "256", "--n-layers", "4", "--n-heads", "4", "--ffn-dim", "704", "--micro-batch", "1")
    args = tiny_args(tiny_data, tmp_path / "run", *shape, ckpt_every=2, eval_every=1000, log_every=1)
    main = lambda *extra: run_quietly(train.main, [*args, *extra])  # noqa: E731
    fresh = cpu_allocator_peak(lambda: main("--max-steps", "2"), mapped=True)
    resumed = cpu_allocator_peak(lambda: main("--max-steps", "3", "--resume"), mapped=True)
    assert checkpoint.step_of(checkpoint.load(checkpoint.latest(tmp_path / "run"))) == 3  # it did resume
    assert resumed <= 1.05 * fresh, (fresh, resumed)


def test_resume_peaks_no_higher_than_a_fresh_run(tmp_path):
    """--resume reads the checkpoint memory-mapped on the CPU and copies it into the live parameters
    and optimizer state: built, resumed and stepped twice, the allocator's peak is a fresh run's
    (built, stepped twice) within 5%, so the plan (a fresh run's) covers a resume. Before: the whole
    checkpoint loaded beside the model plus fresh optimizer state beside the loaded one, +12 bytes
    per parameter (199 MiB fresh, 347 MiB resumed at 13M parameters, fp32, micro-batch 1)."""
    from fastpt import distributed
    from fastpt.config import resolve
    from fastpt.plan import planner
    from fastpt.step import TrainState, build_model, train_step

    shape = dict(preset="tiny", vocab_size=4096, dim=256, n_layers=4, n_heads=4, micro_batch=1, seq_len=64)
    cfg = resolve({**shape, "dtype": "fp32", "out": str(tmp_path), "resume": True}, None, "cpu")
    mcfg = planner.planned_model(cfg)
    loader = planner.FakeLoader(1, 64, mcfg.vocab_size)

    def run_checkpointer(net) -> checkpointer.Checkpointer:
        states = {
            "model": checkpoint.ModelState(net.raw),
            "optimizer": checkpoint.OptimizerState(net.raw, net.optimizers),
        }
        meta = {"model_config": mcfg.__dict__ | {}}
        return checkpointer.Checkpointer(tmp_path, {**states, "train_state": TrainState()}, meta)

    def run(resume: bool) -> None:
        net = build_model(cfg, mcfg, torch.device("cpu"), distributed.ONE_PROCESS)
        if resume:
            checkpointer.start_or_resume(cfg, run_checkpointer(net), torch.device("cpu"), lambda line: None)
        for _ in range(2):
            train_step(net, loader, cfg)

    net = build_model(cfg, mcfg, torch.device("cpu"), distributed.ONE_PROCESS)
    train_step(net, loader, cfg)
    run_checkpointer(net).save(1)
    saved = {k: v.clone() for k, v in net.raw.state_dict().items()}
    del net
    fresh, resumed = cpu_allocator_peak(lambda: run(False)), cpu_allocator_peak(lambda: run(True))
    assert resumed <= 1.05 * fresh, (fresh, resumed)
    net = build_model(cfg, mcfg, torch.device("cpu"), distributed.ONE_PROCESS)  # and it did load the checkpoint
    checkpointer.start_or_resume(cfg, run_checkpointer(net), torch.device("cpu"), lambda line: None)
    assert all(torch.equal(net.raw.state_dict()[k], v) for k, v in saved.items())
    assert all(len(s) for opt in net.optimizers for s in opt.state.values())


# ---- only proven damage is skipped


def test_a_one_block_unet_has_no_skip_weight_and_every_parameter_is_trained():
    """n_layers 1 has no block pair to join: an empty skip_weights got no gradient, so no optimizer
    state, and no checkpoint of the run resumed ("Missing optimizer state for 'skip_weights'")."""
    from fastpt.model import Transformer
    from fastpt.presets import ModelConfig

    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16, unet_skips=True))
    assert model.skip_weights is None and model.num_params() == model.cfg.num_params()
    x = torch.randint(0, 64, (2, 16))
    model(x, labels=x).loss.backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.slow
def test_a_one_block_unet_run_resumes_exactly(tiny_data, tmp_path):
    """Resumed from its step-2 checkpoint (the step-4 one removed), the run logs the same losses."""
    flags = dict(unet_skips=True, n_layers=1, max_steps=4, ckpt_every=2, log_every=1)
    args = tiny_args(tiny_data, tmp_path / "run", **flags)
    whole = run_train(*args)
    assert whole.returncode == 0, whole.stderr
    uninterrupted = losses(tmp_path / "run")
    (tmp_path / "run" / "ckpt_00000004.pt").unlink()
    resumed = run_train(*args, "--resume")
    assert resumed.returncode == 0 and not resumed.stderr, resumed.stderr
    assert f"resumed from {tmp_path / 'run' / 'ckpt_00000002.pt'} at step 2" in resumed.stdout
    assert losses(tmp_path / "run") == uninterrupted and len(uninterrupted) == 4


def folder_state(folder: Path) -> dict[str, bytes]:
    """Each file's bytes by name (the run lock, which every trainer rewrites, left out)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != ".lock"}


def test_a_checkpoint_that_does_not_fit_the_code_is_never_called_damaged(reference, tiny_data, tmp_path, capsys):
    """Its bytes match its checksum, so they are as fastpt wrote them: an optimizer state that does not
    fit the run is a mismatch of code or config, not damage. The resume stops in one line naming it
    and changes nothing: no older checkpoint silently costs its steps, nothing is moved aside."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)  # checkpoints 4 and 6
    newest = run_dir / "ckpt_00000006.pt"
    ckpt = checkpoint.load(newest)
    del ckpt["optimizer"]["state"]["tok_embeddings.weight"]  # what code that saved another optimizer writes
    checkpointer.write_file(newest, ckpt)
    before = folder_state(run_dir)
    code, _, err = run_main(train.main, run_args(tiny_data, run_dir, "--resume", "--max-steps", "8"), capsys)
    assert_one_line_error(
        code, err, f"could not load the optimizer state from {newest}: ", "tok_embeddings.weight", "nothing was changed"
    )
    assert "damaged" not in err.replace("not known to be damaged", "")
    assert folder_state(run_dir) == before


@pytest.mark.slow
def test_an_unreadable_newest_checkpoint_stops_the_resume_and_stays_in_place(reference, tiny_data, tmp_path):
    """chmod 000 (as a user: root's override dropped, faults.as_a_user) is no proof of damage: the
    resume stops in one line naming the file and the OS's reason, renames nothing, and retrains
    nothing; once readable again, it resumes from it."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    newest = run_dir / "ckpt_00000006.pt"
    newest.chmod(0)
    before = folder_state(run_dir)
    args = run_args(tiny_data, run_dir, "--resume", "--max-steps", "8")
    result = subprocess.run(
        [sys.executable, "-m", "fastpt.train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        preexec_fn=faults.as_a_user,
    )
    said = f"could not read checkpoint {newest}: Permission denied"
    assert_one_line_error(result.returncode, result.stderr, said, "nothing was changed")
    assert folder_state(run_dir) == before and newest.stat().st_mode & 0o777 == 0
    newest.chmod(0o644)
    code, out, err = run_quietly(train.main, args)
    assert code == 0 and not err, err
    assert f"resumed from {newest} at step 6" in out
