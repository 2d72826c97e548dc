"""Shared fixtures: a small real corpus prepared once per session, a trainer runner and its arguments."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastpt.prepare import prepare

# A shell without job control starts a background job (`pytest ... &`) with SIGINT ignored, and every
# process it starts inherits that: the Ctrl-C tests' processes would never see their signal. A handler
# set here is reset to the default in each child at exec, so they get Python's KeyboardInterrupt again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]

# One thread, as run_train's processes (OMP_NUM_THREADS=1): a run here and one in a subprocess
# compute bit-identically (a resume in this process of a run killed in another), and the machine
# has two cores. The variable too: fastpt.train's default --threads keeps a thread count it sets.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def update_table(table: Path, name: str, **values: object) -> None:
    """FASTPT_UPDATE_PLANS's rewrite of one entry of a committed table, under a lock: the suite's
    workers (pytest-xdist) each rewrite their own entries of the same file."""
    import fcntl

    with open(table.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = json.loads(table.read_text())
        plans = entries.get("plans") or {row["name"]: row for row in entries["runs"]}  # a table of plans, or of runs
        plans[name].update(values)
        table.write_text(json.dumps(entries, indent=2, ensure_ascii=False) + "\n")


def table_entries(table: Path) -> list:
    """A committed table of planned configs (tests/planned_*.json) as test parameters, its slow ones marked."""
    entries = json.loads(table.read_text())["plans"]
    return [
        pytest.param(name, entry, marks=[pytest.mark.slow] if entry.get("slow") else [], id=name)
        for name, entry in entries.items()
    ]


@pytest.fixture(autouse=True)
def fresh_plans(request):
    """The planner keeps a process's recent traces (a search never traces a configuration twice):
    tests share them, as a trace costs seconds, but a test that patches (monkeypatch) is handed none
    and leaves none behind."""
    patches = "monkeypatch" in request.fixturenames
    planner = sys.modules.get("fastpt.plan.planner")
    if patches and planner:
        planner.TRACED.clear()
    yield
    if patches and (planner := sys.modules.get("fastpt.plan.planner")):
        planner.TRACED.clear()


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder `make` fills once for the whole test session: under pytest-xdist the first worker to
    ask makes it (the others wait on a lock, then read it), so an expensive fixture (a torchrun launch)
    is not paid once per worker. Its tests only read it, or copy it first."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    import fcntl

    folder = tmp_path_factory.getbasetemp().parent / name  # the session's folder, above every worker's
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker's attempt that failed
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """Byte-level shards over the project's own sources: real text, made locally, in seconds."""
    files = sorted((REPO / "fastpt").glob("*.py")) + sorted((REPO / "kernels").rglob("*.py"))
    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare(files, out, "bytes", workers=1)
    return out


