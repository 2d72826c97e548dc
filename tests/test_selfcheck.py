"""Kernels that check themselves where they are about to run (fastpt.kernels.selftest,
fastpt.selfcheck): the probes are the launches the run's model makes (QK-norm's included); on CPU
through Triton's interpreter the real kernels pass in fp32, and a kernel made wrong on purpose (or
one that fails to run) is named: --kernels auto falls back to the reference with one warning per
failing rank, before --micro-batch auto plans, --kernels triton stops, exit 2. Each output is held to
the precision it is computed in: in bf16 a norm 0.5% off and a loss 0.05 nat off are caught.

The interpreter rounds fp32 to bf16 by truncation (a bias of about half a unit roundoff, which the
check rightly reports), so the bf16 checks here use kernels built on the reference; the real
kernels' bf16 probes are `gpu` tests."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time

import pytest
import torch
from test_kernels import _interpret, _language_restored, cuda

import faults
from conftest import REPO, assert_one_line_error, failure_of, read_metrics, run_main, tiny_args
from fastpt import selfcheck, train
from fastpt.config import TrainConfig
from fastpt.distributed import Dist
from fastpt.errors import ConfigError
from fastpt.kernels import api, reference, selftest
from fastpt.kernels.ops import cross_entropy as ce_ops
from fastpt.kernels.ops import linear_cross_entropy as lce_ops
from fastpt.presets import ModelConfig

CPU = torch.device("cpu")
VOCAB = 9001  # past two tiles of the sweep in fp32 (4096 each), within two in bf16 (8192): ragged and padded
# hidden 128, head_dim 32 with QK-norm: the model's norms over both, its loss with the z-loss
MODEL = ModelConfig(vocab_size=VOCAB, dim=128, n_heads=4, qk_norm=True)


def launches(dtype: str = "fp32", params: torch.dtype = torch.float32, z_loss: float = 1e-4) -> list:
    return selfcheck.launches(TrainConfig(dtype=dtype, z_loss=z_loss), MODEL, params)


@pytest.fixture
def interpreted(monkeypatch):
    """The Triton kernels run through the interpreter, as a GPU run would run them compiled."""
    _interpret(monkeypatch)
    with _language_restored():
        yield


def wrong(monkeypatch, op: str, how: str) -> None:
    """Make the Triton path of `op` wrong on purpose: its result (the loss) 10% off, or a failure to compile."""
    real = getattr(api.functional, op)

    def off(*args, **kwargs):
        out = real(*args, **kwargs)
        return (out[0] * 1.1, *out[1:]) if isinstance(out, tuple) else out * 1.1

    def fails(*args, **kwargs):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_120")

    monkeypatch.setattr(api.functional, op, off if how == "wrong" else fails)


class _GradScaled(torch.autograd.Function):
    """The identity forward, its gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def on_the_reference(monkeypatch, norm_scale: float = 1.0, norm_grad_scale: float = 1.0, loss_offset: float = 0.0):
    """The ops' "kernels" built on the reference, so they round as it does (the interpreter's bf16
    cannot), optionally wrong: the norm's bf16 results or gradients scaled, the loss offset."""

    def rms_norm(x, weight, eps):
        y = reference.rms_norm(x, weight, eps)
        if x.dtype == torch.bfloat16:  # only what is computed in bf16: QK-norm's, or under FSDP every norm
            y = _GradScaled.apply(y * norm_scale, norm_grad_scale)
        return y

    def linear_cross_entropy(*args, **kwargs):
        out = reference.linear_cross_entropy(*args, **kwargs)
        return (out[0] + loss_offset, out[1]) if isinstance(out, tuple) else out + loss_offset

    monkeypatch.setattr(api.functional, "rms_norm", rms_norm)
    monkeypatch.setattr(api.functional, "linear_cross_entropy", linear_cross_entropy)


# ---- what is probed


