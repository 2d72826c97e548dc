"""Each recipe of the race beside this file against `--recipe nanochat`, the bar `modern` must beat:
`python vs_nanochat.py` (from the repository root or here; reads race.json from raw.tar.xz beside it).

Per corpus and budget: the recipe's mean final val loss minus nanochat's (negative: lower than
nanochat) and two standard errors of it (bench's race_stats.differences_by_budget), "beats" beyond 2 SE; then
the tokens and the training time each recipe needs to reach nanochat's mean final loss at the full
budget (race_stats.tokens_to_target: linear in log tokens between budgets, at the race's tok/s), as a
fraction of nanochat's own.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for bench
from bench.race_stats import below_range, differences_by_budget, tokens_to_target  # noqa: E402
from bench.results_archive import members  # noqa: E402

HERE = Path(__file__).resolve().parent
BAR = "nanochat"


def versus_bar(row: dict, bar: dict) -> list[str]:
    """'diff ± 2 SE' per budget, smallest first, with 'beats' where row is lower beyond 2 SE."""
    return [
        f"{d:+.3f} ± {two_se:.3f}" + (" beats" if -d > two_se else "") for d, two_se in differences_by_budget(bar, row)
    ]


def to_bar(row: dict, bar: dict, target: float) -> str:
    """Tokens and training time to the bar's full-budget loss, as fractions of the bar's."""
    tokens = tokens_to_target(row["budgets"], target)
    if tokens is None:
        return "not reached"
    bound = "≤ " if below_range(row["budgets"], target) else ""
    bar_tokens = bar["budgets"][-1]["tokens"]
    time_ratio = (tokens / row["speed_tok_s"]) / (bar_tokens / bar["speed_tok_s"])
    return f"{bound}{tokens / bar_tokens:.2f}x its tokens, {bound}{time_ratio:.2f}x its time"


def main() -> None:
    race = json.loads(members(HERE)["race.json"])
    for corpus, result in race["corpora"].items():
        by_name = {row["recipe"]: row for row in result["rows"]}
        bar = by_name[BAR]
        target = bar["budgets"][-1]["mean"]
        fractions = " / ".join(f"{b['fraction']:g}x" for b in bar["budgets"])
        print(f"{corpus}: vs {BAR} at {fractions} of the budget; to {BAR}'s {target:.4f} at the full budget")
        for name, row in by_name.items():
            if name != BAR:
                cells = " / ".join(versus_bar(row, bar))
                print(f"  {name} (LR {row['multiplier']:g}x): {cells}; {to_bar(row, bar, target)}")
        print()


if __name__ == "__main__":
    main()
