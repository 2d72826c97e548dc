"""bench race's numbers, pure functions of run results: the best run of a sweep and where to widen
it, a budget's mean and SD over seeds, the tokens to a target loss (interpolated in log tokens), and
the two-standard-error rule for "beats"."""

from __future__ import annotations

import math
import statistics


def ok(r: dict) -> bool:
    return "error" not in r and math.isfinite(r.get("final_val_loss") or math.nan)


def best_run(runs: list[dict]) -> dict | None:
    """The run with the lowest final loss (failed runs, and those with no or a non-finite loss, never)."""
    return min((r for r in runs if ok(r)), key=lambda r: r["final_val_loss"], default=None)


def widened(multipliers: list[float], best: float) -> float | None:
    """The next multiplier past the edge the best one is at (the sweep's own ratio on that side), or
    None when it is inside the sweep (or the sweep is one point)."""
    m = sorted(multipliers)
    if len(m) < 2 or m[0] < best < m[-1]:
        return None
    return best * m[0] / m[1] if best == m[0] else best * m[-1] / m[-2]


def summarize(fraction: float, steps: int, tokens: int, runs: list[dict]) -> dict:
    """One budget of a recipe: its seeds' final losses, their mean and sample SD (None below two)."""
    finals = [r["final_val_loss"] for r in runs if ok(r)]
    return {
        "fraction": fraction,
        "steps": steps,
        "tokens": tokens,
        "mean": statistics.fmean(finals) if finals else None,
        "sd": statistics.stdev(finals) if len(finals) > 1 else None,
        "seeds": [{"seed": r["seed"], "final_val_loss": r["final_val_loss"]} for r in runs if ok(r)],
    }


def tokens_to_target(budgets: list[dict], target: float) -> float | None:
    """The tokens at which the mean final loss reaches the target: linear in log tokens between the
    two budgets around its first crossing; a budget exactly at it, its tokens; the smallest budget's
    when that one already reaches it (an upper bound: see below_range); None when none does."""
    points = sorted((b["tokens"], b["mean"]) for b in budgets if b["mean"] is not None)
    if not points:
        return None
    if points[0][1] <= target:
        return float(points[0][0])
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if l1 <= target:  # l0 > target: the first crossing
            if l1 == target:
                return float(t1)
            return math.exp(math.log(t0) + (l0 - target) / (l0 - l1) * (math.log(t1) - math.log(t0)))
    return None


def below_range(budgets: list[dict], target: float) -> bool:
    """Whether the smallest budget already reaches the target (tokens_to_target is then at most that)."""
    first = min((b for b in budgets if b["mean"] is not None), key=lambda b: b["tokens"], default=None)
    return first is not None and first["mean"] <= target and first["tokens"] < max(b["tokens"] for b in budgets)


def difference(a: dict, b: dict) -> tuple[float, float | None]:
    """b's mean minus a's (positive: a is lower) and the standard error of that difference; None
    when either has fewer than two seeds."""
    na, nb = len(a["seeds"]), len(b["seeds"])
    se = math.sqrt(a["sd"] ** 2 / na + b["sd"] ** 2 / nb) if na > 1 and nb > 1 else None
    return b["mean"] - a["mean"], se


def differences_by_budget(base: dict, row: dict) -> list[tuple[float, float | None]]:
    """Recipe row's mean final loss minus recipe base's at each budget (positive: row is worse), and
    two standard errors of it (None with one seed), in the rows' budget order."""
    out = []
    for theirs, mine in zip(base["budgets"], row["budgets"], strict=True):
        diff, se = difference(theirs, mine)
        out.append((diff, None if se is None else 2 * se))
    return out


def beats(a: dict, b: dict) -> bool:
    """Whether budget summary a's mean final loss is below b's by more than two standard errors of
    the difference (never with fewer than two seeds on either side)."""
    if a["mean"] is None or b["mean"] is None:
        return False
    diff, se = difference(a, b)
    return se is not None and diff > 2 * se
