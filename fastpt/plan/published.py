"""The published runs the step-time plan is checked against: measured training runs of other projects
that fastpt can express, read from published.json (data, beside this module): each run's flags, card
and GPUs, the step its source reports and where, whether a constant of the planner was set from it,
and the step this planner gives it. The band --plan prints (Band) rests on the runs no constant was
fitted to, each configuration once: two runs with the same card, GPUs and flags are one plan, whose
error is against the median of their reported steps. A slow test re-plans every run and fails when a
planned step no longer is the planner's.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

TABLE = Path(__file__).with_name("published.json")


@dataclass(frozen=True)
class Run:
    name: str
    card: str  # --plan-gpu
    gpus: int  # --plan-world-size
    flags: str
    reported_ms: float  # the source's step: tokens per step / its reported tokens per second, or its step time
    source: str  # where the reported step is: a URL, or a repository and path at a commit
    fitted: bool  # a constant of the planner was set from this run: not in the band
    planned_ms: float  # this planner's step for it, as committed

    @property
    def argv(self) -> list[str]:
        return [*self.flags.split(), "--plan-gpu", self.card, "--plan-world-size", str(self.gpus)]

    @property
    def error(self) -> float:
        """planned / reported - 1, the plan's error on this run."""
        return self.planned_ms / self.reported_ms - 1


def load(path: Path = TABLE) -> list[Run]:
    return [Run(**row) for row in json.loads(path.read_text())["runs"]]


def configurations(runs: list[Run]) -> list[list[Run]]:
    """The runs grouped by what the planner sees (card, GPUs, flags): one plan each."""
    groups: dict[tuple[str, ...], list[Run]] = {}
    for run in runs:
        groups.setdefault(tuple(run.argv), []).append(run)
    return list(groups.values())


def config_error(group: list[Run]) -> float:
    """One configuration's error: its plan against the median of its runs' reported steps."""
    return group[0].planned_ms / statistics.median(run.reported_ms for run in group) - 1


@dataclass(frozen=True)
class Band:
    """The median and worst |planned / reported - 1| over the held-out configurations, how many they
    are, and the cards they ran on (--plan-gpu names)."""

    median: float
    worst: float
    configurations: int
    cards: tuple[str, ...]


def band(runs: list[Run]) -> Band:
    held_out = configurations([run for run in runs if not run.fitted])
    errors = [abs(config_error(group)) for group in held_out]
    cards = tuple(sorted({group[0].card for group in held_out}))
    return Band(statistics.median(errors), max(errors), len(held_out), cards)


RUNS = load()
ERROR_BAND = band(RUNS)


def markdown(runs: list[Run]) -> str:
    """The runs as docs/performance.md shows them: one row each, planned beside reported."""
    lines = [
        "| run | card x GPUs | reported step | planned step | planned / reported | source |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        held = "" if not run.fitted else " (fitted: not in the band)"
        lines.append(
            f"| {run.name}{held} | {run.card} x {run.gpus} | {run.reported_ms:,.1f} ms | {run.planned_ms:,.1f} ms "
            f"| {run.planned_ms / run.reported_ms:.2f} | {run.source} |"
        )
    return "\n".join(lines) + "\n"
