"""`python -m bench race`: the time-to-loss table from the runs' metrics, and the command on a tiny budget."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tomllib

from bench import race
from bench.common import REPO


def metrics(path, per_step: int, evals: dict[int, float], tok_s: float) -> None:
    """A metrics.jsonl as fastpt.train writes it: a dashboard window, then the eval of the same step."""
    lines, last = [], 0
    for step, val in evals.items():
        lines.append({"step": step, "loss": val + 0.1, "tokens": step * per_step, "tok_s": tok_s})
        lines.append({"step": step, "val_loss": val})
        last = step
    assert last
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def row(tmp_path, name: str, flags: list[str], evals: dict[int, float], tok_s: float = 1000.0) -> dict:
    metrics(tmp_path / f"{name}.jsonl", 100, evals, tok_s)
    return {"recipe": name, "flags": flags, "steps": max(evals), **race.curve(tmp_path / f"{name}.jsonl")}


def test_tokens_and_time_to_the_seeds_final_loss(tmp_path):
    rows = [
        row(tmp_path, "seed", [], {10: 3.0, 20: 2.6, 30: 2.5}),
        row(tmp_path, "fast", ["--fast"], {10: 2.7, 20: 2.4, 30: 2.2}, tok_s=500.0),
        row(tmp_path, "worse", ["--worse"], {10: 3.1, 20: 2.9, 30: 2.8}),
        {"recipe": "broken", "flags": ["--broken"], "steps": 30, "error": "fastpt: error: nope"},
    ]
    assert rows[0]["train_s"] == pytest.approx(3.0) and rows[0]["tok_s"] == pytest.approx(1000.0)
    race.score(rows)
    seed, fast, worse, broken = rows
    assert (seed["tokens_to_target"], seed["tokens_vs_seed"]) == (3000, 1.0)
    assert (fast["tokens_to_target"], fast["tokens_vs_seed"]) == (2000, pytest.approx(2 / 3))
    assert fast["seconds_to_target"] == pytest.approx(4.0) and fast["tok_s_vs_seed"] == pytest.approx(0.5)
    assert worse["tokens_to_target"] is None and broken["tokens_to_target"] is None
    assert race.best_flags(rows) == ["--fast"]
    table = race.table(rows)
    assert "| fast | `--fast` | 30 | 2.2000 | 2,000 (0.67x) | 4 s (1.33x) | 500 (0.50x) |" in table
    assert "| worse | `--worse` | 30 | 2.8000 | not reached | – |" in table
    assert "| broken | `--broken` | 30 | failed: fastpt: error: nope |" in table


def test_recipes_are_flag_lists_and_the_seed_runs_first():
    args = race.parse_args(["--recipes", "seed,muon", "--recipe", "bos=--packing bos"])
    assert race.recipes(args) == {"seed": [], "muon": ["--optimizer", "muon"], "bos": ["--packing", "bos"]}
    for bad in (["--recipes", "muon,seed"], ["--recipes", "seed,nope"], ["--recipe", "no-flags"]):
        with pytest.raises(SystemExit):
            race.recipes(race.parse_args(bad))


def test_race_cli_on_a_tiny_budget(bench_data, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "race",
            "--data",
            str(bench_data),
            "--steps",
            "4",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--eval-every",
            "2",
            "--eval-tokens",
            "128",
            "--recipes",
            "seed",
            "--recipe",
            "wsd=--schedule wsd --decay-fraction 0.5",
            "--short",
            "0",
            "--work",
            str(tmp_path / "runs"),
            "--save",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "race.json").read_text())
    seed, wsd = result["rows"]
    assert (seed["recipe"], seed["tokens_to_target"], seed["tokens_vs_seed"]) == ("seed", 4 * 2 * 32, 1.0)
    assert [e["step"] for e in wsd["evals"]] == [2, 4] and wsd["tok_s"] > 0
    assert tomllib.loads((tmp_path / "runs" / "wsd" / "config.toml").read_text())["schedule"] == "wsd"
    assert (tmp_path / "out" / "race.md").read_text().startswith("| recipe | flags | steps | final val loss |")
    assert "| seed |  | 4 |" in proc.stdout and "| wsd | `--schedule wsd --decay-fraction 0.5` | 4 |" in proc.stdout


def test_speed_windows_and_table(tmp_path):
    metrics(tmp_path / "m.jsonl", 100, {10: 3.0, 20: 2.9, 30: 2.8}, 1000.0)
    assert race.windows(tmp_path / "m.jsonl") == [(1000, 1.0), (1000, 1.0), (1000, 1.0)]
    rows = [
        {"recipe": "seed", "flags": [], "tok_s_runs": [900.0, 1000.0, 800.0], "tok_s": 1000.0, "tok_s_vs_seed": 1.0},
        {"recipe": "slow", "flags": ["--slow"], "tok_s_runs": [500.0], "tok_s": 500.0, "tok_s_vs_seed": 0.5},
    ]
    table = race.speed_table(rows)
    assert "| seed |  | 1,000 | 1.00x | 900, 1,000, 800 |" in table
    assert "| slow | `--slow` | 500 | 0.50x | 500 |" in table
