"""bench race's report: race.md (each corpus's budgets, target, tokens and time to it, the 2-SE
verdicts, every run; the speed rounds) and the results folder (race.json, each run's metrics)."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

from bench.common import fmt, git_commit, markdown_table, versions
from fastpt.hf import write_json

TIME_GOAL, TOKENS_GOAL = 0.25, 0.15  # --recipe modern's goal, as fractions of the seed's


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if "model name" in line), None)
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def uptime() -> str:
    proc = subprocess.run(["uptime"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def info(args: argparse.Namespace, command: str, before: str, start: float, speed_corpus: str) -> dict:
    """Where and how the race ran: every stored figure carries these."""
    return {
        "command": command,
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


def flags_text(flags: list[str]) -> str:
    return f"`{' '.join(flags)}`" if flags else ""


def lr_text(row: dict) -> str:
    edge = " (at the sweep's edge)" if row.get("lr_at_edge") else ""
    return f"{row['multiplier']:g}x: " + ", ".join(f"{k} {v:.3g}" for k, v in row["lrs"].items()) + edge


def budget_text(b: dict) -> str:
    if b["mean"] is None:
        return "failed"
    return f"{b['mean']:.4f}" + (f" ± {b['sd']:.4f}" if b["sd"] is not None else "") + f" (n={len(b['seeds'])})"


def vs_baseline_text(row: dict, baseline: str) -> str:
    v = row["vs_baseline"]
    if row["recipe"] == baseline:
        return "–"
    se = f" ± {2 * v['se']:.3f}" if v["se"] is not None else " (one seed: no verdict)"
    return f"{-v['diff']:+.3f}{se}" + (" **beats**" if v["beats"] else "")


def ratio_text(value: float | None, x: float | None, spec: str, unit: str = "", bound: bool = False) -> str:
    if value is None:
        return "not reached"
    return ("≤ " if bound else "") + format(value, spec) + unit + (f" ({x:.2f}x)" if x else "")


def results_table(result: dict) -> str:
    fractions = [b["fraction"] for b in result["rows"][0]["budgets"]]
    body = [
        [
            r["recipe"],
            flags_text(r["recipe_flags"]),
            lr_text(r),
            *(budget_text(b) for b in r["budgets"]),
            vs_baseline_text(r, result["baseline"]),
            ratio_text(r["tokens_to_target"], r["tokens_vs_seed"], ",.0f", bound=r["below_range"]),
            ratio_text(r["seconds_to_target"], r["seconds_vs_seed"], ".1f", " s", bound=r["below_range"]),
            fmt(r["speed_tok_s"], ",.0f"),
        ]
        for r in result["rows"]
    ]
    header = [
        "recipe",
        "flags",
        "LR (multiplier: peaks)",
        *(f"final val loss at {f:g}x budget (mean ± sd)" for f in fractions),
        f"vs {result['baseline']} at 1x (± 2 SE)",
        "tokens to target",
        "train time to target",
        "train tok/s",
    ]
    return markdown_table(header, body)


def runs_table(result: dict) -> str:
    body = [
        [
            r["run"],
            f"{r['fraction']:g}",
            str(r["steps"]),
            r.get("error") or f"{r['final_val_loss']:.4f}",
            f"{r['process_s']:.0f} s",
        ]
        for r in result["runs"]
    ]
    return markdown_table(["run", "budget", "steps", "final val loss", "process wall"], body)


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


def goal_lines(result: dict) -> list[str]:
    """What `--recipe modern` reached against its goal (the seed's target in at most 0.4x the tokens
    and 0.6x the training time), and whether it beats `--optimizer muon` alone by the 2-SE rule."""
    rows = {r["recipe"]: r for r in result["rows"]}
    if "modern" not in rows:
        return []
    m = rows["modern"]
    x, t = m["tokens_vs_seed"], m["seconds_vs_seed"]
    met = x is not None and x <= TOKENS_GOAL and t is not None and t <= TIME_GOAL
    lines = [
        "`--recipe modern`: "
        + (f"{x:.2f}x the seed's tokens to the target" if x else "target not reached")
        + (f", {t:.2f}x its training time" if t else "")
        + f" (goal: at most {TOKENS_GOAL}x and {TIME_GOAL}x; {'met' if met else 'not met'})."
    ]
    if "modern_beats_muon" in result:
        verdict = "beats" if result["modern_beats_muon"] else "does not beat"
        lines.append(f"At the full budget `--recipe modern` {verdict} `--optimizer muon` alone by more than 2 SE.")
    return lines


def corpus_heading(name: str, result: dict) -> str:
    return f"## {name} ({result['data']}, vocab {result['vocab']:,})"


def corpus_section(name: str, result: dict) -> str:
    combo, seed, base = result["best"], result["rows"][0]["budgets"][-1], result["baseline"]
    members = " + ".join(combo["members"]) or f"none (no option beat {base} by more than 2 SE)"
    edge = [r["recipe"] for r in result["rows"] if r["lr_at_edge"]]
    lines = [
        corpus_heading(name, result),
        "",
        f"Full budget: {result['tokens']:,} tokens = {result['steps']:,} steps of {result['tokens_per_step']:,} "
        f"tokens ({result['tokens'] / result['params']:.2f} tokens per parameter of the seed's model, "
        f"{result['params']:,} parameters); budgets "
        + ", ".join(f"{b['fraction']:g}x ({b['steps']:,} steps)" for b in result["rows"][0]["budgets"])
        + ".",
        f"Target: the seed's mean final val loss at the full budget, {budget_text(seed)}.",
        f"Best combination of the options on `{base}` (`seed` and `modern` are none): {members}"
        + (f" (`{' '.join(combo['flags'])}`)" if combo["flags"] else "")
        + ".",
        *goal_lines(result),
        *([f"Best LR still at an edge of the widened sweep: {', '.join(edge)}."] if edge else []),
        "",
        results_table(result),
        "",
        "Every run:",
        "",
        runs_table(result),
    ]
    return "\n".join(lines)


def report(result: dict) -> str:
    i = result["info"]
    head = [
        "# Time-to-loss race",
        "",
        f"`{i['command']}`",
        "",
        f"Machine: {i['machine']}. Load (`uptime`): before `{i['uptime_before']}`, after `{i['uptime_after']}`.",
        f"Versions: torch {i['torch']}, Python {i['python']}; commit {i['commit']}; {i['date']}; "
        f"race wall time {i['wall_s'] / 60:.1f} min.",
        f"Model: `{i['model']}`; each run `nice -n {i['nice']}`, OMP_NUM_THREADS={i['threads']}.",
        "",
    ]
    body = [corpus_section(name, r) for name, r in result["corpora"].items()]
    return "\n".join(head) + "\n" + "\n\n".join([*body, speed_section(result)]) + "\n"


def speed_section(result: dict) -> str:
    i = result["info"]
    heading = f"## Speed rounds ({i['speed_corpus']}, {i['speed_rounds']} rounds of {i['speed_steps']} steps)"
    return f"{heading}\n\n{speed_table(result['speed'])}"


def summary(result: dict) -> str:
    """The tables a results folder's README shows: each corpus's recipes and the speed rounds (race.md
    adds the target, the verdicts' prose and every run)."""
    body = [f"{corpus_heading(name, r)}\n\n{results_table(r)}" for name, r in result["corpora"].items()]
    return "\n\n".join([*body, speed_section(result)]) + "\n"


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
