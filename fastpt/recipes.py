"""Named training recipes: the TrainConfig values `--recipe NAME` sets at once. They sit above the
defaults, the preset's batch and the CPU profile, below a TOML file and explicit flags
(fastpt.config.resolve), so any one of them can still be changed. `seed` is the seed's own recipe
(the defaults); `modern` gathers what the published small-model recipes run and our race measured:
Muon (nanochat, modded-nanogpt; 0.35x the seed's tokens to its loss in round one), warmup-stable-decay
with the 1 - sqrt cooldown to zero (Hägele et al. 2024), QK-norm (Qwen3, OLMo 2) and zero-initialized
output projections (modded-nanogpt, nanochat)."""

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
