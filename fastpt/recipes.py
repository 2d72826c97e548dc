"""Named training recipes: the TrainConfig values `--recipe NAME` sets at once. They sit above the
defaults, the preset's batch and the CPU profile, below a TOML file and explicit flags
(fastpt.config.resolve), so any one of them can still be changed. `seed` is the seed's own recipe
(the defaults); `modern` is what won the race by its old method (docs/recipes.md; the new one's
results are pending): Muon with nanochat's groups and
momentum warmup, warmup-stable-decay to zero, with the 1 - sqrt cooldown (Hägele et al. 2024) and
QK-norm (Qwen3, OLMo 2), which tie with their alternatives there and stay for the stability the
literature measured at larger scales. Zero-initialized output projections lost the race and are
left out."""

from __future__ import annotations

from typing import Any

RECIPES: dict[str, dict[str, Any]] = {
    "seed": {},
    "modern": {
        "optimizer": "muon",
        "schedule": "wsd",
        "decay_shape": "sqrt",
        "qk_norm": True,
    },
}


def describe(name: str) -> str:
    """What recipe `name` sets, as key=value pairs ('the defaults' for one that sets nothing)."""
    values = RECIPES[name]
    return ", ".join(f"{k}={v}" for k, v in values.items()) if values else "the defaults"