def test_the_probes_are_the_runs_launches():
    """A bf16 run's model launches the norm over the hidden size on its fp32 residual stream, QK-norm
    over the head size on bf16 queries and keys with an fp32 weight, and the loss with its z-loss
    under autocast, with gradients (training) and per target without (evaluation); under FSDP the
    norms get bf16 weights; a soft-capped model's loss is the fused one, with its cap."""
    described = [str(launch) for launch in launches("bf16")]
    assert described == [
        "rms_norm(x [rows, 128] float32, weight [128] float32) under bfloat16 autocast with gradients",
        "rms_norm(x [rows, 32] bfloat16, weight [32] float32) under bfloat16 autocast with gradients",
        "linear_cross_entropy(input [rows, 128] float32, weight [9001, 128] float32, target [rows] int64, "
        "z_loss=0.0001, return_z_loss=True) under bfloat16 autocast with gradients",
        "rms_norm(x [rows, 128] float32, weight [128] float32) under bfloat16 autocast without gradients",
        "rms_norm(x [rows, 32] bfloat16, weight [32] float32) under bfloat16 autocast without gradients",
        "linear_cross_entropy(input [rows, 128] float32, weight [9001, 128] float32, target [rows] int64, "
        "reduction='none', z_loss=0.0001, return_z_loss=True) under bfloat16 autocast without gradients",
    ], described
    fsdp = launches("bf16", torch.bfloat16)
    assert {(a.dtype, a.shape) for x in fsdp if x.op == "rms_norm" for a in x.tensors} == {
        (torch.bfloat16, (128,)),
        (torch.bfloat16, (32,)),
    }
    capped = selfcheck.launches(TrainConfig(), dataclasses.replace(MODEL, logit_softcap=15.0), torch.float32)
    losses = [x for x in capped if x.op == "linear_cross_entropy"]
    assert len(losses) == 2 and all(dict(x.options)["softcap"] == 15.0 for x in losses), losses
    assert all("softcap=15.0" in str(x) for x in losses)


def test_an_options_new_argument_is_recorded_and_probed(monkeypatch):
    """An argument an op gains (label smoothing, say) is recorded by name and passed to the probe's calls."""
    seen = []
    real = api.linear_cross_entropy

    def smoothed(input, weight, target, ignore_index=-100, reduction="mean", *, label_smoothing=0.0, backend="auto"):
        seen.append((label_smoothing, backend))
        return real(input, weight, target, ignore_index, reduction, backend=backend)

    monkeypatch.setattr(api, "linear_cross_entropy", smoothed)
    x, w, target = torch.randn(4, 8, requires_grad=True), torch.nn.Parameter(torch.randn(16, 8)), torch.zeros(4).long()
    with selftest.recording() as recorded:
        api.linear_cross_entropy(x, w, target, label_smoothing=0.1)
    (launch,) = recorded
    assert dict(launch.options)["label_smoothing"] == 0.1 and "label_smoothing=0.1" in str(launch)
    selftest.run(launch, selftest.probe_inputs(launch, CPU), "torch", [])
    assert seen == [(0.1, "auto"), (0.1, "torch")]


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


# ---- the real kernels, and kernels made wrong


def test_every_kernel_passes_its_probe(interpreted):
    assert selftest.failures(launches(), CPU) == {}


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, params", [("bf16", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float32)])
@pytest.mark.parametrize("model", ["tiny", "0.04b", "1b"])
def test_every_kernel_passes_its_probe_on_a_gpu(dtype, params, model):
    """The compiled kernels in 16 bits, within the precision each output is computed in."""
    from fastpt.presets import PRESETS

    mcfg = dataclasses.replace(PRESETS[model], vocab_size=32000 if model != "1b" else 50257, qk_norm=True)
    found = selftest.failures(
        selfcheck.launches(TrainConfig(dtype=dtype, z_loss=1e-4), mcfg, params), torch.device("cuda")
    )
    assert found == {}


@pytest.mark.parametrize("op", ["rms_norm", "linear_cross_entropy"])
@pytest.mark.parametrize("how", ["wrong", "fails"])
def test_a_kernel_made_wrong_is_named(interpreted, monkeypatch, op, how):
    wrong(monkeypatch, op, how)
    found = selftest.failures(launches(), CPU)
    said = " differs from the reference by " if how == "wrong" else "with gradients: RuntimeError: PTX .version"
    assert list(found) == [op] and found[op].startswith(op) and said in found[op], found


