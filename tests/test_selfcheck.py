"""Kernels that check themselves where they are about to run (fastpt.kernels.selftest,
fastpt.selfcheck): on CPU through Triton's interpreter, the probe a GPU run makes before its first
step passes the real kernels, and a kernel made wrong on purpose (or one that fails to run) is
named: --kernels auto falls back to the reference with one warning, --kernels triton stops, exit 2."""

from __future__ import annotations

import pytest
import torch
from test_kernels import _interpret, _language_restored

from conftest import assert_one_line_error, read_metrics, run_main, tiny_args
from fastpt import train
from fastpt.config import TrainConfig
from fastpt.distributed import Dist
from fastpt.kernels import api, selftest
from fastpt.kernels.ops import cross_entropy as ce_ops
from fastpt.kernels.ops import linear_cross_entropy as lce_ops
from fastpt.presets import ModelConfig
from fastpt.selfcheck import kernel_backend

CPU = torch.device("cpu")
VOCAB = 9001  # past two tiles of the sweep in fp32 (4096 each), within two in bf16 (8192): ragged and padded


@pytest.fixture
def interpreted(monkeypatch):
    """The Triton kernels run through the interpreter, as a GPU run would run them compiled."""
    _interpret(monkeypatch)
    with _language_restored():
        yield


def wrong(monkeypatch, op: str, how: str) -> None:
    """Make the Triton path of `op` wrong on purpose: its result 10% off, or a failure to compile."""
    real = getattr(api.functional, op)

    def off(*args, **kwargs):
        return real(*args, **kwargs) * 1.1

    def fails(*args, **kwargs):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_120")

    monkeypatch.setattr(api.functional, op, off if how == "wrong" else fails)


def region_wrong(monkeypatch, where: str) -> None:
    """Make the cross-entropy kernel inside linear + cross-entropy wrong in one place only: the
    gradient past its first tile of the vocabulary, a gradient on an ignored row, the loss of the
    launch without gradients (evaluation's), or everything when its logits are bf16."""
    real = lce_ops.cross_entropy_forward

    def off(logits, target, ignore_index, z_loss=0.0, grad=None, grad_scale=None, row_width=None, softcap=0.0):
        loss, z, lse = real(logits, target, ignore_index, z_loss, grad, grad_scale, row_width, softcap)
        block = ce_ops.launch_plan(logits.shape[1], logits.element_size())[1]
        if where == "past the first tile" and grad is not None:
            grad[:, block:] *= 1.1
        elif where == "ignored row" and grad is not None:
            grad[target == ignore_index] = grad[target != ignore_index][:1]
        elif where == "evaluation" and grad is None:
            loss *= 1.1
        elif where == "bf16 logits" and logits.dtype == torch.bfloat16 and grad is not None:
            grad *= 1.1
        elif where == "capped" and softcap:
            loss *= 1.1
        return loss, z, lse

    monkeypatch.setattr(lce_ops, "cross_entropy_forward", off)


@pytest.mark.parametrize(
    "dtype, params", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]
)
def test_every_kernel_passes_its_probe(interpreted, dtype, params):
    assert selftest.failures(dtype, CPU, dim=128, vocab=VOCAB, z_loss=1e-4, params=params) == {}


def test_the_probe_keeps_the_runs_tiles_in_two():
    """A full tile of the sweep and one as long as the run's last (the same padding to 64 and
    divisibility by 16 as the run's vocabulary); a vocabulary within two tiles is the run's."""
    for vocab, dtype, block, want in [
        (32000, torch.float32, 4096, 4096 + 3328),
        (32000, torch.bfloat16, 8192, 8192 + 7424),
        (50257, torch.bfloat16, 8192, 8192 + 1105),
        (65536, torch.bfloat16, 8192, 2 * 8192),
        (VOCAB, torch.bfloat16, 8192, VOCAB),
        (1000, torch.float32, 1024, 1000),
    ]:
        assert ce_ops.launch_plan(vocab, dtype.itemsize)[1] == block
        assert selftest.probe_vocab(vocab, dtype) == want
        assert want % block == vocab % block and want % 64 == vocab % 64


@pytest.mark.parametrize("op", ["rms_norm", "linear_cross_entropy"])
@pytest.mark.parametrize("how", ["wrong", "fails"])
def test_a_kernel_made_wrong_is_named(interpreted, monkeypatch, op, how):
    wrong(monkeypatch, op, how)
    found = selftest.failures(torch.bfloat16, CPU, dim=128, vocab=VOCAB)
    said = "the result differs from the reference by " if how == "wrong" else "RuntimeError: PTX .version"
    assert list(found) == [op] and found[op].startswith(said), found


