"""`python -m bench race`: recipes checked before any run, the LR sweep's flags, the best LR, the
noise rule, tokens and time to the target from metrics files, and the command on a tiny budget."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import race
from bench.common import REPO


def metrics(path, per_step: int, evals: dict[int, float], tok_s: float = 1000.0) -> None:
    """A metrics.jsonl as fastpt.train writes it: a dashboard window, then the eval of the same step."""
    lines = []
    for step, val in evals.items():
        lines.append({"step": step, "loss": val + 0.1, "tokens": step * per_step, "tok_s": tok_s})
        lines.append({"step": step, "val_loss": val})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def row(recipe: str, final: float, multiplier: float = 1.0, flags: list[str] | None = None, **more) -> dict:
    return {"recipe": recipe, "recipe_flags": flags or [], "multiplier": multiplier, "final_val_loss": final, **more}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--recipe", "x=--optimizer foo"], "recipe 'x' (--optimizer foo): 'optimizer' = 'foo' is not one of"),
        (["--recipe", "y=--no-such-flag 1"], "recipe 'y' (--no-such-flag 1): command line: unrecognized argument"),
        (["--recipe", "z=--lr abc"], "recipe 'z' (--lr abc): command line: argument --lr: invalid float"),
        (["--recipe", "no-equals-sign"], "--recipe 'no-equals-sign' is not NAME=FLAGS"),
        (["--recipes", "wsd,seed"], "the seed recipe runs first"),
        (["--recipes", "seed,nope"], "unknown recipe 'nope'"),
    ],
)
def test_a_bad_recipe_is_one_line_and_exit_2_before_any_run(argv, says, capsys, tmp_path):
    assert race.main([*argv, "--work", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench race: error: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()  # nothing prepared, nothing run


def test_the_command_exits_2_and_help_shows_the_whole_description(capsys):
    bad = [sys.executable, "-m", "bench", "race", "--recipe", "x=--optimizer foo"]
    proc = subprocess.run(bad, capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "recipe 'x'" in proc.stderr
    with pytest.raises(SystemExit):
        race.parse_args(["--help"])
    assert race.__doc__.strip().splitlines()[-1] in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "groups"),
    [(["--optimizer", "muon"], {"lr", "muon", "head"}), (["--recipe", "modern", "--no-tie-embeddings"], {"embed"})],
)
def test_a_multiplier_scales_every_peak_lr_of_a_muon_recipe(flags, groups):
    args = race.parse_args([])
    base = resolved_lrs(flags, args)
    lr_args, lrs = race.lr_flags(flags, 2.0, args, 1024)
    assert groups <= set(base) and lrs == pytest.approx({k: 2 * v for k, v in base.items()})
    assert resolved_lrs(flags + lr_args, args) == pytest.approx(lrs)  # the flags set exactly those LRs
    assert set(lr_args[::2]) == {race.LR_FLAGS[k] for k in base}


def test_muon_plain_gives_the_embedding_and_head_the_seeds_lr():
    args = race.parse_args(["--recipes", "seed,muon-plain"])
    plain = race.recipes(args)["muon-plain"]
    assert plain[plain.index("--head-lr") + 1] == plain[plain.index("--embed-lr") + 1] == "0.002"  # the CPU seed's
    assert resolved_lrs(plain, args) == {"lr": 0.002, "head": 0.002, "muon": 0.02}


def resolved_lrs(flags: list[str], args) -> dict[str, float]:
    from fastpt.optim import peak_lrs
    from fastpt.presets import model_config

    cfg = race.resolve(race.common_flags(args, race.CHECK_STEPS) + flags, args.device)
    m = model_config(cfg, 1024)
    return peak_lrs(cfg, m.dim, m.tie_embeddings)


def test_the_best_lr_is_the_lowest_final_loss_and_an_edge_is_named():
    runs = [row("seed", 3.1, 0.5), row("seed", 3.0, 1.0), row("seed", 3.05, 2.0), row("seed", 0.0, 4.0, error="nan")]
    best = race.best_run(runs)
    assert best["multiplier"] == 1.0 and not race.at_edge(best, runs[:3])
    runs[2]["final_val_loss"] = 2.9
    assert race.best_run(runs)["multiplier"] == 2.0 and race.at_edge(runs[2], runs[:3])
    assert race.best_run([row("seed", 0.0, error="boom"), row("seed", float("nan")), row("seed", None)]) is None


def test_an_option_within_the_noise_does_not_join_the_best_combination():
    best = {
        "seed": row("seed", 3.00),
        "within": row("within", 2.97, flags=["--within"]),  # beats the seed by 0.03 < noise 0.05
        "wsd": row("wsd", 2.90, flags=["--schedule", "wsd"]),
        "wsd-sqrt": row("wsd-sqrt", 2.92, flags=["--schedule", "wsd", "--decay-shape", "sqrt"]),  # --schedule taken
        "muon": row("muon", 2.80, flags=["--optimizer", "muon"]),
        "modern": row("modern", 2.5, flags=["--recipe", "modern"]),  # a combination itself, never a member
        "failed": None,
    }
    combo = race.best_combination(best, noise=0.05)
    assert combo == {"members": ["muon", "wsd"], "flags": ["--optimizer", "muon", "--schedule", "wsd"]}
    assert race.best_combination(best, noise=0.5)["members"] == []


def test_tokens_and_time_to_the_seeds_best_final_loss(tmp_path):
    metrics(tmp_path / "seed.jsonl", 100, {10: 3.0, 20: 2.6, 30: 2.5}, tok_s=900.0)
    metrics(tmp_path / "fast.jsonl", 100, {10: 2.7, 20: 2.4, 30: 2.2})
    metrics(tmp_path / "worse.jsonl", 100, {10: 3.1, 20: 2.9, 30: 2.8})
    seed = race.curve(tmp_path / "seed.jsonl")
    assert seed["final_val_loss"] == 2.5 and seed["tokens"] == 3000 and seed["tok_s"] == pytest.approx(900.0)
    rows = [{**row(n, 0.0), **race.curve(tmp_path / f"{n}.jsonl")} for n in ("seed", "fast", "worse")]
    result = {"target_val_loss": 2.5, "rows": rows}
    race.score(result, {"seed": 1000.0, "fast": 500.0, "worse": 1000.0})  # the speed rounds', not the runs' tok/s
    seed, fast, worse = rows
    assert (seed["tokens_to_target"], seed["tokens_vs_seed"], seed["seconds_to_target"]) == (3000, 1.0, 3.0)
    assert (fast["tokens_to_target"], fast["tokens_vs_seed"]) == (2000, pytest.approx(2 / 3))
    assert fast["seconds_to_target"] == pytest.approx(4.0) and fast["seconds_vs_seed"] == pytest.approx(4 / 3)
    assert worse["tokens_to_target"] is None and worse["vs_seed_nats"] == pytest.approx(0.3)


def test_race_on_a_tiny_budget(bench_data, tmp_path):
    model = "--preset tiny --dim 32 --n-layers 1 --n-heads 2 --ffn-dim 64 --seq-len 32 --micro-batch 2"
    argv = ["--corpora", str(bench_data), "--model", model, "--tokens-per-param", "0.01", "--multipliers", "0.5,1"]
    argv += ["--recipes", "seed", "--recipe", "wsd=--schedule wsd", "--sweep", "seed", "--speed-rounds", "0"]
    argv += ["--eval-tokens", "128", "--work", str(tmp_path / "runs"), "--save", str(tmp_path / "out")]
    cmd = [sys.executable, "-m", "bench", "race", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "race.json").read_text())
    (r,) = result["corpora"].values()
    assert r["steps"] == -(-r["params"] // 100 // r["tokens_per_step"])  # 0.01 tokens per parameter, rounded up
    runs = [(x["recipe"], x["multiplier"], x["seed"]) for x in r["runs"]]
    best_mult = r["rows"][0]["multiplier"]
    assert runs == [("seed", 0.5, 1337), ("seed", 1.0, 1337), ("wsd", best_mult, 1337), ("seed", best_mult, 1338)]
    assert [x["recipe"] for x in r["rows"]] == ["seed", "wsd"] and r["rows"][0]["tokens_vs_seed"] == 1.0
    assert r["noise"] == pytest.approx(abs(r["seed_finals"][0] - r["seed_finals"][1]))
    md = (tmp_path / "out" / "race.md").read_text()
    for needed in ("Target: the seed's best final val loss", "Budget: ", "load average", "commit", "| wsd |"):
        assert needed in md, needed
    assert (tmp_path / "out" / bench_data.name / f"wsd-x{best_mult:g}" / "metrics.jsonl").is_file()
