"""The model options beyond the recipes (--mlp relu2, --logit-softcap, --unet-skips, --batch-warmup-steps): what each
computes, its parameters, compile without breaks or recompiles, resume, the plan's cost, and
export's refusal."""

from __future__ import annotations

import dataclasses
import re
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_one_line_error, eager_and_compiled, run_main, tiny_args, train_refuses
from fastpt import checkpoint, checkpointer, export, hf, train
from fastpt.cli import parse_args
from fastpt.config import PRESETS, ModelConfig, TrainConfig
from fastpt.errors import ConfigError
from fastpt.metrics import Dashboard
from fastpt.model import Transformer, unet_wiring
from fastpt.plan import gpus, planner
from fastpt.step import StepResult, TrainState, accum_at, micro_batches

CFG = dataclasses.replace(PRESETS["tiny"], vocab_size=97, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=32)
OPTIONS = {"mlp": "relu2", "logit_softcap": 15.0, "unet_skips": True}
FLAGS = ("--mlp", "relu2", "--logit-softcap", "15", "--unet-skips")


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:].clone()  # (B, T) each; labels of their own, to mask


def test_relu2_is_ffn_dim_wide_in_two_matrices_and_squares_a_relu():
    cfg = dataclasses.replace(CFG, mlp="relu2", ffn_dim=96)
    model = Transformer(cfg)
    assert cfg.num_params() == model.num_params() == CFG.num_params()  # 3/2 of SwiGLU's 64: its parameters
    mlp = model.layers[0].feed_forward
    assert [n for n, _ in mlp.named_parameters()] == ["w1.weight", "w2.weight"] and mlp.w1.weight.shape == (96, 32)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(mlp(x), mlp.w2(torch.relu(mlp.w1(x)) ** 2))
    assert model(batch()[0]).logits.shape == (2, 16, 97)


