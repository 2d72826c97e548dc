"""Run folders written by an earlier fastpt resume under this one, their config.toml in today's terms.

tests/data/old_relu2_run was written by the release before the model config's format 2 (commit
cb22855, where a relu2 MLP was 3/2 of ffn_dim wide), from that commit's own tree:
    python -m fastpt.prepare text.txt --out data --tokenizer bytes --workers 1   (6,000 bytes of its README)
    python -m fastpt.train --device cpu --preset tiny --dtype fp32 --dim 16 --n-layers 1 --n-heads 2 \
        --mlp relu2 --ffn-dim 128 --seq-len 32 --micro-batch 4 --grad-accum 1 --max-steps 4 --warmup-steps 1 \
        --ckpt-every 2 --keep-checkpoints 1 --eval-every 2 --eval-tokens 256 --log-every 1 --data data --out run
Its checkpoint is ckpt_00000004.pt, with an unmarked (format 1) model config of ffn_dim 128: a 192-wide MLP.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_main
from fastpt import checkpoint, train
from fastpt.config import load_toml
from fastpt.presets import upgraded_run

OLD_RUN = Path(__file__).parent / "data" / "old_relu2_run"


@pytest.fixture
def old_run(tmp_path) -> Path:
    shutil.copytree(OLD_RUN, tmp_path / "old")
    return tmp_path / "old"


def test_an_old_relu2_run_resumes_as_the_model_it_was(old_run, capsys):
    """The same `--resume` as before the upgrade: config.toml's ffn_dim 128 meant a 192-wide relu2 MLP; the
    run resumes as that model (refused before: 'ffn_dim 192 != 128') and its config.toml says 192 now."""
    run = old_run / "run"
    assert load_toml(str(run / "config.toml"))["ffn_dim"] == 128
    args = ["--out", str(run), "--data", str(old_run / "data"), "--resume", "--max-steps", "6", "--device", "cpu"]
    code, out, err = run_main(train.main, args, capsys)
    assert code == 0, err
    assert f"resumed from {run / 'ckpt_00000004.pt'} at step 4" in out
    assert load_toml(str(run / "config.toml"))["ffn_dim"] == 192
    saved = torch.load(checkpoint.latest(run), weights_only=True)
    assert checkpoint.step_of(saved) == 6
    assert saved["model_config"]["format"] == 2 and saved["model_config"]["ffn_dim"] == 192
    assert saved["model"]["layers.0.feed_forward.w1.weight"].shape == (192, 16)


def test_an_upgraded_config_is_not_upgraded_twice():
    """A resume that wrote the upgraded config.toml and stopped before its first checkpoint leaves a
    format-1 checkpoint beside it: the next resume keeps 192, not 288; SwiGLU's and a preset's
    width (no ffn_dim key) mean what they meant."""
    old = {"mlp": "relu2", "ffn_dim": 128, "dim": 16}  # format 1: unmarked
    assert upgraded_run({"ffn_dim": 128, "lr": 0.1}, old) == {"ffn_dim": 192, "lr": 0.1}
    assert upgraded_run({"ffn_dim": 192}, old) == {"ffn_dim": 192}
    assert upgraded_run({"lr": 0.1}, old) == {"lr": 0.1}
    assert upgraded_run({"ffn_dim": 128}, {**old, "mlp": "swiglu"}) == {"ffn_dim": 128}
    assert upgraded_run({"ffn_dim": 128}, {**old, "format": 2}) == {"ffn_dim": 128}
    assert upgraded_run({"ffn_dim": 128}, {}) == {"ffn_dim": 128}  # no checkpoint
