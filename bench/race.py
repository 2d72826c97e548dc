"""python -m bench race: time to a good model, not tok/s. On one prepared corpus, the seed recipe
against each option and the best combination, with the same model, batch and tokens per step:
the tokens and training wall time each needs to reach the seed's final validation loss, and the
final loss each ends at.

Every run is `python -m fastpt.train` in a process of its own (niced, OMP_NUM_THREADS=--threads on
a CPU), the seed recipe's flags plus a recipe's own. A recipe is a list of fastpt.train flags: add
one in RECIPES, or per run with --recipe NAME="FLAGS". The best combination is every option whose
final loss beat the seed's, together; it also runs with --short x the steps (its whole schedule
compressed), the direct test of "the seed's loss in fewer tokens". Tokens and time to the target
are read at evals (every --eval-every steps), so their resolution is that interval; the time is the
trainer's training time (metrics.jsonl's tok_s windows), evals and checkpoints left out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, fmt, git_commit, markdown_table, versions, write_json

RECIPES: dict[str, list[str]] = {  # name -> the fastpt.train flags it adds to the seed recipe
    "seed": [],
    "wsd": ["--schedule", "wsd"],
    "muon": ["--optimizer", "muon"],
    "document": ["--attention", "document"],
}


def seed_flags(args: argparse.Namespace, data: Path) -> list[str]:
    """What every run shares: the data, model, batch, schedule length and eval cadence."""
    flags = [
        "--data",
        str(data),
        "--preset",
        args.preset,
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--grad-accum",
        str(args.grad_accum),
        "--lr",
        str(args.lr),
        "--warmup-steps",
        str(args.warmup_steps),
        "--eval-every",
        str(args.eval_every),
        "--log-every",
        str(args.eval_every),
        "--eval-tokens",
        str(args.eval_tokens),
        "--ckpt-every",
        str(10**9),
        "--seed",
        str(args.seed),
    ]
    return flags + (["--device", args.device] if args.device else []) + shlex.split(args.train_args)


def run_recipe(
    name: str, flags: list[str], steps: int, args: argparse.Namespace, data: Path, cadence: tuple[str, ...] = ()
) -> dict:
    """One run from scratch in WORK/name; its curve, or the error that stopped it. `cadence`: flags
    after the recipe's (log / eval intervals of a speed run)."""
    out = Path(args.work) / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, not a resumed one
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [
        "nice",
        "-n",
        str(args.nice),
        sys.executable,
        "-m",
        "fastpt.train",
        *seed_flags(args, data),
        "--max-steps",
        str(steps),
        "--out",
        str(out),
        *flags,
        *cadence,
    ]
    print(f"race: {name}: {' '.join(flags) or '(the seed recipe)'} for {steps} steps", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    row = {"recipe": name, "flags": flags, "steps": steps, "process_s": time.perf_counter() - start}
    if proc.returncode != 0:
        return {**row, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return {**row, **curve(out / "metrics.jsonl"), "windows": windows(out / "metrics.jsonl")}


def curve(metrics: Path) -> dict:
    """Evals as (step, tokens, training seconds so far, val_loss), and the mean training tok/s."""
    seconds, tokens, evals, per_step = 0.0, 0, [], 0
    for record in map(json.loads, metrics.read_text().splitlines()):
        if "loss" in record:  # a dashboard window ending at this step: its tokens at its tok/s
            seconds += (record["tokens"] - tokens) / record["tok_s"]
            per_step = record["tokens"] // record["step"]
            tokens = record["tokens"]
        elif "val_loss" in record:  # logged after the window of the same step
            evals.append(
                {
                    "step": record["step"],
                    "tokens": record["step"] * per_step,
                    "seconds": seconds,
                    "val_loss": record["val_loss"],
                }
            )
    return {
        "evals": evals,
        "final_val_loss": evals[-1]["val_loss"],
        "tokens": tokens,
        "train_s": seconds,
        "tok_s": tokens / seconds,
    }


def windows(metrics: Path) -> list[tuple[int, float]]:
    """The dashboard windows as (tokens, seconds)."""
    tokens, out = 0, []
    for record in map(json.loads, metrics.read_text().splitlines()):
        if "loss" in record:
            out.append((record["tokens"] - tokens, (record["tokens"] - tokens) / record["tok_s"]))
            tokens = record["tokens"]
    return out


def speed(chosen: dict[str, list[str]], args: argparse.Namespace, data: Path) -> list[dict]:
    """Each recipe's steady training tok/s: runs of --speed-steps steps, the recipes interleaved over
    --speed-rounds rounds (a shared machine's drifting load falls on all of them alike), the first
    of three dashboard windows (warm-up) left out; the best round counts, as other work on the
    machine only ever slows a run down."""
    runs: dict[str, list[float]] = {name: [] for name in chosen}
    cadence = ("--log-every", str(max(1, args.speed_steps // 3)), "--eval-every", str(10**9))
    for _ in range(args.speed_rounds):
        for name, flags in chosen.items():
            row = run_recipe(f"speed-{name}", flags, args.speed_steps, args, data, cadence)
            if "error" not in row:
                steady = row["windows"][1:]
                runs[name].append(sum(t for t, _ in steady) / sum(s for _, s in steady))
    rows = [
        {"recipe": name, "flags": chosen[name], "tok_s_runs": v, "tok_s": max(v, default=None)}
        for name, v in runs.items()
    ]
    for row in rows:
        row["tok_s_vs_seed"] = row["tok_s"] and rows[0]["tok_s"] and row["tok_s"] / rows[0]["tok_s"]
    return rows


def speed_table(rows: list[dict]) -> str:
    return markdown_table(
        ["recipe", "flags", "train tok/s (best round)", "vs seed", "each round"],
        [
            [
                r["recipe"],
                f"`{' '.join(r['flags'])}`" if r["flags"] else "",
                fmt(r["tok_s"], ",.0f"),
                fmt(r["tok_s_vs_seed"], ".2f") + ("x" if r["tok_s_vs_seed"] else ""),
                ", ".join(f"{v:,.0f}" for v in r["tok_s_runs"]) or "failed",
            ]
            for r in rows
        ],
    )


def reach(row: dict, target: float) -> dict | None:
    """The first eval at or below the target loss, or None."""
    return next((e for e in row.get("evals", []) if e["val_loss"] <= target), None)


def score(rows: list[dict]) -> None:
    """Each row's tokens / time to the seed's final loss, also as a fraction of the seed's."""
    seed = rows[0]
    target = seed["final_val_loss"]
    seed_hit = reach(seed, target)
    for row in rows:
        hit = reach(row, target)
        row["target_val_loss"] = target
        row["tokens_to_target"] = hit and hit["tokens"]
        row["seconds_to_target"] = hit and hit["seconds"]
        row["tokens_vs_seed"] = hit and hit["tokens"] / seed_hit["tokens"]
        row["seconds_vs_seed"] = hit and hit["seconds"] / seed_hit["seconds"]
        row["tok_s_vs_seed"] = row.get("tok_s") and row["tok_s"] / seed["tok_s"]


def best_flags(rows: list[dict]) -> list[str]:
    """Every option whose final loss beat the seed's, their flags together."""
    seed = rows[0]["final_val_loss"]
    return [f for r in rows[1:] if r.get("final_val_loss", float("inf")) < seed for f in r["flags"]]


def table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        if "error" in r:
            body.append(
                [r["recipe"], f"`{' '.join(r['flags'])}`", f"{r['steps']:,}", "failed: " + r["error"], "", "", ""]
            )
            continue
        reached = r["tokens_to_target"] is not None
        body.append(
            [
                r["recipe"],
                f"`{' '.join(r['flags'])}`" if r["flags"] else "",
                f"{r['steps']:,}",
                f"{r['final_val_loss']:.4f}",
                f"{r['tokens_to_target']:,} ({r['tokens_vs_seed']:.2f}x)" if reached else "not reached",
                f"{r['seconds_to_target']:.0f} s ({r['seconds_vs_seed']:.2f}x)" if reached else "–",
                f"{r['tok_s']:,.0f} ({r['tok_s_vs_seed']:.2f}x)",
            ]
        )
    header = [
        "recipe",
        "flags",
        "steps",
        "final val loss",
        "tokens to the seed's final loss",
        "train time to it",
        "train tok/s",
    ]
    return markdown_table(header, body)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench race", description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="", help="prepared data folder (default: fastpt's default corpus, BPE 4096)")
    ap.add_argument(
        "--recipes", default=",".join(RECIPES), help="RECIPES to run, the seed first (default: %(default)s)"
    )
    ap.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="one more option, e.g. --recipe 'bos=--packing bos' (repeatable)",
    )
    ap.add_argument(
        "--steps", type=int, default=400, help="optimizer steps per run; 0 = only the speed runs (default: %(default)s)"
    )
    ap.add_argument(
        "--short",
        type=float,
        default=0.6,
        help="also run the best combination for this fraction of the steps; 0 = not (default: %(default)s)",
    )
    ap.add_argument(
        "--speed-rounds",
        type=int,
        default=0,
        help="first measure each recipe's tok/s in this many interleaved rounds (default: %(default)s)",
    )
    ap.add_argument("--speed-steps", type=int, default=30, help="steps per speed run (default: %(default)s)")
    ap.add_argument("--preset", default="tiny", help="(default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=256, help="(default: %(default)s)")
    ap.add_argument("--micro-batch", type=int, default=16, help="(default: %(default)s)")
    ap.add_argument("--grad-accum", type=int, default=1, help="(default: %(default)s)")
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW peak LR, the seed recipe's (default: %(default)s)")
    ap.add_argument("--warmup-steps", type=int, default=0, help="0 = steps / 20 (default: %(default)s)")
    ap.add_argument("--eval-every", type=int, default=0, help="0 = steps / 20 (default: %(default)s)")
    ap.add_argument("--eval-tokens", type=int, default=16384, help="(default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1337, help="(default: %(default)s)")
    ap.add_argument("--device", default="", help="fastpt.train --device ('' = its default)")
    ap.add_argument(
        "--train-args", default="", help="more fastpt.train flags for every run, e.g. --train-args=--compile"
    )
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (default: %(default)s)")
    ap.add_argument("--nice", type=int, default=10, help="niceness of each run (default: %(default)s)")
    ap.add_argument("--work", default="/tmp/fastpt-race", help="the runs' folders (default: %(default)s)")
    ap.add_argument("--save", default="", help="folder for race.json / race.md (default: print only)")
    args = ap.parse_args(argv)
    length = args.steps or args.speed_steps
    args.warmup_steps = args.warmup_steps or max(1, length // 20)
    args.eval_every = args.eval_every or max(1, length // 20)
    return args


def recipes(args: argparse.Namespace) -> dict[str, list[str]]:
    """The named RECIPES, then the --recipe ones; the seed recipe first."""
    chosen = {}
    for name in args.recipes.split(","):
        if name not in RECIPES:
            raise SystemExit(f"bench race: unknown recipe {name!r} (RECIPES: {', '.join(RECIPES)})")
        chosen[name] = RECIPES[name]
    for spec in args.recipe:
        name, sep, flags = spec.partition("=")
        if not (sep and name):
            raise SystemExit(f"bench race: --recipe {spec!r} is not NAME=FLAGS")
        chosen[name] = shlex.split(flags)
    if next(iter(chosen), None) != "seed":
        raise SystemExit("bench race: the seed recipe runs first (--recipes seed,...)")
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = recipes(args)
    if args.data:
        data = Path(args.data)
    else:
        from fastpt.prepare import default_corpus

        data = default_corpus(4096)
    info = {
        "args": vars(args),
        "data": str(data),
        **versions(),
        "commit": git_commit(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.speed_rounds:
        load_before = os.getloadavg()
        speeds = speed(chosen, args, data)
        md = speed_table(speeds)
        print(md)
        save(
            args.save,
            "speed",
            {"rows": speeds, **info, "loadavg": {"before": load_before, "after": os.getloadavg()}},
            md,
        )
    if not args.steps:
        return 0
    load_before = os.getloadavg()
    rows = [run_recipe(name, flags, args.steps, args, data) for name, flags in chosen.items()]
    if "error" in rows[0]:
        print(f"bench race: the seed recipe failed: {rows[0]['error']}", file=sys.stderr)
        return 1
    best = best_flags(rows)
    same = next((r for r in rows[1:] if r["flags"] == best), None)  # one option alone: its own best combination
    if best and same is None:
        rows.append(run_recipe("best", best, args.steps, args, data))
    if best and args.short:
        rows.append(run_recipe(f"best@{args.short:g}x", best, round(args.short * args.steps), args, data))
    score(rows)
    result = {"rows": rows, "best_flags": best, **info, "loadavg": {"before": load_before, "after": os.getloadavg()}}
    md = table(rows)
    print(md)
    print(
        f"target: the seed's final val loss {rows[0]['final_val_loss']:.4f}; best combination: "
        f"{' '.join(best) or 'none (no option beat the seed)'}; load {fmt(load_before[0], '.1f')} before, "
        f"{fmt(result['loadavg']['after'][0], '.1f')} after"
    )
    save(args.save, "race", result, md)
    return 0


def save(folder: str, name: str, result: dict, md: str) -> None:
    """NAME.json and NAME.md in folder ('' = nowhere)."""
    if folder:
        write_json(Path(folder) / f"{name}.json", result)
        (Path(folder) / f"{name}.md").write_text(md + "\n")
