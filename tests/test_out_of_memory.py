"""A model too big for the machine's memory: one line naming what to change, exit 1, and the run
folder it would have made not left behind (no `.lock`)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
import torch

from conftest import REPO, assert_one_line_error, tiny_args
from fastpt.errors import out_of_memory

# The model's shape and the trainer's address space (torch loads in either): an embedding of 2,000,000 x
# 1,024 fp32 weights (8.2 GB) cannot be built in 6 GiB; 206M parameters (0.8 GB) can, but not with their
# gradients and AdamW's state, which the first step allocates.
MODELS = {
    "building": (["--vocab-size", "2000000", "--dim", "1024", "--n-heads", "8", "--n-layers", "1"], 6 << 30),
    "first-step": (["--dim", "2048", "--n-heads", "16", "--n-layers", "4", "--ffn-dim", "5632"], 3_000_000 << 10),
}


@pytest.mark.parametrize(
    "model", ["building", pytest.param("first-step", marks=pytest.mark.slow)], ids=["building", "first-step"]
)
def test_a_model_beyond_memory_is_one_line_and_leaves_no_folder(tiny_data, tmp_path, model):
    """The allocation fails in a real process, as on a machine with less memory than the run (a limit
    keeps this test's machine safe where the OS would grant the memory and then kill the process); a
    fresh run's folder, its config.toml, tokenizer.json, metrics.jsonl and .lock, is not left behind."""
    flags, limit = MODELS[model]
    out = tmp_path / "big"
    done = subprocess.run(
        [sys.executable, "-m", "fastpt.train", *tiny_args(tiny_data, out, *flags)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    assert_one_line_error(
        done.returncode, done.stderr, "out of memory training the run (can't allocate memory", expected_code=1
    )
    assert "--plan shows what the run needs" in done.stderr
    assert not out.exists()


def test_a_gpus_allocation_failure_is_recognized_and_other_errors_are_not():
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")).startswith("CUDA")
    assert out_of_memory(MemoryError()) == "MemoryError"
    assert out_of_memory(RuntimeError("shape mismatch")) == ""
