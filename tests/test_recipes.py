"""--recipe seed|modern sets its values below a TOML file and flags, and the run's config.toml
reproduces the run; --zero-init and --qk-norm build what they say; the run's first lines name every
recipe choice that differs from the seed's, and the dashboard shows each optimizer group's LR."""

from __future__ import annotations

import dataclasses
import io
import shutil
import sys

import pytest
import torch

from conftest import TINY, read_metrics, run_main, tiny_args, train_refuses
from fastpt import checkpoint, distributed, export, step, train
from fastpt.config import FIELDS, PRESETS, TrainConfig, resolve, to_toml
from fastpt.metrics import Dashboard
from fastpt.model import Transformer
from fastpt.optim import optimizers_for
from fastpt.recipes import RECIPES

MODERN = {
    "optimizer": "muon",
    "muon_momentum": 0.85,
    "schedule": "wsd",
    "decay_shape": "sqrt",
    "qk_norm": True,
    "tie_embeddings": False,
    "decay_rule": "strict",
}


def test_every_recipe_sets_known_keys_and_seed_sets_none():
    assert RECIPES["seed"] == {} and RECIPES["modern"] == MODERN
    for values in RECIPES.values():
        assert set(values) <= set(FIELDS)
        TrainConfig(**values)  # each value of its field's type: validate() below checks the choices
    assert resolve({"recipe": "seed"}, None, "cpu") == resolve({}, None, "cpu")


def test_modern_sets_its_values_and_explicit_flags_or_toml_keys_win(tmp_path):
    cfg = resolve({"recipe": "modern"}, None, "cpu")
    assert {k: getattr(cfg, k) for k in MODERN} == MODERN
    assert cfg.max_steps == 300 and cfg.preset == "tiny"  # the CPU profile still applies below it
    assert resolve({"recipe": "modern", "optimizer": "adamw"}, None, "cpu").optimizer == "adamw"
    (tmp_path / "run.toml").write_text('recipe = "modern"\nschedule = "cosine"\n')
    from_file = resolve({"qk_norm": False}, str(tmp_path / "run.toml"), "cpu")
    assert (from_file.schedule, from_file.qk_norm, from_file.optimizer) == ("cosine", False, "muon")


def test_the_runs_config_toml_names_the_recipe_and_reproduces_the_config(tmp_path):
    cfg = resolve({"recipe": "modern", "lr": 3e-3, "decay_floor": 0.05}, None, "cpu")
    text = to_toml(cfg)
    assert text.splitlines()[0].startswith("# recipe modern: optimizer=muon, muon_momentum=0.85, schedule=wsd")
    (tmp_path / "config.toml").write_text(text)
    assert resolve({}, str(tmp_path / "config.toml"), "cpu") == cfg


def test_an_unknown_recipe_is_one_line_with_a_suggestion(tmp_path, capsys):
    train_refuses(capsys, [*TINY, "--out", str(tmp_path), "--recipe", "modrn"], "'modrn'", "did you mean 'modern'")


def test_help_lists_what_each_recipe_sets(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "modern: optimizer=muon, muon_momentum=0.85, schedule=wsd, decay_shape=sqrt, qk_norm=True, "
        "tie_embeddings=False, decay_rule=strict" in help_text
    )


def test_zero_init_starts_the_output_projections_at_zero_and_a_step_moves_them(tiny_data, tmp_path, capsys):
    cfg = TrainConfig(zero_init=True, seed=3)
    mcfg = dataclasses.replace(PRESETS["tiny"], vocab_size=97)
    net = step.build_model(cfg, mcfg, torch.device("cpu"), distributed.ONE_PROCESS)
    projections = {n: p for n, p in net.raw.named_parameters() if n.endswith(("wo.weight", "w2.weight"))}
    assert len(projections) == 2 * mcfg.n_layers and all(not p.any() for p in projections.values())
    assert all(p.abs().sum() > 0 for n, p in net.raw.named_parameters() if n not in projections)
    plain = step.build_model(TrainConfig(seed=3), mcfg, torch.device("cpu"), distributed.ONE_PROCESS)
    assert all(p.any() for p in plain.raw.parameters())  # the GPT-2 init without the flag
    code, _, err = run_main(train.main, tiny_args(tiny_data, tmp_path, max_steps=2, zero_init=True), capsys)
    assert code == 0, err
    trained, _ = checkpoint.load_model(tmp_path / "ckpt_00000002.pt", torch.device("cpu"))
    assert all(p.any() for n, p in trained.named_parameters() if n in projections)


def test_qk_norm_adds_a_scale_per_head_dim_to_queries_and_keys():
    base = dataclasses.replace(PRESETS["tiny"], vocab_size=97, n_kv_heads=2)
    with_norm = dataclasses.replace(base, qk_norm=True)
    model = Transformer(with_norm)
    assert with_norm.num_params() == model.num_params() == base.num_params() + 2 * base.n_layers * base.head_dim
    assert model.layers[0].attention.q_norm.weight.shape == (base.head_dim,)
    torch.manual_seed(0)
    x = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        model.layers[0].attention.wq.weight.mul_(100.0)  # QK-norm: the queries' scale does not reach the scores
        scaled = model(x).logits
        model.layers[0].attention.wq.weight.div_(100.0)
        torch.testing.assert_close(model(x).logits, scaled, atol=1e-4, rtol=0)


