"""A setting: a TrainConfig field with its --help line and its allowed values or valid range, which
the command line (fastpt.cli), the TOML check and validate() read from the field's metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Interval:
    """The values a numeric setting accepts; always finite. `or_off`: 0 too, the setting's "off"."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    or_off: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False  # an int is compared as it is: a 400-digit one overflows a float
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return (above and below) or (self.or_off and value == 0)

    def __str__(self) -> str:
        low, high = (whole(v) if math.isfinite(v) and v == int(v) else f"{v:g}" for v in (self.low, self.high))
        off = "0 (off) or " if self.or_off else ""
        if self.high == math.inf:
            return f"{off}{'>' if self.low_open else '>='} {low}"
        return f"{off}in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def whole(v: float) -> str:
    """A whole bound as Python reads it back: 256, 1_000_000 (a flag takes either)."""
    return f"{int(v):_}" if abs(v) >= 10_000 else str(int(v))


UNIT = Interval(0, 1)
BETA = Interval(0, 1, high_open=True)
SEED = Interval(0, 2**32 - 1)  # what NumPy's seed takes
# --plan-world-size: a plan's cost grows with the ranks (the fake process group splits every
# parameter that many ways; the 1b preset under FSDP took 43 s at 1,024 ranks on a loaded 2-core
# machine, 111 s at 8,192); past 256 a rank's share of the sharded state no longer moves its peak.
PLAN_WORLD = Interval(1, 256)
# Every numeric setting has a finite ceiling: a value past it is a typo (an extra zero, an exponent),
# which unbounded would have overflowed a float (a 400-digit int), fp32 (--muon-lr 1e39 stopped
# a run with a traceback, --logit-softcap 1e39 made every loss NaN) or the machine (--micro-batch
# 10^8 grew past 2 GiB for minutes, deaf to SIGTERM) long before it meant a run.
MAX_STEPS = 10**12  # steps: 30 years of 1 ms steps
STEPS = Interval(0, MAX_STEPS)
COUNT = Interval(1, MAX_STEPS)  # a run's steps, a cadence in steps, a count of checkpoints or skips
THREADS = Interval(0, 2**31 - 1)  # what torch.set_num_threads takes; a run uses at most its cores
# sequences a micro-batch, micro-batches a step: Llama 3 405B's 16M-token batch was 2,048 sequences
BATCH = Interval(1, 2**16)
# A peak LR: AdamW's are ~1e-3, Muon's ~0.02-0.05, the largest published (modded-nanogpt's
# embedding) 0.6; past 10 the first update wrecks any model.
LR = Interval(0, 10, low_open=True)
LR_OR_DEFAULT = Interval(0, 10)  # 0 = the optimizer's own default
DECAY = Interval(0, 10)  # decoupled weight decay: a step shrinks the weights by lr * this
# cap * tanh(logits / cap): Gemma 2's 30, nanochat's 15; below 1 no token can stand out, above 1,000
# no logit is ever capped (and past fp32's 3.4e38 the cap itself overflows).
SOFTCAP = Interval(1, 1000, or_off=True)
# RMSNorm's epsilon guards a division: published models use 1e-6 to 1e-5, and an activation at init
# has a mean square near 4e-4 (std 0.02); past 0.01 the epsilon, not the activations, sets the scale
# (1e300 trained a dead model).
NORM_EPS = Interval(0, 0.01, low_open=True)
# RoPE's base: Llama's 1e4 to Llama 3's 5e5 and long-context models' 1e6-1e7. At 1 or below every
# frequency is a full turn per token or more (no order left); past 1e9 the slowest ones never turn.
ROPE_THETA = Interval(1, 1e9, low_open=True)


def setting(
    default: Any, help: str, *, choices: tuple = (), domain: Interval | None = None, recipe: bool = False
) -> Any:
    """A TrainConfig field with its --help line, its allowed values or its valid range; `recipe`:
    a training-recipe choice, which the run's summary names when it differs from the seed's."""
    return field(default=default, metadata={"help": help, "choices": choices, "domain": domain, "recipe": recipe})


def shape(help: str, recipe: bool = False, domain: Interval | None = None) -> Any:
    return setting(None, help + ", the preset's by default", recipe=recipe, domain=domain)
