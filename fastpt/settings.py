"""A setting: a TrainConfig field with its --help line and its allowed values or valid range, which
the command line (fastpt.cli), the TOML check and validate() read from the field's metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Interval:
    """The values a numeric setting accepts; always finite."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return math.isfinite(value) and above and below

    def __str__(self) -> str:
        low, high = (str(int(v)) if math.isfinite(v) and v == int(v) else f"{v:g}" for v in (self.low, self.high))
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {low}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


POSITIVE = Interval(0, low_open=True)
NON_NEGATIVE = Interval(0)
UNIT = Interval(0, 1)
BETA = Interval(0, 1, high_open=True)
SEED = Interval(0, 2**32 - 1)  # what NumPy's seed takes
# --plan-world-size: a plan's cost grows with the ranks (the fake process group splits every
# parameter that many ways; the 1b preset under FSDP took 43 s at 1,024 ranks on a loaded 2-core
# machine, 111 s at 8,192); past 256 a rank's share of the sharded state no longer moves its peak.
PLAN_WORLD = Interval(1, 256)


def setting(
    default: Any, help: str, *, choices: tuple = (), domain: Interval | None = None, recipe: bool = False
) -> Any:
    """A TrainConfig field with its --help line, its allowed values or its valid range; `recipe`:
    a training-recipe choice, which the run's summary names when it differs from the seed's."""
    return field(default=default, metadata={"help": help, "choices": choices, "domain": domain, "recipe": recipe})


def shape(help: str, recipe: bool = False) -> Any:
    return setting(None, help + ", the preset's by default", recipe=recipe)