@pytest.mark.parametrize(
    "step, said",
    [("probe_inputs", "the probe's inputs could not be made: "), ("as_computed", "the probe's oracle failed: ")],
)
def test_a_probe_that_raises_is_a_failure_of_its_kernel(interpreted, monkeypatch, step, said):
    """An exception while the probe makes its inputs or runs its oracle (a GPU out of memory) is that
    kernel's failure, said like any other, not an exception out of the check: under torchrun the
    other ranks learn it through the store instead of waiting for a rank that died."""

    def raises(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(selftest, step, raises)
    found = selftest.failures(launches(), CPU)
    assert list(found) == ["rms_norm", "linear_cross_entropy"], found
    assert all(f"with gradients: {said}RuntimeError: CUDA out of memory." in why for why in found.values()), found


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
    "where, said",
    [
        ("past the first tile", "with gradients: the gradient of input differs"),
        ("ignored row", "with gradients: the gradient of input differs"),
        ("evaluation", "reduction='none', z_loss=0.0001, return_z_loss=True) without gradients: result 1 of 2 differs"),
        ("bf16 logits", "with gradients: the gradient of input differs"),
    ],
)
def test_a_kernel_wrong_in_one_place_is_named(interpreted, monkeypatch, where, said):
    """The narrowed probe still reaches each place: the tile after the first, an ignored row, the
    launch without gradients, and the bf16 logits a bf16 run's autocast computes (the loss itself
    comes out of the interpreter right: its bf16 rounding is torch's matmul's)."""
    region_wrong(monkeypatch, where)
    dtype = "bf16" if where == "bf16 logits" else "fp32"  # fp32: two tiles of 9001
    found = selftest.failures([x for x in launches(dtype) if x.op == "linear_cross_entropy"], CPU)
    assert list(found) == ["linear_cross_entropy"] and said in found["linear_cross_entropy"], found


def test_a_capped_run_probes_the_capped_kernel(interpreted, monkeypatch, capsys):
    """--logit-softcap compiles a kernel of its own: the probe of a capped run runs it (the run's
    launch passes softcap through), so a kernel wrong only when it caps is named for that run, and
    not for an uncapped one."""
    region_wrong(monkeypatch, "capped")
    cfg, model = TrainConfig(dtype="fp32"), dataclasses.replace(MODEL, qk_norm=False)
    assert selfcheck.kernel_backend(cfg, lambda: model, CPU, Dist()) == selfcheck.Backend("triton", "auto")
    assert not capsys.readouterr().err
    capped = dataclasses.replace(model, logit_softcap=15.0)
    backend = selfcheck.kernel_backend(cfg, lambda: capped, CPU, Dist())
    assert str(backend) == "torch (auto: linear_cross_entropy failed its check)"
    err = capsys.readouterr().err
    said = "fastpt: warning: kernel linear_cross_entropy failed its check on cpu in fp32: linear_cross_entropy("
    assert err.count("\n") == 1 and err.startswith(said) and "softcap=15.0" in err, err


# ---- each output to the precision it is computed in


@pytest.mark.parametrize("dtype, params", [("bf16", torch.float32), ("bf16", torch.bfloat16)])
def test_a_kernel_that_rounds_as_the_reference_passes_in_bf16(interpreted, monkeypatch, dtype, params):
    """No false alarm from the bias test: every launch of a bf16 run, with fp32 or FSDP's bf16
    parameters, on kernels that round as the reference does."""
    on_the_reference(monkeypatch)
    assert selftest.failures(launches(dtype, params), CPU) == {}


@pytest.mark.parametrize(
    "wrongly, op, said",
    [
        ({"norm_scale": 1.005}, "rms_norm", "with gradients: the result is off the reference by +5."),
        ({"norm_grad_scale": 1.005}, "rms_norm", "with gradients: the gradient of x is off the reference by +5."),
        ({"loss_offset": 0.05}, "linear_cross_entropy", "with gradients: result 1 of 2 is off the reference by +6."),
    ],
)
@pytest.mark.parametrize("params", [torch.float32, torch.bfloat16])
def test_a_kernel_slightly_off_is_caught_in_bf16(interpreted, monkeypatch, wrongly, op, said, params):
    """A norm 0.5% off (its bf16 result, or its gradient) and a loss a constant 0.05 nat off: within
    the old 1e-2 of the largest value, each caught by its bias, in QK-norm's launch (bf16 queries)
    or under FSDP (bf16 parameters everywhere). The loss is fp32 but its logits bf16: its bias
    tolerance is bf16's unit roundoff plus 1e-4, 4.0e-3, and 0.05 nat is 6.3e-3 of its ~8 nats (the
    probe's targets drawn from its logits' softmax, its z-loss amplified)."""
    on_the_reference(monkeypatch, **wrongly)
    found = selftest.failures(launches("bf16", params), CPU)
    assert list(found) == [op] and said in found[op] and "(tolerance 4.0e-03)" in found[op], found


