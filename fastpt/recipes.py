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
# nanochat's base-training recipe (karpathy/nanochat: gpt.py, optim.py, scripts/base_train.py), as far as
# fastpt has its parts: the bar `modern` must beat. Its width rule for AdamW's LRs is peak_lrs's; its batch
# and horizon rules need the run's batch and length (nanochat_scaling, which the race applies). Not here:
# its sliding-window layers, MuonEq's row equilibration and Muon+'s renormalization (not asked of this recipe).
RECIPES["nanochat"] = {
    # architecture
    "tie_embeddings": False,
    "rope_theta": 100000.0,
    "mlp": "relu2",
    "logit_softcap": 15.0,
    "parameter_free_norms": True,
    "embed_norm": True,
    "qk_norm_scale": 1.2,
    "layer_scalars": True,
    "backout": True,
    "value_embeds": True,
    "smear": True,
    "init": "nanochat",
    # optimizer: Muon (Polar Express, NorMuon, cautious decay 0.28 falling to 0) beside its AdamW groups
    "optimizer": "muon",
    "muon_momentum": 0.97,
    "muon_momentum_end": 0.9,
    "muon_orthogonalize": "polar-express",
    "normuon": True,
    "cautious_weight_decay": True,
    "muon_weight_decay": 0.28,
    "muon_weight_decay_schedule": "cosine",
    "adamw_groups": "nanochat",
    # schedule: warmup, the peak, then linear over the last 65% to 5% of it; no clipping
    "schedule": "wsd",
    "decay_fraction": 0.65,
    "decay_floor": 0.05,
    "max_grad_norm": 0.0,
}
# nanochat's scaling rules (scripts/base_train.py), from its reference run, depth 12 (dim 768, 12 blocks,
# vocab 32768): tuned at 2**19 tokens a step, trained on 12 tokens per scaling parameter (its block
# matrices, 12 x 12 x 768**2 plus 6 value gates of 12 x 6, and its head, 32768 x 768).
NANOCHAT_B_REF = 2**19
NANOCHAT_D_REF = 12 * (12 * 12 * 768**2 + 6 * 12 * 6 + 32768 * 768)
NANOCHAT_WEIGHT_DECAY = 0.28  # its --weight-decay, Muon's, at the reference


def nanochat_scaling(tokens_per_step: int, run_tokens: int) -> tuple[float, float]:
    """nanochat's rules for a run of `run_tokens` at `tokens_per_step`: (the factor on every LR, Muon's
    weight decay). LRs grow as sqrt(B / B_ref), AdamW's square-root batch rule, which nanochat applies
    to Muon too; the decay is 0.28 x sqrt(B / B_ref) x D_ref / D, which keeps the T_epoch = B / (lr x
    decay x D) of Wang & Aitchison (2024, arXiv:2405.13698) at the reference's."""
    batch = tokens_per_step / NANOCHAT_B_REF
    return batch**0.5, NANOCHAT_WEIGHT_DECAY * batch**0.5 * NANOCHAT_D_REF / run_tokens


# modern plus one candidate each: what `bench race` screens (nanochat's and modded-nanogpt's cap of 15)
CANDIDATES = {"relu2": {"mlp": "relu2"}, "softcap": {"logit_softcap": 15.0}, "unet": {"unet_skips": True}}
RECIPES.update({f"modern-{name}": {**RECIPES["modern"], **values} for name, values in CANDIDATES.items()})


def describe(name: str) -> str:
    """What recipe `name` sets, as key=value pairs ('the defaults' for one that sets nothing)."""
    values = RECIPES[name]
    return ", ".join(f"{k}={v}" for k, v in values.items()) if values else "the defaults"
