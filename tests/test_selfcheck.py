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
from fastpt.kernels import api, selftest


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_passes_its_probe(interpreted, dtype):
    assert selftest.failures(dtype, torch.device("cpu"), dim=128, vocab=1000, z_loss=1e-4) == {}


@pytest.mark.parametrize("op", ["rms_norm", "linear_cross_entropy"])
@pytest.mark.parametrize("how", ["wrong", "fails"])
def test_a_kernel_made_wrong_is_named(interpreted, monkeypatch, op, how):
    wrong(monkeypatch, op, how)
    found = selftest.failures(torch.bfloat16, torch.device("cpu"), dim=128, vocab=1000)
    said = "the result differs from the reference by " if how == "wrong" else "RuntimeError: PTX .version"
    assert list(found) == [op] and found[op].startswith(said), found


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