def test_a_kernel_slightly_off_is_caught_in_fp32(interpreted, monkeypatch):
    """In fp32 as before: a kernel 0.5% off is beyond 1e-4 of the largest value."""
    real = api.functional.rms_norm
    monkeypatch.setattr(api.functional, "rms_norm", lambda *a: real(*a) * 1.005)
    found = selftest.failures(launches(), CPU)
    assert list(found) == ["rms_norm"] and "the result differs from the reference by 5.0e-03" in found["rms_norm"]


@pytest.mark.parametrize(
    "vocab, cap",
    [(1000, 0.0), (1000, 30.0), *(pytest.param(VOCAB, cap, marks=pytest.mark.slow) for cap in (0.0, 30.0))],
)
def test_a_correct_bf16_computation_is_within_half_the_bias_tolerance(vocab, cap):
    """The reference in bf16 against its float64 oracle, over 10 random probes of each launch of a
    bf16 run (fp32 and FSDP's bf16 parameters, head size 32, uncapped and capped at 30), the probes a
    GPU makes (its rows): its bias, the error's part along the result, stays under half the tolerance
    (a unit roundoff), where a 0.5% scale error is 1.25 times it. (Rounded once from fp32, the norms'
    outputs cannot pass it; the loss and its gradients come from bf16 logits as large as the cap,
    rounded by up to 0.06, and carry up to 0.4 of it.)"""
    worst = {}
    model = ModelConfig(vocab_size=vocab, dim=64, n_heads=2, qk_norm=True, logit_softcap=cap)
    for params in (torch.float32, torch.bfloat16):
        for launch in selfcheck.launches(TrainConfig(dtype="bf16", z_loss=1e-4), model, params):
            for seed in range(10):
                inputs, upstream = selftest.probe_inputs(launch, CPU, seed, gpu=True), []
                ours = selftest.run(launch, inputs, "torch", upstream)
                computed = selftest.as_computed(launch, inputs)
                oracle = selftest.run(dataclasses.replace(launch, autocast=None), computed, "torch", upstream)
                for i, (actual, want) in enumerate(zip(ours, oracle)):
                    tolerance = selftest.bias_tolerance(selftest.precision(launch, actual.dtype))
                    key = f"{launch} output {i}"
                    worst[key] = max(worst.get(key, 0), abs(selftest.errors(actual, want)[1]) / tolerance)
    assert max(worst.values()) < 0.5, max(worst.items(), key=lambda kv: kv[1])


# ---- the run: its backend, its plan, its ranks


def test_fsdp_bf16_parameters_are_probed_in_bf16(interpreted, monkeypatch, capsys):
    """A bf16 run's norms over the hidden size get fp32 activations and weights, but bf16 ones where
    FSDP shards it: the probe gives each run what its model will."""
    on_the_reference(monkeypatch, norm_scale=1.1)
    monkeypatch.setattr(selfcheck.distributed, "share", lambda value, key, d: [value] + ["[]"] * (d.world_size - 1))
    cfg, model = TrainConfig(dtype="bf16", parallel="fsdp"), dataclasses.replace(MODEL, qk_norm=False)
    assert selfcheck.kernel_backend(cfg, lambda: model, CPU, Dist()) == selfcheck.Backend("triton", "auto")
    assert not capsys.readouterr().err
    backend = selfcheck.kernel_backend(cfg, lambda: model, CPU, Dist(world_size=2))
    assert str(backend) == "torch (auto: rms_norm failed its check on rank 0)"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "fastpt: warning: rank 0: kernel rms_norm failed its check on cpu in bf16: "
    ), err


def test_auto_falls_back_to_the_reference_with_one_warning(interpreted, monkeypatch, tiny_data, tmp_path, capsys):
    wrong(monkeypatch, "rms_norm", "wrong")
    args = tiny_args(tiny_data, tmp_path / "auto", max_steps=2, kernels="auto")
    code, out, err = run_main(train.main, args, capsys)
    assert code == 0, err
    warning = "fastpt: warning: kernel rms_norm failed its check on cpu in fp32: rms_norm(x [rows, 128] float32"
    assert err.count("fastpt: warning: kernel ") == 1 and warning in err, err
    assert "; the run uses the PyTorch reference kernels\n" in err
    assert "| kernels torch (auto: rms_norm failed its check) |" in out, out
    # the reference trained it: the same losses as --kernels torch
    reference = tiny_args(tiny_data, tmp_path / "torch", max_steps=2, kernels="torch")
    code, out, _ = run_main(train.main, reference, capsys)
    assert code == 0 and "| kernels torch |" in out
    losses = {name: [r["loss"] for r in read_metrics(tmp_path / name)] for name in ("auto", "torch")}
    assert losses["auto"] == pytest.approx(losses["torch"], rel=1e-6)


