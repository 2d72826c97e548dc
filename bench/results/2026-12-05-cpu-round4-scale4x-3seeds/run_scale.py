"""Trains the 4x scale race's runs two at a time through bench race's own Race.one (the command
race.md's collation reads back with --reuse), and writes the record --reuse needs for the runs a
committed results folder already holds (their metrics.jsonl and process wall, the command rebuilt)."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import race
from bench.race_flags import common_flags, lr_flags, recipes
from bench.results_archive import members

ARGV = sys.argv[1:]
args = race.parse_args(ARGV)
race.check_args(args)
chosen = recipes(args)
_, data = race.corpus("default", args.vocab_size)
r = race.Race(args, data, Path(args.work) / "default")
budgets = dict(r.budgets)  # fraction -> steps
committed = members(Path(__file__).resolve().parents[1] / "2026-12-04-cpu-round4-scale4x")  # its raw.tar.xz
old = {x["run"]: x for x in json.loads(committed["race.json"])["corpora"]["default"]["runs"]}
for tag, row in old.items():
    recipe, mult, fraction, seed = row["recipe"], row["multiplier"], row["fraction"], row["seed"]
    lr_args, _ = lr_flags(chosen[recipe], mult, args, r.vocab)
    given = [*chosen[recipe], *lr_args, "--seed", str(seed)]
    out = r.work / tag
    cmd = ["nice", "-n", str(args.nice), sys.executable, "-m", "fastpt.train", "--data", str(data)]
    cmd += [*common_flags(args, budgets[fraction]), "--out", str(out), *given]
    assert row["flags"] == given, (row["flags"], given)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_bytes(committed[f"default/{tag}/metrics.jsonl"])
    (r.work / f"{tag}.json").write_text(json.dumps({"command": cmd, "process_s": row["process_s"]}))
    print("recorded", tag, flush=True)
todo = [(rec, f, s) for f in (1.0, 0.25) for rec in ("modern", "muon", "seed") for s in (1337, 1338, 1339)]
todo = [t for t in todo if f"{t[0]}-x1-b{t[1]:g}-seed{t[2]}" not in old]
print(len(todo), "runs:", todo, flush=True)
with ThreadPoolExecutor(2) as pool:
    for row in pool.map(lambda t: r.one(t[0], chosen[t[0]], 1.0, (t[1], budgets[t[1]]), t[2]), todo):
        print(row["run"], row.get("final_val_loss"), row.get("error"), row["process_s"], flush=True)