def test_the_summary_names_the_recipe_choices_and_the_dashboard_each_groups_lr(tiny_data, tmp_path, capsys):
    args = tiny_args(tiny_data, tmp_path / "modern", "--recipe", "modern", max_steps=4, warmup_steps=1, log_every=2)
    code, out, err = run_main(train.main, [*args, "--packing", "bos"], capsys)
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("recipe "))
    for choice in ("optimizer muon", "muon_momentum 0.85", "schedule wsd", "decay_shape sqrt", "qk_norm True"):
        assert choice in line, line
    assert "tie_embeddings False" in line and "decay_rule strict" in line and "packing bos" in line
    record = read_metrics(tmp_path / "modern")[0]
    assert {"lr", "lr/muon", "lr/embed", "lr/head"} <= set(record)
    dash = next(line for line in out.splitlines() if line.startswith("Step     2/4 | Loss"))
    assert f"LR: {record['lr']:.2e} embed {record['lr/embed']:.2e} head {record['lr/head']:.2e} " in dash
    assert f"muon {record['lr/muon']:.2e} | Norm" in dash
    code, out, err = run_main(train.main, tiny_args(tiny_data, tmp_path / "seed", max_steps=2), capsys)
    assert code == 0 and "recipe seed | vs the seed's: none" in out, err


def test_a_dashboard_line_without_other_groups_shows_one_lr():
    dash = Dashboard(10, 1, 1, 0.0, None, torch.device("cpu"), False, False)
    record = {"step": 1, "loss": 1.0, "ppl": 2.7, "lr": 5e-4, "grad_norm": 1.0, "peak_mem_gib": 0.5, "tok_s": 1.0}
    assert "| LR: 5.00e-04 | Norm" in dash.line({**record, "mfu": None}, None)
    assert "| LR: 5.00e-04 muon 2.00e-02 | Norm" in dash.line({**record, "mfu": None, "lr/muon": 0.02}, None)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=97))
    assert {g["name"] for o in optimizers_for(model, TrainConfig()) for g in o.param_groups} == {"lr"}


@pytest.fixture(scope="module")
def modern_run(tiny_data, tmp_path_factory):
    """3 steps of --recipe modern (QK-norm) with a muon_lr of its own."""
    run = tmp_path_factory.mktemp("modern") / "run"
    args = tiny_args(tiny_data, run, "--recipe", "modern", max_steps=3, warmup_steps=1, muon_lr=0.01)
    with pytest.MonkeyPatch.context() as m:  # run_main's capsys is per test: catch the output here
        m.setattr(sys, "stdout", io.StringIO())
        assert train.main(args) == 0
    return run


def test_the_export_of_a_modern_run_says_it_is_a_qwen3_and_what_it_wrote(modern_run, tmp_path, capsys):
    code, out, err = run_main(export.main, [str(modern_run), "--out", str(tmp_path / "hf")], capsys)
    assert code == 0, err
    assert out == (
        f"exported {modern_run / 'ckpt_00000003.pt'} to {tmp_path / 'hf'}: Qwen3ForCausalLM (float32): config.json, "
        "generation_config.json, model.safetensors, special_tokens_map.json, tokenizer.json, tokenizer_config.json; "
        "its tokenizer starts every text with <|endoftext|>\n"
    )


@pytest.mark.slow  # four more trainings
def test_resume_takes_the_runs_config_as_its_base_below_config_and_flags(modern_run, tiny_data, tmp_path, capsys):
    run = tmp_path / "modern"
    shutil.copytree(modern_run, run)
    again = ["--device", "cpu", "--data", str(tiny_data), "--out", str(run), "--resume"]
    # No --recipe, preset, seq-len, batch or muon-lr: the run's config.toml gives them.
    code, out, err = run_main(train.main, [*again, "--max-steps", "4"], capsys)
    assert code == 0 and "resumed from" in out and "resume: " not in out, err
    (tmp_path / "more.toml").write_text("max_steps = 5\nmuon_lr = 0.03\n")
    code, out, err = run_main(
        train.main, [*again, "--config", str(tmp_path / "more.toml"), "--muon-lr", "0.02"], capsys
    )
    assert code == 0 and "resume: muon_lr 0.01 -> 0.02 (the config's values apply)" in out, err  # the flag wins
    written = (run / "config.toml").read_text()
    assert 'recipe = "modern"' in written and "max_steps = 5\n" in written and 'preset = "tiny"' in written
    code, out, err = run_main(train.main, again, capsys)
    assert code == 0 and out.index("nothing to do: the run is already at step 5") > out.index("\nrecipe modern"), out
    train_refuses(
        capsys,
        [*again, "--recipe", "seed"],
        "written for another model (tie_embeddings False != True, qk_norm True != False); "
        "resume with --recipe modern (this run says --recipe seed)",
    )