@pytest.mark.parametrize(
    "where, said",
    [
        ("past the first tile", "the gradient of the input differs"),
        ("ignored row", "the gradient of the input differs"),
        ("evaluation", "the result without gradients differs"),
        ("bf16 logits", "the gradient of the input differs"),
    ],
)
def test_a_kernel_wrong_in_one_place_is_named(interpreted, monkeypatch, where, said):
    """The narrowed probe still reaches each place: the tile after the first, an ignored row, the
    launch without gradients, and the bf16 logits a bf16 run's autocast computes."""
    region_wrong(monkeypatch, where)
    dtype = torch.float32 if where == "past the first tile" else torch.bfloat16  # fp32: two tiles of 9001
    found = selftest.failures(dtype, CPU, dim=128, vocab=VOCAB)
    assert list(found) == ["linear_cross_entropy"] and found["linear_cross_entropy"].startswith(said), found


def test_a_capped_run_probes_the_capped_kernel(interpreted, monkeypatch):
    """--logit-softcap compiles a kernel of its own: the probe of a capped run runs it, so a kernel
    wrong only when it caps is named for that run, and not for an uncapped one."""
    region_wrong(monkeypatch, "capped")
    cfg, log = TrainConfig(dtype="bf16", kernels="auto"), lambda *a, **k: warnings.append(a)
    warnings = []
    assert kernel_backend(cfg, ModelConfig(vocab_size=VOCAB, dim=128), CPU, Dist(), log) == "auto" and not warnings
    capped = ModelConfig(vocab_size=VOCAB, dim=128, logit_softcap=15.0)
    assert kernel_backend(cfg, capped, CPU, Dist(), log) == "torch"
    assert len(warnings) == 1 and "kernel linear_cross_entropy failed its check" in warnings[0][0], warnings


def test_fsdp_bf16_parameters_are_probed_in_bf16(interpreted, monkeypatch):
    """A bf16 run's norms get fp32 activations and weights, but bf16 ones where FSDP shards it: the
    probe gives each run what its model will."""
    real = api.functional.rms_norm
    monkeypatch.setattr(
        api.functional, "rms_norm", lambda x, *a: real(x, *a) * (1.1 if x.dtype == torch.bfloat16 else 1)
    )
    cfg, mcfg = TrainConfig(dtype="bf16", kernels="auto", parallel="fsdp"), ModelConfig(vocab_size=VOCAB, dim=128)
    warnings = []
    assert kernel_backend(cfg, mcfg, CPU, Dist(), lambda *a, **k: warnings.append(a)) == "auto" and not warnings
    assert kernel_backend(cfg, mcfg, CPU, Dist(world_size=2), lambda *a, **k: warnings.append(a)) == "torch"
    assert len(warnings) == 1 and "kernel rms_norm failed its check on cpu in bf16" in warnings[0][0], warnings


def test_auto_falls_back_to_the_reference_with_one_warning(interpreted, monkeypatch, tiny_data, tmp_path, capsys):
    wrong(monkeypatch, "rms_norm", "wrong")
    args = tiny_args(tiny_data, tmp_path / "auto", max_steps=2, kernels="auto")
    code, _, err = run_main(train.main, args, capsys)
    assert code == 0, err
    warning = "fastpt: warning: kernel rms_norm failed its check on cpu in fp32 (dim 128, vocab "
    assert err.count("fastpt: warning: kernel ") == 1 and warning in err, err
    assert "; the run uses the PyTorch reference kernels\n" in err
    # the reference trained it: the same losses as --kernels torch
    reference = tiny_args(tiny_data, tmp_path / "torch", max_steps=2, kernels="torch")
    assert run_main(train.main, reference, capsys)[0] == 0
    losses = {name: [r["loss"] for r in read_metrics(tmp_path / name)] for name in ("auto", "torch")}
    assert losses["auto"] == pytest.approx(losses["torch"], rel=1e-6)


def test_kernels_triton_stops_naming_the_kernel(interpreted, monkeypatch, tiny_data, tmp_path, capsys):
    wrong(monkeypatch, "linear_cross_entropy", "fails")
    code, _, err = run_main(train.main, tiny_args(tiny_data, tmp_path / "run", max_steps=2, kernels="triton"), capsys)
    assert_one_line_error(code, err, "--kernels triton: kernel linear_cross_entropy failed its check", "RuntimeError")
    assert not list((tmp_path / "run").glob("ckpt_*"))