@pytest.fixture(scope="session")
def bpe_data(tmp_path_factory) -> Path:
    """A locally trained byte-level BPE (vocab 512) over a slice of the Python stdlib."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:40]
    out = tmp_path_factory.mktemp("data") / "bpe"
    prepare(files, out, "bpe", 512, workers=1)
    return out


def run_train(*args: str, timeout: float = 300, env: dict | None = None, nproc: int = 0) -> subprocess.CompletedProcess:
    """python -m fastpt.train as a real subprocess (one thread: the machine has two cores);
    nproc > 0 launches it under torchrun with that many processes (gloo on CPU, a free port)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    return subprocess.run(
        [sys.executable, *torchrun, "-m", "fastpt.train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


def failure_of(result: subprocess.CompletedProcess) -> str:
    """A failed launch's output for an assertion message: the tail of stdout and of stderr up to
    torchrun's own traceback, which would otherwise push the rank's error out of a fixed tail."""
    err, launcher = result.stderr, result.stderr.find("torch/distributed/run.py")
    cut = err.rfind("Traceback (most recent call last):", 0, launcher) if launcher >= 0 else -1
    return result.stdout[-2000:] + "\n--- stderr ---\n" + (err[:cut] if cut >= 0 else err)[-6000:]


def read_metrics(run_dir: Path) -> list[dict]:
    """Train records (those with a loss) from metrics.jsonl."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


TINY = ("--device", "cpu", "--preset", "tiny", "--dtype", "fp32", "--seq-len", "32", "--micro-batch", "4")


def tiny_args(data: Path, out: Path, *extra: str, **flags: object) -> list[str]:
    """fastpt.train's arguments for a TINY run on `data` into `out`: each keyword is its flag
    (max_steps=4 is `--max-steps 4`, compile=True `--compile`, False `--no-compile`), then `extra`
    as written (a flag given twice: the later one wins, so a keyword can override TINY's)."""
    args = [*TINY, "--data", str(data), "--out", str(out)]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            args += [flag, str(value)]
    return [*args, *extra]


def eager_and_compiled(
    data: Path, out: Path, *compile_flags: str, **flags: object
) -> tuple[subprocess.CompletedProcess, list[dict], list[dict]]:
    """One tiny run's config trained twice, under --compile (and `compile_flags`) in out/compiled and
    eager in out/eager, both exiting 0: the compiled process, its train records and the eager run's."""
    compiled = run_train(*tiny_args(data, out / "compiled", "--compile", *compile_flags, **flags), timeout=900)
    assert compiled.returncode == 0, compiled.stderr
    eager = run_train(*tiny_args(data, out / "eager", **flags))
    assert eager.returncode == 0, eager.stderr
    return compiled, read_metrics(out / "compiled"), read_metrics(out / "eager")


def assert_one_line_error(code: int, err: str, *named: str, expected_code: int = 2) -> None:
    """A user's mistake (or a Ctrl-C, exit 130): the exit code and one `fastpt: error:` line naming
    what is wrong, no traceback (progress bars or warnings printed before it may stay)."""
    errors = [line for line in err.splitlines() if line.startswith("fastpt: error: ")]
    assert code == expected_code and len(errors) == 1 and err.endswith(errors[0] + "\n") and "Traceback" not in err, err
    assert all(n in errors[0] for n in named), errors[0]


def inductor_compiler_imported(code: str) -> list[str]:
    """Which of Inductor's compiler modules a fresh Python process has imported after running `code`
    (one thread, from the repository root): an eager run or plan should import none of them."""
    modules = ("torch._inductor.compile_fx", "torch._inductor.cudagraph_trees")
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {modules!r} if m in sys.modules]))\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_main(main, args: list[str], capsys) -> tuple[int, str, str]:
    """A command's main in this process, as its `python -m` entry runs it: (exit code, stdout, stderr)."""
    from fastpt.errors import run_command

    with pytest.raises(SystemExit) as exit_info:
        run_command(lambda: main(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def run_quietly(main, args: list[str]) -> tuple[int, str, str]:
    """run_main for a fixture, which has no capsys: the output caught by redirecting sys.stdout and
    sys.stderr."""
    from fastpt.errors import run_command

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        run_command(lambda: main(args))
    return exit_info.value.code, out.getvalue(), err.getvalue()


def train_refuses(capsys, argv: list[str], *named: str) -> None:
    """fastpt.train with argv stops at a user's mistake: one error line naming `named`."""
    from fastpt import train

    code, _, err = run_main(train.main, argv, capsys)
    assert_one_line_error(code, err, *named)


# ---- a run's folder: the uninterrupted reference run, its records, its files


def train_here(capsys, *args: str) -> tuple[int, str, str]:
    """python -m fastpt.train's work in this process: (exit code, stdout, stderr)."""
    from fastpt import train

    return run_main(train.main, list(args), capsys)


def run_args(data: Path, out: Path, *extra: str) -> list[str]:
    """10 steps of 2 micro-batches, every step logged, checkpoints at 4 and 8 (keep 2) and the end."""
    flags = dict(max_steps=10, grad_accum=2, log_every=1, eval_every=5, ckpt_every=4, keep_checkpoints=2)
    return tiny_args(data, out, *extra, **flags)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


def ckpt_names(run_dir: Path) -> list[str]:
    from fastpt import checkpoint

    return [p.name for p in checkpoint.checkpoints(run_dir)]


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields: what a resumed run must reproduce exactly."""
    timing = {"tok_s", "tok_s_per_gpu", "mfu", "peak_mem_gib", "data_wait_pct"}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in lines]


@pytest.fixture(scope="session")
def reference(tiny_data, tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one must reproduce (tests copy it before they write to it)."""
    from fastpt import train

    out = tmp_path_factory.mktemp("reference")
    code, _, err = run_quietly(train.main, run_args(tiny_data, out))
    assert code == 0, err
    return out


def base_args(data: Path, out: Path) -> list[str]:
    return [*TINY, "--data", str(data), "--out", str(out), "--max-steps", "10"]


def mount_tmpfs(mount: Path, size: str):
    """A real filesystem of `size` (tmpfs) at `mount`, where the machine lets the tests mount one."""
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("mounting a tmpfs is not permitted here (the RLIMIT_FSIZE tests cover failed writes)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def run_command_line(module: str, *args: str, fsize: int = 0) -> subprocess.CompletedProcess:
    """python -m fastpt.MODULE as a real process; fsize > 0 sets RLIMIT_FSIZE (`ulimit -f`) in it."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))

    return subprocess.run(
        [sys.executable, "-m", f"fastpt.{module}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=limit if fsize else None,
    )


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def no_work(monkeypatch):
    """Preparing the data or planning the batch fails the test: a refusal must come before them."""
    from fastpt import train

    def work(*args, **kwargs):
        raise AssertionError("work started before the refusal")

    monkeypatch.setattr(train, "build_data", work)
    monkeypatch.setattr(train.fit, "auto_micro_batch", work)


def assert_resumes_exactly(data: Path, tmp_path: Path, capsys, flags: tuple[str, ...], at: int) -> Path:
    """A run with `flags` to its end, then a fresh folder holding only its checkpoint of step `at`,
    resumed: it logs the records the run logged after `at`. Returns the resumed run's folder."""
    from fastpt import train

    reference = [*run_args(data, tmp_path / "reference", *flags), "--keep-checkpoints", "3"]
    assert run_main(train.main, reference, capsys)[0] == 0
    (tmp_path / "run").mkdir()
    shutil.copy(tmp_path / "reference" / f"ckpt_{at:08d}.pt", tmp_path / "run")
    code, out, err = run_main(train.main, [*run_args(data, tmp_path / "run", *flags), "--resume"], capsys)
    assert code == 0 and f"at step {at}" in out, err
    assert records(tmp_path / "run") == [r for r in records(tmp_path / "reference") if r["step"] > at]
    return tmp_path / "run"
