"""nanochat's optimizer and schedule, as options: its warmdown (wsd's flags), no clipping
(--max-grad-norm 0), Muon's momentum falling across the LR's decay, Muon's weight decay on a cosine
to zero, Polar Express, NorMuon's per-row normalization, cautious weight decay and nanochat's AdamW
settings per group; each changes what it should, the whole set resumes exactly, and a bad value is one
line (DDP and FSDP: tests/test_distributed.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import TINY, assert_resumes_exactly, read_metrics, run_main, tiny_args, train_refuses
from fastpt import train
from fastpt.config import PRESETS, TrainConfig
from fastpt.model import Transformer
from fastpt.muon import Muon, newton_schulz, normalize_rows, polar_express
from fastpt.optim import apply_schedule, lr_schedule, muon_momentum_at, muon_weight_decay_at, optimizers_for

MUON = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, max_steps=1000, warmup_steps=40)


def nanochat_lr_multiplier(it: int, steps: int, warmup: int, warmdown_ratio: float, final: float) -> float:
    """nanochat's LR schedule after warmup, from its description: the peak, then linear over the last
    warmdown_ratio of the steps down to final of it."""
    warmdown = round(warmdown_ratio * steps)
    if it <= steps - warmdown:
        return 1.0
    progress = (steps - it) / warmdown
    return progress + (1 - progress) * final


def test_nanochats_warmdown_is_wsd_over_65_percent_to_5_percent():
    cfg = TrainConfig(schedule="wsd", decay_fraction=0.65, decay_floor=0.05, max_steps=1000, warmup_steps=40)
    for step in range(40, 1001):
        want = 0.02 * nanochat_lr_multiplier(step, 1000, 40, 0.65, 0.05)
        assert lr_schedule(cfg, step, 0.02) == pytest.approx(want, rel=1e-12, abs=1e-15), step
    assert lr_schedule(cfg, 1000, 0.02) == pytest.approx(0.001)


def test_max_grad_norm_0_clips_nothing(tiny_data, tmp_path, capsys):
    """0 trains as a norm no gradient reaches does; a small norm would have changed the run."""
    losses = {}
    for norm in ("0", "1e6", "0.01"):
        args = tiny_args(tiny_data, tmp_path / norm, max_steps=2, log_every=1, eval_every=2, eval_tokens=256)
        assert run_main(train.main, [*args, "--max-grad-norm", norm], capsys)[0] == 0
        losses[norm] = [r["loss"] for r in read_metrics(tmp_path / norm) if "loss" in r]
    assert losses["0"] == losses["1e6"] != losses["0.01"]


def test_muons_momentum_warms_to_097_holds_then_falls_across_the_warmdown():
    """nanochat's: 0.85 to 0.97 over 400 steps, held, then linear to 0.90 across the LR's decay."""
    cfg = dataclasses.replace(
        MUON, schedule="wsd", decay_fraction=0.5, muon_momentum=0.97, muon_momentum_warmup=400, muon_momentum_end=0.9
    )
    for step, want in ((0, 0.85), (200, 0.91), (400, 0.97), (500, 0.97), (750, 0.935), (1000, 0.90)):
        assert muon_momentum_at(cfg, step) == pytest.approx(want, rel=1e-12), step
    assert muon_momentum_at(dataclasses.replace(cfg, muon_momentum_end=0.0), 1000) == 0.97  # off: held
    linear = dataclasses.replace(cfg, schedule="linear")  # decays from the end of warmup
    assert muon_momentum_at(linear, 40 + 480) == pytest.approx(0.935)
    optimizers = optimizers_for(small_model(), cfg)
    apply_schedule(optimizers, cfg, 750)
    assert optimizers[1].param_groups[0]["momentum"] == pytest.approx(0.935)


def test_muons_weight_decay_falls_on_a_cosine_to_zero():
    cfg = dataclasses.replace(MUON, muon_weight_decay=0.2, muon_weight_decay_schedule="cosine")
    for step, want in ((0, 0.2), (250, 0.1 * (1 + math.cos(math.pi / 4))), (500, 0.1), (1000, 0.0)):
        assert muon_weight_decay_at(cfg, step) == pytest.approx(want, abs=1e-15), step
    assert muon_weight_decay_at(dataclasses.replace(cfg, muon_weight_decay_schedule="constant"), 1000) == 0.2
    optimizers = optimizers_for(small_model(), cfg)
    apply_schedule(optimizers, cfg, 500)
    assert optimizers[1].param_groups[0]["weight_decay"] == pytest.approx(0.1)


def small_model(seed: int = 0, **shape) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=97, n_kv_heads=2, **shape))


def singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double())


def test_polar_express_orthogonalizes_closer_than_newton_schulz():
    """Both push every singular value of an ill-conditioned batch toward 1 in five steps; Polar
    Express's per-step quintics land within 0.15 of it (0.87-1.08), Newton-Schulz's fixed one twice
    as far (0.68-1.13)."""
    g = torch.Generator().manual_seed(0)
    u, _, v = torch.linalg.svd(torch.randn(3, 48, 16, generator=g), full_matrices=False)
    spectrum = torch.logspace(0, -2, 16)  # a condition number of 100
    batch = u @ torch.diag_embed(spectrum.expand(3, 16)) @ v
    for x in (batch, batch.mT):  # tall and wide
        polar, ns = (singular_values(f(x)) for f in (polar_express, newton_schulz))
        assert polar.shape == ns.shape == (3, 16)
        assert (polar - 1).abs().max() < 0.15, polar
        assert (ns - 1).abs().max() > 2 * (polar - 1).abs().max(), ns  # what polar-express improves on
    assert not torch.equal(polar_express(batch), newton_schulz(batch))


def test_normuon_equalizes_the_rows_and_keeps_the_norm():
    """First step: every row (a wide matrix's every column) comes out at one RMS, the Frobenius norm
    the orthogonalized update's; the running mean square is one number per row, updated in place."""
    g = torch.Generator().manual_seed(0)
    for shape, side in (((48, 16), -1), ((16, 48), -2)):
        o = torch.randn(shape, generator=g) * torch.logspace(0, 1, shape[0])[:, None]  # rows 1x-10x apart
        o = o * torch.logspace(0, 1, shape[1])  # and columns
        variance = torch.zeros([1 if d == side % 2 else n for d, n in enumerate(shape)])
        out = normalize_rows(o, variance, beta2=0.9)
        rms = out.square().mean(dim=side).sqrt()
        torch.testing.assert_close(rms, rms.mean().expand_as(rms), rtol=1e-5, atol=0)
        torch.testing.assert_close(out.norm(), o.norm())
        torch.testing.assert_close(variance.squeeze(), 0.1 * o.square().mean(dim=side))
    zero = torch.zeros(8, 4)
    assert torch.equal(normalize_rows(zero, torch.zeros(8, 1), 0.9), zero)  # no 0 / 0


def muon_step(weight: torch.Tensor, grad: torch.Tensor, **options) -> tuple[torch.Tensor, Muon]:
    w = torch.nn.Parameter(weight.clone())
    opt = Muon([w], lr=0.1, momentum=0.9, **options)
    w.grad = grad.clone()
    opt.step()
    return w.detach(), opt


@pytest.mark.parametrize(
    "option, state",
    [({"orthogonalize": "polar-express"}, None), ({"normuon_beta2": 0.9}, "row_variance"), ({"cautious": True}, None)],
)
def test_each_muon_option_changes_the_step(option, state):
    g = torch.Generator().manual_seed(0)
    weight, grad = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g) * torch.rand(32, 1, generator=g)
    plain, _ = muon_step(weight, grad, weight_decay=0.5)
    changed, opt = muon_step(weight, grad, weight_decay=0.5, **option)
    assert not torch.equal(plain, changed)
    if state:
        assert opt.state[opt.param_groups[0]["params"][0]][state].shape == (32, 1)


