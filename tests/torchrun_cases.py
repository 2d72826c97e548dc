"""Several fastpt.train runs in one torchrun launch, one after another in the same processes: a
launch's cost (the launcher and every rank starting Python and importing torch, the group's
rendezvous) is paid once per topic, not once per run. Each run is a case with a name; every rank
writes its case's exit code and output to NAME.rankN.json beside the cases file, so that each test
checks its own case and a failure names it.

    launch({"ddp": [...fastpt.train's argv...], "fsdp": [...]}, folder)  # in a test: one torchrun launch
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TAIL = 4000  # characters of a case's output kept for its test's failure message


def launch(
    cases: dict[str, list[str]], folder: Path, patches: dict[str, str] | None = None, nproc: int = 2
) -> dict[str, dict]:
    """Run every case (name -> fastpt.train's argv; `patches`: name -> a PATCHES key for the cases run
    under one) in one torchrun launch of `nproc` processes, in order; returns name -> rank 0's
    {"code", "stdout", "stderr"} (a case that never ran: code None and the launch's output)."""
    folder.mkdir(parents=True, exist_ok=True)
    runs = {name: {"argv": argv, "patch": (patches or {}).get(name)} for name, argv in cases.items()}
    (folder / "cases.json").write_text(json.dumps(runs))
    # A rank stuck in a collective fails in minutes, not torch's 30: the later cases still run.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FASTPT_COLLECTIVE_TIMEOUT": "300"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # this checkout's fastpt
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run(
        [*torchrun, __file__, str(folder / "cases.json")],
        capture_output=True,
        text=True,
        timeout=3600,
        env=env,
        cwd=REPO,
    )
    results = {}
    for name in cases:
        path = folder / f"{name}.rank0.json"
        results[name] = (
            json.loads(path.read_text())
            if path.exists()
            else {"code": None, "stdout": proc.stdout[-TAIL:], "stderr": proc.stderr[-TAIL:]}
        )
    return results


def copying_ddp():
    """DDP as it was before gradient_as_bucket_view: gradients apart from the buckets."""
    from torch.nn.parallel import DistributedDataParallel

    class CopyingDDP(DistributedDataParallel):
        def __init__(self, *args, gradient_as_bucket_view=True, **kwargs):
            super().__init__(*args, gradient_as_bucket_view=False, **kwargs)

    return CopyingDDP


PATCHES = {"copying-ddp": ("DDP", copying_ddp)}  # name -> (fastpt.distributed's attribute, its replacement)


def run_case(name: str, argv: list[str], patch: str | None) -> dict:
    """One fastpt.train run in this process, as `python -m fastpt.train` runs it (with PATCHES[patch]
    in place): its exit code and output."""
    import torch.distributed as dist

    from fastpt import distributed, train
    from fastpt.errors import run_command

    real_connect = distributed.connect

    def connect(device_type: str) -> distributed.Dist:  # this case's rendezvous keys apart from earlier cases'
        d = real_connect(device_type)
        d.store = dist.PrefixStore(f"case/{name}/", d.store) if d.store is not None else None
        return d

    patched = {"connect": connect}
    if patch:
        attribute, make = PATCHES[patch]
        patched[attribute] = make()
    saved = {attribute: getattr(distributed, attribute) for attribute in patched}
    out, err = io.StringIO(), io.StringIO()
    try:
        for attribute, value in patched.items():
            setattr(distributed, attribute, value)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run_command(lambda: train.main(argv))
            except SystemExit as done:
                code = done.code
            except BaseException:  # noqa: BLE001 - reported as this case's failure; the next case still runs
                traceback.print_exc()
                code = "exception"
    finally:
        for attribute, value in saved.items():
            setattr(distributed, attribute, value)
    return {"code": code, "stdout": out.getvalue()[-TAIL:], "stderr": err.getvalue()[-TAIL:]}


def main(cases_file: Path) -> None:
    """A torchrun worker: every case of `cases_file` in order, each rank's result beside it."""
    rank = os.environ.get("RANK", "0")
    for name, case in json.loads(cases_file.read_text()).items():
        result = run_case(name, case["argv"], case["patch"])
        (cases_file.parent / f"{name}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
