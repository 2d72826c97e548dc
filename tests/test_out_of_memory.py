"""A model too big for the machine's memory: one line naming what to change, exit 1, and the run
folder it would have made not left behind (no `.lock`)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

from conftest import REPO, assert_one_line_error, tiny_args

LIMIT = 6 << 30  # address space for the trainer: torch loads in it, an 8.2 GB embedding does not


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def test_a_model_beyond_memory_is_one_line_and_leaves_no_folder(tiny_data, tmp_path):
    """An embedding of 2,000,000 x 1,024 fp32 weights (8.2 GB) under a 6 GiB limit: the allocation fails
    in a real process, as on a machine that has less memory than the model (a limit keeps this test's
    machine safe where the OS would grant the memory and then kill the process)."""
    out = tmp_path / "big"
    args = tiny_args(tiny_data, out, "--vocab-size", "2000000", "--dim", "1024", "--n-heads", "8", "--n-layers", "1")
    done = subprocess.run(
        [sys.executable, "-m", "fastpt.train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        preexec_fn=limited,
    )
    assert_one_line_error(
        done.returncode, done.stderr, "out of memory training the run (can't allocate memory", expected_code=1
    )
    assert "--plan shows what the run needs" in done.stderr
    assert not out.exists()
