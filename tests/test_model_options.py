"""The round-4 options (--mlp relu2, --logit-softcap, --unet-skips, --batch-warmup-steps): what each
computes, its parameters, compile without breaks or recompiles, resume, the plan's cost, and
export's refusal."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_one_line_error, eager_and_compiled, run_main, tiny_args, train_refuses
from fastpt import checkpoint, export, hf, train
from fastpt.cli import parse_args
from fastpt.config import PRESETS, TrainConfig
from fastpt.errors import ConfigError
from fastpt.metrics import Dashboard
from fastpt.model import Transformer
from fastpt.plan import gpus, planner
from fastpt.step import StepResult, TrainState, accum_at

CFG = dataclasses.replace(PRESETS["tiny"], vocab_size=97, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=32)
OPTIONS = {"mlp": "relu2", "logit_softcap": 15.0, "unet_skips": True}
FLAGS = ("--mlp", "relu2", "--logit-softcap", "15", "--unet-skips")


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:].clone()  # (B, T) each; labels of their own, to mask


def test_relu2_has_swiglus_parameters_in_two_matrices_and_squares_a_relu():
    cfg = dataclasses.replace(CFG, mlp="relu2")
    model = Transformer(cfg)
    assert cfg.num_params() == model.num_params() == CFG.num_params()  # matched at the same ffn_dim
    mlp = model.layers[0].feed_forward
    assert [n for n, _ in mlp.named_parameters()] == ["w1.weight", "w2.weight"] and mlp.w1.weight.shape == (96, 32)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(mlp(x), mlp.w2(torch.relu(mlp.w1(x)) ** 2))
    assert model(batch()[0]).logits.shape == (2, 16, 97)


def test_softcap_bounds_the_logits_and_the_loss_is_the_capped_logits_cross_entropy():
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(CFG, logit_softcap=2.0), z_loss=1e-2)
    with torch.no_grad():
        model.output_weight.mul_(50.0)  # raw logits far beyond the cap
    x, y = batch()
    y[0, :3] = -100  # not counted
    logits = model(x).logits  # (B, T, V)
    assert logits.abs().max() <= 2.0 and logits.abs().max() > 1.9
    out = model(x, labels=y)
    lse = torch.logsumexp(logits, -1)[y != -100]
    torch.testing.assert_close(out.cross_entropy, F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    torch.testing.assert_close(out.z_loss, 1e-2 * lse.square().mean())
    per_target = model(x, labels=y, reduction="none")
    assert per_target.loss.shape == (32,) and per_target.loss[:3].eq(0).all()
    torch.testing.assert_close(per_target.loss.sum() / 29, out.loss)


def test_unet_skips_add_a_scalar_per_pair_and_at_zero_leave_the_plain_model():
    plain, skipped = Transformer(CFG), Transformer(dataclasses.replace(CFG, unet_skips=True))
    assert skipped.num_params() == plain.num_params() + CFG.n_layers // 2 == skipped.cfg.num_params()
    assert skipped.skip_weights.tolist() == [1.0]  # 3 blocks: block 0's input joins block 2's output
    skipped.load_state_dict(plain.state_dict(), strict=False)
    x = batch()[0]
    assert not torch.allclose(skipped(x).logits, plain(x).logits)
    with torch.no_grad():
        skipped.skip_weights.zero_()
    torch.testing.assert_close(skipped(x).logits, plain(x).logits)


@pytest.mark.parametrize("key", OPTIONS)
def test_each_option_is_refused_by_export_with_one_line_naming_it(key):
    with pytest.raises(ConfigError, match=f"'{key}' = .*no Hugging Face architecture"):
        hf.to_hf_config(dataclasses.replace(CFG, **{key: OPTIONS[key]}), torch.float32, 0, 0)


@pytest.mark.parametrize(
    ("key", "value"),
    [("mlp", "gelu"), ("logit_softcap", -1.0), ("logit_softcap", float("inf")), ("logit_softcap", 1e39)],
)
def test_a_bad_option_value_is_one_line_naming_it(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        dataclasses.replace(CFG, **{key: value}).check()


def test_softcap_honours_every_reduction():
    """The soft-capped loss reduced as asked, its z-loss part alike: "sum" is the per-target losses'
    sum (it was their mean, issue 54), "mean" their mean over the counted targets."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(CFG, logit_softcap=2.0), z_loss=1e-2)
    x, y = batch()
    y[0, :3] = -100
    rows, total, mean = (model(x, labels=y, reduction=r) for r in ("none", "sum", "mean"))
    torch.testing.assert_close(total.loss, rows.loss.sum())
    torch.testing.assert_close(total.z_loss, rows.z_loss.sum())
    torch.testing.assert_close(mean.loss, rows.loss.sum() / 29)
    torch.testing.assert_close(mean.z_loss, rows.z_loss.sum() / 29)


