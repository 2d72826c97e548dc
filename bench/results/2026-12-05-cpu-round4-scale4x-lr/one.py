"""One run of the 4x race by bench race's own Race.one (recorded for --reuse): modern at LR 2x,
the full budget, seed 1337."""

from pathlib import Path

from bench import race
from bench.race_flags import recipes

args = race.parse_args(
    [
        "--corpora",
        "default",
        "--recipes",
        "seed,modern",
        "--model",
        "--preset tiny --dim 128 --n-layers 4 --n-heads 4 --ffn-dim 352 --seq-len 128 --micro-batch 16",
        "--budgets",
        "0.25,1",
        "--work",
        "/tmp/w45/sweep4x",
        "--reuse",
    ]
)
_, data = race.corpus("default", args.vocab_size)
r = race.Race(args, data, Path(args.work) / "default")
row = r.one("modern", recipes(args)["modern"], 2.0, r.budgets[-1], 1337)
print(row["run"], row.get("final_val_loss"), row.get("error"), row["process_s"])
