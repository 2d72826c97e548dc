"""The ablation's rule over the races beside this file: `python ablation.py` (from the repository root or
here; reads {default,shakespeare}/race.json and core-{default,shakespeare}/race.json from raw.tar.xz
beside it, the second pair adding `modern-core`, modern less both QK-norm and WSD, to the same seed
and modern runs).

Every recipe against `modern`, at every budget: the difference of mean final val losses (the
recipe's minus modern's: positive is worse than modern) and two standard errors of it (bench's own
race_stats.differences_by_budget), and the verdict. A part of modern stays only if modern without it loses
beyond 2 SE on both corpora; an option joins only if modern with it wins beyond 2 SE on both. The
verdict is taken at the full budget (where the race's "beats" is), the smaller budgets printed
beside it to show whether it holds as the budget shrinks.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for bench
from bench.race_stats import differences_by_budget  # noqa: E402
from bench.results_archive import members  # noqa: E402

HERE = Path(__file__).resolve().parent
CORPORA = ("default", "shakespeare")
PARTS = {  # modern less one part: the recipe that leaves it out
    "modern-adamw": "Muon",
    "modern-tied": "the untied embedding (strict decay, its LR)",
    "modern-noqk": "QK-norm",
    "modern-cosine": "WSD with the 1 - sqrt cooldown",
    "modern-core": "QK-norm and WSD both",
}
OPTIONS = {  # modern plus one option
    "modern-relu2": "squared-ReLU MLP",
    "modern-softcap": "logit soft-cap 15",
    "modern-unet": "U-net skips",
    "modern-bw": "batch warm-up (50 steps)",
}


def rows(corpus: str, files: dict[str, bytes]) -> tuple[dict[str, dict], dict]:
    """Every recipe's row of the corpus's two races, and the first race's result (target, tokens)."""
    results = []
    for folder in (corpus, f"core-{corpus}"):
        (result,) = json.loads(files[f"{folder}/race.json"])["corpora"].values()
        results.append(result)
    return {row["recipe"]: row for result in results for row in result["rows"]}, results[0]


def cell(d: float, two_se: float) -> str:
    return f"{d:+.3f} ± {two_se:.3f}"


def main() -> None:
    files = members(HERE)
    races = {c: rows(c, files) for c in CORPORA}
    print(
        "| recipe | what | "
        + " | ".join(f"{c} vs modern at 0.25x / 0.5x / 1x" for c in CORPORA)
        + " | verdict (1x, both corpora) |"
    )
    print("|---|---|" + "---|" * len(CORPORA) + "---|")
    for name, what in {**PARTS, **OPTIONS}.items():
        cells, worse, better = [], [], []
        for c in CORPORA:
            by_name, _ = races[c]
            diffs = differences_by_budget(by_name["modern"], by_name[name])
            cells.append(" / ".join(cell(d, s) for d, s in diffs))
            d, s = diffs[-1]
            worse.append(d > s)
            better.append(-d > s)
        if name in PARTS:
            verdict = "stays (modern without it loses beyond 2 SE on both)" if all(worse) else "does not earn its place"
            what = f"less {what}"
        else:
            verdict = "joins (wins beyond 2 SE on both)" if all(better) else "does not join"
            what = f"plus {what}"
        print(f"| {name} | {what} | " + " | ".join(cells) + f" | {verdict} |")
    print()
    for c in CORPORA:
        by_name, result = races[c]
        seed_tokens = result["tokens"]
        print(f"{c}: target {result['target_val_loss']:.4f}; tokens to target / the seed's full budget:")
        for name, row in by_name.items():
            t = row["tokens_to_target"]
            bound = "≤ " if row.get("below_range") else ""
            print(f"  {name}: {bound}{t / seed_tokens:.2f}x" if t else f"  {name}: not reached")


if __name__ == "__main__":
    main()