def test_cautious_weight_decay_spares_the_entries_the_update_pushes_away_from_zero():
    """p <- p - lr * wd * p * [o * p >= 0] - lr' * o: where the update o moves p toward zero the decay
    applies as before; elsewhere p keeps it."""
    g = torch.Generator().manual_seed(0)
    weight, grad = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)
    undecayed, _ = muon_step(weight, grad)
    plain, _ = muon_step(weight, grad, weight_decay=0.5)
    cautious, _ = muon_step(weight, grad, weight_decay=0.5, cautious=True)
    update = weight - undecayed  # lr' * o
    agrees = update * weight >= 0
    assert 0 < agrees.sum() < agrees.numel()
    torch.testing.assert_close(cautious[agrees], plain[agrees])
    torch.testing.assert_close(cautious[~agrees], undecayed[~agrees])


def test_nanochats_adamw_groups_take_its_betas_eps_and_decay():
    cfg = dataclasses.replace(MUON, tie_embeddings=False, adamw_groups="nanochat")
    model = small_model(tie_embeddings=False)
    settings = lambda group: (group["betas"], group["weight_decay"], group["eps"])
    groups = {g["name"]: settings(g) for g in optimizers_for(model, cfg)[0].param_groups}
    assert groups["head"] == ((0.8, 0.96), 0.01, 1e-10) and groups["embed"] == ((0.8, 0.995), 0.001, 1e-10)
    assert groups["lr"] == ((0.9, 0.95), 0.0, 1e-8)  # the norms: the config's
    shared = optimizers_for(model, dataclasses.replace(cfg, adamw_groups="shared"))[0].param_groups
    assert {settings(g)[0] for g in shared if g["name"] != "lr"} == {(0.8, 0.95)}


NANOCHAT_OPTIM = (
    "--optimizer",
    "muon",
    "--no-tie-embeddings",
    "--schedule",
    "wsd",
    "--decay-fraction",
    "0.65",
    "--decay-floor",
    "0.05",
    "--max-grad-norm",
    "0",
    "--muon-momentum-warmup",
    "3",
    "--muon-momentum",
    "0.97",
    "--muon-momentum-end",
    "0.9",
    "--muon-weight-decay",
    "0.2",
    "--muon-weight-decay-schedule",
    "cosine",
    "--muon-orthogonalize",
    "polar-express",
    "--normuon",
    "--cautious-weight-decay",
    "--adamw-groups",
    "nanochat",
)


@pytest.mark.parametrize("at", [4, 8])  # 10 steps: the peak at 4, in the warmdown (from step 4) at 8
def test_nanochats_optimizer_resumes_exactly(tiny_data, tmp_path, capsys, at):
    """A fresh folder holding only the checkpoint of step `at` continues as the run went on:
    NorMuon's running mean square is in the checkpoint, the schedules are the step's."""
    assert_resumes_exactly(tiny_data, tmp_path, capsys, NANOCHAT_OPTIM, at)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--muon-orthogonalize", "polar"),
        ("--muon-weight-decay-schedule", "linear"),
        ("--muon-momentum-end", "1.0"),
        ("--adamw-groups", "modded"),
    ],
)
def test_bad_nanochat_optimizer_values_are_one_line(tmp_path, capsys, flag, value):
    train_refuses(capsys, [*TINY, "--out", str(tmp_path), flag, value], f"'{flag[2:].replace('-', '_')}'", value)
