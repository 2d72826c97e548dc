"""Named training recipes: the TrainConfig values `--recipe NAME` sets at once. They sit above the
defaults, the preset's batch and the CPU profile, below a TOML file and explicit flags
(fastpt.config.resolve), so any one of them can still be changed. `seed` is the seed's own recipe
(the defaults); `modern`: Muon (momentum 0.85) with nanochat's groups and momentum warmup, an
untied embedding without weight decay, warmup-stable-decay to zero with the 1 - sqrt cooldown
(Hägele et al. 2024), and QK-norm (Qwen3, OLMo 2). In the race (docs/race.md) it reaches the
seed's loss in 0.29x and 0.20x the tokens on two corpora and beats Muon alone on both; at 2x and
4.3x the parameters (3 seeds, the default corpus) in 0.44x and 0.34x, still beating both beyond 2
SE: the win shrinks with the model. The race's
ablation (3 budgets, 3 seeds, both corpora; docs/race.md): without Muon it loses 0.20-0.21 nats
at the full budget, without the untied embedding 0.08-0.12, without QK-norm and WSD together 0.05,
each beyond 2 SE on both corpora; QK-norm or WSD alone is within the noise on at least one.
Zero-initialized output projections lost an earlier race and are left out. `modern-relu2`,
`modern-softcap` and `modern-unet` are modern with one more option each (squared-ReLU MLP, logit
soft-cap 15, U-net skips): candidates, not members. None beat modern in the ablation: U-net, the
soft-cap and a batch warm-up within the noise, squared ReLU worse (+0.04-0.05 nats at the full
budget)."""

from __future__ import annotations

from typing import Any

RECIPES: dict[str, dict[str, Any]] = {
    "seed": {},
    "modern": {
        "optimizer": "muon",
        "muon_momentum": 0.85,
        "schedule": "wsd",
        "decay_shape": "sqrt",
        "qk_norm": True,
        "tie_embeddings": False,
        "decay_rule": "strict",
    },
}
# modern plus one candidate each: what `bench race` screens (nanochat's and modded-nanogpt's cap of 15)
CANDIDATES = {"relu2": {"mlp": "relu2"}, "softcap": {"logit_softcap": 15.0}, "unet": {"unet_skips": True}}
RECIPES.update({f"modern-{name}": {**RECIPES["modern"], **values} for name, values in CANDIDATES.items()})


def describe(name: str) -> str:
    """What recipe `name` sets, as key=value pairs ('the defaults' for one that sets nothing)."""
    values = RECIPES[name]
    return ", ".join(f"{k}={v}" for k, v in values.items()) if values else "the defaults"