def test_micro_batch_auto_plans_for_the_fallback(interpreted, monkeypatch, tiny_data, tmp_path, capsys):
    """The check comes before --micro-batch auto plans, so that the plan is of the kernels in effect:
    after a fallback the reference's loss, which materializes the logits."""
    wrong(monkeypatch, "linear_cross_entropy", "wrong")
    planned = []

    def plan(cfg, *args):
        planned.append(cfg.kernels)
        raise ConfigError("planned")

    monkeypatch.setattr(train.fit, "fit_micro_batch_fsdp", plan)
    code, _, err = run_main(train.main, tiny_args(tiny_data, tmp_path / "run", "--micro-batch", "auto"), capsys)
    assert code == 2 and err.endswith("fastpt: error: planned\n") and planned == ["torch"], (planned, err)
    assert "kernel linear_cross_entropy failed its check" in err


def test_kernels_triton_stops_naming_the_kernel(interpreted, monkeypatch, tiny_data, tmp_path, capsys):
    wrong(monkeypatch, "linear_cross_entropy", "fails")
    code, _, err = run_main(train.main, tiny_args(tiny_data, tmp_path / "run", max_steps=2, kernels="triton"), capsys)
    assert_one_line_error(code, err, "--kernels triton: kernel linear_cross_entropy failed its check", "RuntimeError")
    assert not list((tmp_path / "run").glob("ckpt_*"))


def on_two_ranks(fault: str, tiny_data, tmp_path, **env: str) -> subprocess.CompletedProcess:
    """A 2-step run under torchrun (2 gloo processes, the kernels interpreted) with `fault` on rank 1."""
    args = [*tiny_args(tiny_data, tmp_path / "run", max_steps=2), "--micro-batch", "2"]
    return subprocess.run(
        faults.script_args(fault, 1, *args, nproc=2),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", **env},
        cwd=REPO,
    )


@pytest.mark.slow
def test_ranks_agree_and_a_failing_rank_says_why(tiny_data, tmp_path):
    """Under torchrun (2 gloo processes, the kernels interpreted) only rank 1's RMSNorm is wrong: rank 1
    says why, and both ranks train on the reference (rank 0's summary names the fallback and the rank)."""
    result = on_two_ranks("wrong-kernel-on-rank", tiny_data, tmp_path)
    assert result.returncode == 0, failure_of(result)
    warnings = [line for line in result.stderr.splitlines() if "fastpt: warning: " in line and "kernel" in line]
    assert (
        len(warnings) == 1 and "fastpt: warning: rank 1: kernel rms_norm failed its check on cpu in fp32" in warnings[0]
    )
    assert "| kernels torch (auto: rms_norm failed its check on rank 1) |" in result.stdout, result.stdout
    assert read_metrics(tmp_path / "run")[-1]["step"] == 2


@pytest.mark.slow
def test_a_probe_that_raises_on_one_rank_falls_back_on_every_rank(tiny_data, tmp_path):
    """Under torchrun (2 gloo processes, the kernels interpreted) rank 1's probe raises while it makes
    its inputs (as a GPU out of memory would): rank 1 says so for each kernel, and both ranks train on
    the reference, within the collective timeout. The exception used to end rank 1 before it shared
    its result: torchrun then stopped the run (a rank on another machine waits for that result until
    the timeout)."""
    started = time.monotonic()
    result = on_two_ranks("probe-raises", tiny_data, tmp_path, FASTPT_COLLECTIVE_TIMEOUT="120")
    assert result.returncode == 0, failure_of(result)
    assert time.monotonic() - started < 120  # no rank waited out the collective timeout
    warnings = sorted(line for line in result.stderr.splitlines() if "fastpt: warning: " in line and "kernel" in line)
    assert len(warnings) == 2, warnings
    for warning, kernel in zip(warnings, ("linear_cross_entropy", "rms_norm")):
        assert warning.startswith(
            f"fastpt: warning: rank 1: kernel {kernel} failed its check on cpu in fp32: {kernel}("
        )
        assert "the probe's inputs could not be made: RuntimeError: CUDA out of memory." in warning, warning
    failed = "failed its check on rank 1"
    assert f"| kernels torch (auto: linear_cross_entropy {failed}; rms_norm {failed}) |" in result.stdout, result.stdout
    assert read_metrics(tmp_path / "run")[-1]["step"] == 2