def test_the_soft_cap_costs_a_gpu_plan_nothing():
    """The soft-capped loss is the fused kernel's (issue 54): a GPU plan never holds the (B*T, V)
    logits, capped or not, so its peak and step time are the uncapped run's within 5% (the
    materialized loss added fp32 copies of the logits to the peak and their passes to the step)."""
    small = ("--preset", "tiny", "--vocab-size", "4096", "--micro-batch", "8", "--seq-len", "128")

    def plan(*flags: str) -> planner.Plan:
        cfg, target = planner.planned_config(*parse_args([*small, *flags]))
        return dataclasses.replace(planner.trace(cfg, target, 1), card=gpus.card("h200"))

    plain, capped = plan(), plan("--logit-softcap", "15")
    assert capped.peak.bytes <= 1.05 * plain.peak.bytes, (capped.peak.bytes, plain.peak.bytes)
    assert capped.step_time().seconds <= 1.05 * plain.step_time().seconds


@pytest.mark.slow
def test_every_option_compiles_in_one_graph_without_recompiles():
    """torch.compile(fullgraph=True) of a model with all three, forward and backward on new batches."""
    import torch._dynamo

    model = Transformer(dataclasses.replace(CFG, **OPTIONS), z_loss=1e-4)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            x, y = batch(seed)
            loss = compiled(x, labels=y).loss
            loss.backward()
            torch.testing.assert_close(loss, model(x, labels=y).loss, atol=1e-5, rtol=1e-5)


def test_a_run_with_every_option_resumes_and_refuses_export(tiny_data, tmp_path, capsys):
    args = tiny_args(tiny_data, tmp_path / "run", *FLAGS, max_steps=2, eval_every=2, eval_tokens=64)
    code, _, err = run_main(train.main, args, capsys)
    assert code == 0, err
    code, out, err = run_main(train.main, [*args, "--resume", "--max-steps", "3"], capsys)
    assert code == 0 and "resumed from" in out, err
    model, _ = checkpoint.load_model(tmp_path / "run" / "ckpt_00000003.pt", torch.device("cpu"))
    assert {k: getattr(model.cfg, k) for k in OPTIONS} == OPTIONS and model.skip_weights is not None
    code, _, err = run_main(export.main, [str(tmp_path / "run"), "--out", str(tmp_path / "hf")], capsys)
    assert_one_line_error(code, err, "'mlp' = 'relu2'", "no Hugging Face architecture")
    assert not (tmp_path / "hf").exists()


def test_the_batch_warmup_ramps_the_micro_batches_per_step_from_one_to_grad_accum():
    cfg = TrainConfig(grad_accum=4, batch_warmup_steps=6)
    assert [accum_at(cfg, s) for s in range(8)] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert {accum_at(TrainConfig(grad_accum=4), s) for s in range(3)} == {4}


def test_a_batch_warmup_without_accumulation_is_one_line(tiny_data, tmp_path, capsys):
    args = tiny_args(tiny_data, tmp_path, batch_warmup_steps=2, grad_accum=1)
    train_refuses(capsys, args, "'batch_warmup_steps'", "'grad_accum', which is 1")