@pytest.mark.parametrize(
    "flags, hidden",
    [(("--ffn-dim", "3072"), 3072), ((), 3 * 1408 // 2), (("--mlp", "swiglu", "--ffn-dim", "3072"), 3072)],
    ids=["given", "the-presets", "swiglu"],
)
def test_ffn_dim_is_the_mlps_hidden_width_as_given(flags, hidden):
    """--ffn-dim is the hidden width of either MLP; without it relu2 takes 3/2 of the preset's SwiGLU
    width, at SwiGLU's parameters."""
    cfg, target = planner.planned_config(*parse_args(["--preset", "0.04b", "--mlp", "relu2", *flags]))
    m = planner.planned_model(cfg)
    assert m.ffn_dim == hidden
    model_mlp = Transformer(dataclasses.replace(m, vocab_size=8, n_layers=1)).layers[0].feed_forward
    assert model_mlp.w1.weight.shape[0] == hidden
    if not flags:
        assert m.num_params() == PRESETS["0.04b"].num_params()


def test_an_old_relu2_checkpoint_loads_to_the_same_model(tmp_path):
    """A format-1 checkpoint's relu2 model config (unmarked, the first format) meant 3/2 of ffn_dim wide:
    it loads as that model, its weights as saved; one written now says its format and means ffn_dim."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, mlp="relu2", ffn_dim=96)
    model = Transformer(cfg)
    old = dataclasses.asdict(cfg) | {"ffn_dim": 64}  # format 1: no "format" key
    for folder, saved in (("old", old), ("new", cfg.to_dict())):
        states = {"model": checkpoint.ModelState(model), "train_state": TrainState()}
        checkpointer.Checkpointer(tmp_path / folder, states, {"model_config": saved}).save(1)
        loaded, _ = checkpoint.load_model(checkpoint.latest(tmp_path / folder), torch.device("cpu"))
        assert loaded.cfg == cfg and loaded.layers[0].feed_forward.w1.weight.shape == (96, 32)
        assert all(torch.equal(w, model.state_dict()[k]) for k, w in loaded.state_dict().items())
        assert checkpointer.model_mismatch(saved, cfg.to_dict()) == ""  # a resume takes it as this model
    assert cfg.to_dict()["format"] == 2 and ModelConfig.from_dict(dataclasses.asdict(CFG)) == CFG  # SwiGLU: as ever
    # a run of then that gave --ffn-dim 64 resumes with 96: the refusal names both
    assert checkpointer.model_mismatch(old, dataclasses.replace(cfg, ffn_dim=64).to_dict()) == "ffn_dim 96 != 64"


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


@pytest.mark.parametrize("n_layers", [1, 2, 5, 8])
def test_the_unet_wiring_the_summary_names_is_the_models(n_layers):
    """What a block adds past its own output is the skip weight x the input of the block the summary
    pairs it with (i -> L-1-i, i < L // 2), and nothing for a block it leaves unpaired."""
    model = Transformer(dataclasses.replace(CFG, unet_skips=True, n_layers=n_layers))
    described = {int(j): int(i) for i, j in re.findall(r"(\d+)->(\d+)", unet_wiring(n_layers))}
    if n_layers > 1:
        with torch.no_grad():
            model.skip_weights.copy_(torch.arange(2.0, 2.0 + n_layers // 2))
    seen: dict[str, list] = {"in": [], "out": []}
    for layer in model.layers:
        layer.register_forward_hook(lambda m, args, out: seen["in"].append(args[0]) or seen["out"].append(out[0]))
    model.norm.register_forward_hook(lambda m, args, out: seen["in"].append(args[0]))
    model(batch()[0])
    for k in range(n_layers):
        added = seen["in"][k + 1] - seen["out"][k]
        want = model.skip_weights[described[k]] * seen["in"][described[k]] if k in described else 0 * added
        torch.testing.assert_close(added, want)
    assert len(described) == n_layers // 2 and all(j == n_layers - 1 - i for j, i in described.items())
    if n_layers == 5:
        assert unet_wiring(5).endswith("i < 2: 0->4, 1->3; block 2 unpaired")


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
    sum (not their mean), "mean" their mean over the counted targets."""
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
    """The soft-capped loss is the fused kernel's: a GPU plan never holds the (B*T, V)
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
    code, out, err = run_main(train.main, args, capsys)
    assert code == 0, err
    assert "unet_skips True | U-net skips: block i's input x a learned scalar (from 1) added to block 1-i's" in out
    code, out, err = run_main(train.main, [*args, "--resume", "--max-steps", "3"], capsys)
    assert code == 0 and "resumed from" in out, err
    model, _ = checkpoint.load_model(tmp_path / "run" / "ckpt_00000003.pt", torch.device("cpu"))
    assert {k: getattr(model.cfg, k) for k in OPTIONS} == OPTIONS and model.skip_weights is not None
    code, _, err = run_main(export.main, [str(tmp_path / "run"), "--out", str(tmp_path / "hf")], capsys)
    assert_one_line_error(code, err, "'mlp' = 'relu2'", "no Hugging Face architecture")
    assert not (tmp_path / "hf").exists()


def test_the_batch_warmup_ramps_the_sequences_per_step_in_whole_micro_batches():
    """From batch_warmup_start sequences to micro_batch x grad_accum, each step the whole
    micro-batches within the ramp: from one micro-batch (the default start), or from 24 of 64."""
    cfg = TrainConfig(micro_batch=16, grad_accum=4, batch_warmup_steps=6, batch_warmup_start=16)
    assert [accum_at(cfg, s) for s in range(8)] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert {accum_at(TrainConfig(grad_accum=4), s) for s in range(3)} == {4}
    cfg = TrainConfig(micro_batch=8, grad_accum=8, batch_warmup_steps=4, batch_warmup_start=24)
    assert [accum_at(cfg, s) for s in range(5)] == [3, 4, 5, 6, 8]  # 24, 34, 44, 54 sequences, then 64


def test_a_ramps_totals_are_its_steps_summed_and_cost_no_loop():
    """micro_batches (the summary's tokens, the plan's run time) is the sum of accum_at over the
    steps, without a loop over them: a billion-step ramp is counted at once."""
    for micro, accum, start, ramp, steps in [(16, 4, 16, 6, 9), (8, 8, 24, 4, 4), (3, 7, 5, 13, 20), (1, 5, 1, 1, 3)]:
        cfg = TrainConfig(micro_batch=micro, grad_accum=accum, batch_warmup_steps=ramp, batch_warmup_start=start)
        assert micro_batches(cfg, steps) == sum(accum_at(cfg, s) for s in range(steps))
    big = TrainConfig(micro_batch=4, grad_accum=4, batch_warmup_steps=10**9, batch_warmup_start=4, max_steps=10**9)
    t0 = time.perf_counter()
    total = micro_batches(big, 10**9)
    assert time.perf_counter() - t0 < 0.05
    assert total == 10**9 + 999_999_999  # 1 + floor(3 s / 1e9): 1, 2 and 3 a third of the steps each


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(batch_warmup_steps=2, grad_accum=1), "nothing to ramp; raise grad_accum"),
        (dict(batch_warmup_steps=10**9), "'batch_warmup_steps' (1,000,000,000) is larger than 'max_steps' (10,000)"),
        (dict(batch_warmup_steps=5, batch_warmup_start=8, micro_batch=16), "'batch_warmup_start' = 8 sequences is "),
        (dict(batch_warmup_start=8), "'batch_warmup_start' needs 'batch_warmup_steps'"),
    ],
    ids=["no-accumulation", "past-max-steps", "below-a-micro-batch", "start-alone"],
)
def test_a_batch_warmup_that_cannot_ramp_is_one_line(flags, message, tiny_data, tmp_path, capsys):
    train_refuses(
        capsys, tiny_args(tiny_data, tmp_path / "run", **{"max_steps": 10_000, "grad_accum": 4, **flags}), message
    )
    assert not (tmp_path / "run").exists()


def test_a_batch_warmup_run_counts_its_tokens_and_resumes_to_the_same_weights(tiny_data, tmp_path, capsys):
    """6 steps, checkpointed at 3: resumed from there, the same final weights and tokens as uninterrupted."""
    whole = tmp_path / "whole"
    args = tiny_args(tiny_data, whole, max_steps=6, ckpt_every=3, micro_batch=2, grad_accum=4, batch_warmup_steps=4)
    code, out, err = run_main(train.main, args, capsys)
    assert code == 0, err
    # 2 x 32 x (1+1+2+3+4+4): from one micro-batch of 2 to 8 sequences
    assert "6 steps = 960 tokens (a batch warm-up from 2 to 8 sequences per rank over the first 4)" in out
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
