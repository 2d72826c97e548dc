"""--recipe nanochat: nanochat's ingredients together (the bar `modern` must beat in the race), its LRs
at nanochat's width rule, and its batch and horizon rules for LRs and Muon's weight decay as the race
applies them."""

from __future__ import annotations

import subprocess

import pytest
from test_recipes import MODERN

from bench.race_flags import RECIPES as RACE
from bench.race_flags import SCALED
from fastpt.config import resolve
from fastpt.optim import peak_lrs
from fastpt.recipes import NANOCHAT_B_REF, NANOCHAT_D_REF, RECIPES, nanochat_scaling


def test_the_nanochat_recipe_is_its_ingredients_and_modern_is_unchanged(tmp_path):
    cfg = resolve({"recipe": "nanochat", "out": str(tmp_path)}, None, "cpu")
    want = {"optimizer": "muon", "init": "nanochat", "schedule": "wsd", "decay_fraction": 0.65, "decay_floor": 0.05}
    want |= {"max_grad_norm": 0.0, "muon_orthogonalize": "polar-express", "normuon": True, "value_embeds": True}
    assert {k: getattr(cfg, k) for k in want} == want
    assert RECIPES["modern"] == MODERN  # the bar's recipe leaves modern as it was
    assert RACE["nanochat"] == ["--recipe", "nanochat"] and SCALED["nanochat"] is nanochat_scaling


@pytest.mark.parametrize("dim", [64, 768])
def test_its_adamw_lrs_are_nanochats_base_training_ones_on_the_width_rule(tmp_path, dim):
    cfg = resolve({"recipe": "nanochat", "out": str(tmp_path)}, None, "cpu")
    width = (dim / 768) ** -0.5
    want = {"lr": cfg.lr, "embed": 0.3 * width, "head": 0.008 * width, "muon": 0.02}
    assert peak_lrs(cfg, dim) == pytest.approx(want)


def test_nanochats_batch_and_horizon_rules():
    """At its reference, its own LRs and decay 0.28; LRs as the root of the batch; the decay as the
    root of the batch over the tokens."""
    assert nanochat_scaling(NANOCHAT_B_REF, NANOCHAT_D_REF) == pytest.approx((1.0, 0.28))
    assert nanochat_scaling(4 * NANOCHAT_B_REF, NANOCHAT_D_REF) == pytest.approx((2.0, 0.56))
    assert nanochat_scaling(NANOCHAT_B_REF, 2 * NANOCHAT_D_REF) == pytest.approx((1.0, 0.14))
    assert NANOCHAT_D_REF == 12 * 110_100_912  # 12 tokens per scaling parameter of its depth-12 model


def test_the_race_runs_nanochat_at_its_rules_for_each_budget(tmp_path, monkeypatch):
    """Each budget's command: every LR the swept multiplier x nanochat's batch factor, Muon's weight
    decay its rule's for that run's tokens (more tokens, less decay)."""
    from bench import race, race_flags

    (tmp_path / "meta.json").write_text('{"vocab_size": 256}')
    cmds = []
    monkeypatch.setattr(
        race.subprocess, "run", lambda cmd, **kw: cmds.append(cmd) or subprocess.CompletedProcess(cmd, 1, "", "stopped")
    )
    args = race.parse_args(["--budgets", "0.5,1", "--work", str(tmp_path / "runs")])
    r = race.Race(args, tmp_path, tmp_path / "runs")
    for budget in r.budgets:
        assert "error" in r.one("nanochat", ["--recipe", "nanochat"], 2.0, budget, 1337)
    cfgs = [race_flags.resolve(cmd[cmd.index("fastpt.train") + 1 :], "") for cmd in cmds]
    scale = (r.tokens_per_step / NANOCHAT_B_REF) ** 0.5
    for cfg, (_, steps) in zip(cfgs, r.budgets, strict=True):
        assert cfg.muon_lr == pytest.approx(0.02 * 2 * scale, rel=1e-5)
        decay = 0.28 * scale * NANOCHAT_D_REF / (steps * r.tokens_per_step)
        assert cfg.muon_weight_decay == pytest.approx(decay, rel=1e-5)
    assert cfgs[0].muon_weight_decay > cfgs[1].muon_weight_decay