def test_a_batch_warmup_run_counts_its_tokens_and_resumes_to_the_same_weights(tiny_data, tmp_path, capsys):
    """6 steps, checkpointed at 3: resumed from there, the same final weights and tokens as uninterrupted."""
    whole = tmp_path / "whole"
    args = tiny_args(tiny_data, whole, max_steps=6, ckpt_every=3, micro_batch=2, grad_accum=4, batch_warmup_steps=4)
    code, out, err = run_main(train.main, args, capsys)
    assert code == 0, err
    assert "6 steps = 960 tokens (a batch warm-up over the first 4)" in out  # 2 x 32 x (1+1+2+3+4+4)
    shutil.copytree(whole, tmp_path / "resumed")
    (tmp_path / "resumed" / "ckpt_00000006.pt").unlink()
    resumed_args = [*args, "--out", str(tmp_path / "resumed"), "--resume"]
    code, out, err = run_main(train.main, resumed_args, capsys)
    assert code == 0 and "resumed from" in out, err
    ends = [checkpoint.load(tmp_path / run / "ckpt_00000006.pt", torch.device("cpu")) for run in ("whole", "resumed")]
    assert ends[0]["train_state"]["tokens_seen"] == 2 * 32 * (1 + 1 + 2 + 3 + 4 + 4)  # accum 1, 1, 2, 3, 4, 4
    assert ends[1]["train_state"]["tokens_seen"] == ends[0]["train_state"]["tokens_seen"]
    for name, w in ends[0]["model"].items():
        assert torch.equal(w, ends[1]["model"][name]), name


def test_a_ramping_windows_speed_and_mfu_count_the_tokens_it_trained():
    """Two steps of a 1 -> 4 micro-batch ramp trained 1 + 2 micro-batches, not two full batches."""
    dash = Dashboard(10, 4 * 64, 1, 6.0, 1e3, torch.device("cpu"), False, False)  # 64 tokens a micro-batch
    state = TrainState()
    state.to(torch.device("cpu"))
    for micro in (1, 2):
        state.count(StepResult(*torch.ones(3), torch.tensor(True), True), 64 * micro)
    record = dash.record(state, 2.0, {"lr": 1e-3}, torch.tensor(1.0), 0.0, 0)
    assert record["tok_s"] == (1 + 2) * 64 / 2.0 and record["mfu"] == pytest.approx(6.0 * 96 / 1e3)
    state.new_window()
    assert state.window_tokens == 0
    older = {k: v for k, v in state.state_dict().items() if k != "window_tokens"}  # a checkpoint before it
    state.load_state_dict({**older, "window_steps": 3})
    assert (state.window_steps, state.window_tokens) == (3, 0)


@pytest.mark.slow
def test_compiled_training_with_every_option_follows_eager_without_recompiles(tiny_data, tmp_path):
    """The loop under --compile with all four: 0 recompiles while the batch ramps, the eager losses."""
    ramp = dict(max_steps=4, log_every=1, micro_batch=2, grad_accum=2, batch_warmup_steps=2)
    _, records, eager = eager_and_compiled(tiny_data, tmp_path, n_layers=3, **OPTIONS, **ramp)
    assert [r["recompiles"] for r in records] == [0, 0, 0, 0]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in eager], rel=1e-4)


def test_each_candidate_recipe_is_modern_with_its_option_and_races_alone_too():
    from bench.race_flags import RECIPES as RACE
    from fastpt.recipes import RECIPES

    assert RECIPES["modern-relu2"] == {**RECIPES["modern"], "mlp": "relu2"}
    assert RECIPES["modern-softcap"] == {**RECIPES["modern"], "logit_softcap": 15.0}
    assert RECIPES["modern-unet"] == {**RECIPES["modern"], "unet_skips": True}
    assert RACE["relu2"] == ["--mlp", "relu2"] and RACE["modern-unet"] == ["--recipe", "modern-unet"]
    assert "--batch-warmup-steps" in RACE["batch-warmup"]
