"""`python -m bench race`: flags and recipes checked before any corpus, the LR sweep's flags and its
widening, each budget's schedule fitted to its length, tokens to the target interpolated, the 2-SE
rule, the whole race over stand-in runs (fast) and over real ones on a tiny budget (slow)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import race, race_flags
from bench.__main__ import main as bench_main
from bench.common import REPO


def metrics(path, per_step: int, evals: dict[int, float], tok_s: float = 1000.0) -> None:
    """A metrics.jsonl as fastpt.train writes it: a dashboard window, then the eval of the same step."""
    lines = []
    for step, val in evals.items():
        lines.append({"step": step, "loss": val + 0.1, "tokens": step * per_step, "tok_s": tok_s})
        lines.append({"step": step, "val_loss": val})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--recipe", "x=--optimizer foo"], "recipe 'x' (--optimizer foo): 'optimizer' = 'foo' is not one of"),
        (["--recipe", "y=--no-such-flag 1"], "recipe 'y' (--no-such-flag 1): command line: unrecognized argument"),
        (["--recipe", "z=--lr abc"], "recipe 'z' (--lr abc): command line: argument --lr: invalid float"),
        (["--recipe", "no-equals-sign"], "--recipe 'no-equals-sign' is not NAME=FLAGS"),
        (["--recipes", "wsd,seed"], "the seed recipe runs first"),
        (["--recipes", "seed,nope"], "unknown recipe 'nope'"),
        (["--recipe", "w=--warmup-steps 3"], "recipe 'w' sets --warmup-steps: the race fits it"),
        (["--recipe", "m=--muon-momentum-warmup=50"], "recipe 'm' sets --muon-momentum-warmup"),
        (["--train-args", "--max-steps 5"], "--train-args sets --max-steps"),
        (["--tokens-per-param", "0"], "--tokens-per-param 0: must be a positive number"),
        (["--tokens-per-param", "nan"], "--tokens-per-param nan"),
        (["--tokens-per-param", "x"], "argument --tokens-per-param: invalid float value: 'x'"),
        (["--multipliers", "1,abc"], "--multipliers '1,abc': not a comma-separated list of numbers"),
        (["--corpora", "default", "--multipliers", "1,abc"], "--multipliers '1,abc': not a comma-separated"),
        (["--multipliers", "0,1"], "--multipliers '0,1': every value must be > 0"),
        (["--budgets", "0.25,0.5"], "--budgets '0.25,0.5': fractions of the budget, ascending, ending at 1"),
        (["--budgets", "0.5,0.25,1"], "--budgets '0.5,0.25,1': fractions"),
        (["--budgets", "0.5,2"], "--budgets '0.5,2': every value must be > 0 and <= 1"),
        (["--seeds", "0"], "--seeds 0: must be at least 1"),
        (["--seeds", "two"], "argument --seeds: invalid int value: 'two'"),
        (["--widen", "-1"], "--widen -1: must be at least 0"),
        (["--speed-steps", "0"], "--speed-steps 0: must be at least 1"),
        (["--warmup-fraction", "1"], "--warmup-fraction 1: must be in [0, 1)"),
        (["--multiplier", "muon"], "--multiplier 'muon' is not NAME=M"),
        (["--multiplier", "muon=-1"], "--multiplier muon '-1': every value must be > 0"),
        (["--multiplier", "muon=1,2"], "--multiplier muon '1,2': one number"),
        (["--recipes", "seed", "--multiplier", "muon=2"], "--multiplier names muon: not a recipe of this race"),
        (["--corpora", "default,/no/such/folder"], "--corpora: '/no/such/folder' is not 'default', 'shakespeare'"),
        (["--multipliers", "1,inf"], "--multipliers '1,inf': every value must be > 0 and finite"),
        (["--multiplier", "muon=inf"], "--multiplier muon 'inf': every value must be > 0 and finite"),
        (["--seed", "-1"], "--seed -1: must be in [0, 4294967293] with --seeds 3"),
        (["--seed", "4294967295"], "--seed 4294967295: must be in [0, 4294967293]"),
        (["--budgets", "1e-9,1"], "--budgets 1e-09: "),
        (["--tokens-per-param", "1e-9"], "--tokens-per-param 1e-09: the full budget is"),
        (["--sweep", "seed,nope"], "--sweep: unknown recipe 'nope'"),
        (["--seeds", str(2**40)], f"--seeds {2**40}: more than NumPy's 4294967296 seeds"),
        (["--vocab-size", "100"], "--vocab-size 100: must be in [257, 2097152]"),
        (["--vocab-size", str(10**12)], f"--vocab-size {10**12}: must be in [257, 2097152]"),
        (
            ["--save", "/dev/null/out"],
            "--save '/dev/null/out': cannot write there ('/dev/null' is not a writable folder)",
        ),
        # os.access tells root that /proc and /sys are writable
        (
            ["--save", "/proc/race-out"],
            "--save '/proc/race-out': cannot write there ('/proc' is not a writable folder)",
        ),
        (
            ["--save", "/sys/kernel/out"],
            "--save '/sys/kernel/out': cannot write there ('/sys/kernel' is not a writable",
        ),
    ],
)
def test_a_bad_flag_or_recipe_is_one_line_and_exit_2_before_any_corpus(argv, says, capsys, tmp_path, monkeypatch):
    """The default corpora include shakespeare, whose package is not installed here: a bad value is
    still what the line names, and no corpus is prepared (--corpora default would prepare one)."""
    monkeypatch.setattr(race, "corpus", lambda *a: pytest.fail("a corpus was prepared"))
    assert race.main([*argv, "--work", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench race: error: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()  # nothing prepared, nothing run


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--device", "cuda", "--work", "/tmp/fastpt-race-test"], "--device cuda: torch sees no CUDA device"),
        (["--work", "/dev/null/runs"], "--work '/dev/null/runs': cannot write there ('/dev/null' is not a writable"),
        (["--work", "/proc/runs"], "--work '/proc/runs': cannot write there ('/proc' is not a writable folder)"),
    ],
)
def test_no_gpu_or_an_unwritable_work_folder_is_refused_first(argv, says, capsys, monkeypatch):
    """Flags the parametrized test above cannot give (it sets --work): one line before any corpus."""
    monkeypatch.setattr(race, "corpus", lambda *a: pytest.fail("a corpus was prepared"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert race.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"bench race: error: {says}" + err.removeprefix(f"bench race: error: {says}"), err
    assert err.count("\n") == 1 and not Path("/tmp/fastpt-race-test").exists(), err


def test_the_command_exits_2_and_help_shows_the_whole_description(capsys):
    assert bench_main(["race", "--recipe", "x=--optimizer foo"]) == 2  # what `python -m bench race ...` exits with
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "recipe 'x'" in err
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
    lr_args, lrs = race_flags.lr_flags(flags, 2.0, args, 1024)
    assert groups <= set(base) and lrs == pytest.approx({k: 2 * v for k, v in base.items()})
    assert resolved_lrs(flags + lr_args, args) == pytest.approx(lrs)  # the flags set exactly those LRs
    assert set(lr_args[::2]) == {race_flags.LR_FLAGS[k] for k in base}


def test_muon_plain_gives_the_embedding_and_head_the_seeds_lr():
    args = race.parse_args(["--recipes", "seed,muon-plain"])
    plain = race_flags.recipes(args)["muon-plain"]
    assert plain[plain.index("--head-lr") + 1] == plain[plain.index("--embed-lr") + 1] == "0.002"  # the CPU seed's
    assert resolved_lrs(plain, args) == {"lr": 0.002, "head": 0.002, "muon": 0.02}


def test_relu2_races_at_the_seeds_parameters():
    """The race's model gives SwiGLU's --ffn-dim 176; fastpt takes --ffn-dim as relu2's own width,
    so a relu2 recipe (by flag or by fastpt recipe) races 264 wide: the seed's parameters."""
    from fastpt.presets import model_config

    args = race.parse_args(["--recipes", "seed,modern,relu2,modern-relu2,modern-unet"])
    chosen = race_flags.recipes(args)
    assert chosen["relu2"] == ["--mlp", "relu2", "--ffn-dim", "264"]
    assert chosen["modern-relu2"] == ["--recipe", "modern-relu2", "--ffn-dim", "264"]
    assert chosen["modern-unet"] == ["--recipe", "modern-unet"]
    sizes = {
        name: model_config(race_flags.resolve(race_flags.common_flags(args, 100) + flags, "cpu"), 1024).num_params()
        for name, flags in chosen.items()
    }
    assert sizes["relu2"] == sizes["seed"] and sizes["modern-relu2"] == sizes["modern"]


def resolved_lrs(flags: list[str], args) -> dict[str, float]:
    from fastpt.optim import peak_lrs
    from fastpt.presets import model_config

    cfg = race_flags.resolve(race_flags.common_flags(args, race_flags.CHECK_STEPS) + flags, args.device)
    m = model_config(cfg, 1024)
    return peak_lrs(cfg, m.dim, m.tie_embeddings)


def test_each_budget_runs_with_its_schedule_fitted_to_its_length(tmp_path, monkeypatch):
    """The command each run would execute, parsed by fastpt.train's own parser: its steps are its
    fraction of the full budget's, and its LR warmup, Muon's momentum warmup and WSD's decay the same
    fractions of its own steps; its last eval lands on its last step."""
    from fastpt.config import wsd_decay_steps

    (tmp_path / "meta.json").write_text('{"vocab_size": 256}')
    cmds = []
    monkeypatch.setattr(
        race.subprocess, "run", lambda cmd, **kw: cmds.append(cmd) or subprocess.CompletedProcess(cmd, 1, "", "stopped")
    )
    args = race.parse_args(["--tokens-per-param", "40", "--budgets", "0.25,0.5,1", "--work", str(tmp_path / "runs")])
    r = race.Race(args, tmp_path, tmp_path / "runs")
    assert r.steps == -(-40 * r.params // r.tokens_per_step) and r.steps > 1000
    for budget in r.budgets:
        assert "error" in r.one("modern", ["--recipe", "modern"], 1.0, budget, 1337)  # the stand-in process failed
    cfgs = [race_flags.resolve(cmd[cmd.index("fastpt.train") + 1 :], "") for cmd in cmds]
    steps = [-(-f * r.steps // 1) for f in (0.25, 0.5, 1)]
    assert [c.max_steps for c in cfgs] == steps == [s for _, s in r.budgets]
    assert [c.warmup_steps for c in cfgs] == [round(0.05 * s) for s in steps]
    assert [c.muon_momentum_warmup for c in cfgs] == [round(0.1 * s) for s in steps]
    assert [wsd_decay_steps(c) for c in cfgs] == [round(0.2 * s) for s in steps]
    assert all(
        c.schedule == "wsd" and c.optimizer == "muon" and c.max_steps % c.eval_every < c.eval_every for c in cfgs
    )


def test_tokens_to_the_target_are_interpolated_in_log_tokens():
    from bench.race_stats import below_range, tokens_to_target

    budgets = [{"tokens": t, "mean": m} for t, m in ((1000, 3.0), (2000, 2.5), (4000, 2.0))]
    assert tokens_to_target(budgets, 2.25) == pytest.approx(2000 * 2**0.5)  # half-way in loss: the geometric mean
    assert tokens_to_target(budgets, 2.75) == pytest.approx(1000 * 2**0.5)
    assert tokens_to_target(budgets, 2.5) == 2000.0 and tokens_to_target(budgets, 2.0) == 4000.0  # exactly at a budget
    assert tokens_to_target(budgets, 1.99) is None  # not reached
    assert tokens_to_target(budgets, 3.1) == 1000.0 and below_range(budgets, 3.1)  # at most the smallest budget
    assert not below_range(budgets, 2.25)
    bumpy = [{"tokens": 1000, "mean": 3.0}, {"tokens": 2000, "mean": None}, {"tokens": 4000, "mean": 2.0}]
    assert tokens_to_target(bumpy, 2.5) == pytest.approx(2000.0)  # a failed budget is skipped
    up_down = [{"tokens": 1000, "mean": 3.0}, {"tokens": 2000, "mean": 2.0}, {"tokens": 4000, "mean": 2.8}]
    assert tokens_to_target(up_down, 2.5) == pytest.approx(1000 * 2**0.5)  # the first crossing


def summary(mean: float, sd: float | None, n: int) -> dict:
    return {"mean": mean, "sd": sd, "seeds": [{}] * n}


def test_an_option_beats_another_only_by_more_than_two_standard_errors():
    from bench.race_stats import beats, difference, summarize

    assert beats(summary(2.9, 0.05, 3), summary(3.0, 0.05, 3))  # 2 SE = 0.082 < 0.1
    assert not beats(summary(2.9, 0.08, 3), summary(3.0, 0.08, 3))  # 2 SE = 0.131 > 0.1
    assert not beats(summary(3.0, 0.05, 3), summary(2.9, 0.05, 3))  # worse is never better
    assert not beats(summary(2.0, None, 1), summary(3.0, 0.05, 3))  # one seed: no verdict
    assert difference(summary(2.9, 0.03, 2), summary(3.0, 0.04, 2)) == pytest.approx(
        (0.1, ((0.03**2 + 0.04**2) / 2) ** 0.5)
    )
    runs = [{"seed": s, "final_val_loss": v} for s, v in ((1, 3.0), (2, 3.2), (3, 3.4))] + [{"seed": 4, "error": "nan"}]
    b = summarize(1.0, 10, 1000, runs)
    assert (b["mean"], b["sd"], len(b["seeds"])) == (pytest.approx(3.2), pytest.approx(0.2), 3)


def test_a_sweep_widens_past_the_edge_its_best_is_at():
    from bench.race_stats import best_run, widened

    assert widened([0.5, 1, 2], 2) == 4 and widened([0.5, 1, 2], 0.5) == 0.25 and widened([1, 3], 3) == 9
    assert widened([0.5, 1, 2], 1) is None and widened([1], 1) is None
    runs = [{"multiplier": m, "final_val_loss": v} for m, v in ((0.5, 3.1), (1, 3.0), (2, float("nan")))]
    assert best_run(runs + [{"multiplier": 4, "error": "boom"}])["multiplier"] == 1


def stand_in(name, flags, steps, args, data, out, reuse=False) -> dict:
    """One fastpt.train run, stood in for: the final loss falls with the tokens, is lowest at 4x the
    seed's LR (Muon: 2x, and 30% less above 3 nats), a seed moves it by -0.01, 0 or +0.01; Muon
    trains at half the seed's tok/s (the speed rounds give no --lr or --seed: the seed's)."""
    given = {f: flags[i + 1] for i, f in enumerate(flags[:-1]) if f.startswith("--")}
    lr, seed, muon = float(given.get("--lr", 0.002)), int(given.get("--seed", 1337)), "muon" in flags
    tokens = steps * 2048
    loss = 3 + 20 * tokens**-0.3 * (0.7 if muon else 1) + 0.05 * math.log2(lr / (0.002 * (2 if muon else 4))) ** 2
    loss += 0.01 * (seed % 3 - 1)
    evals = [{"step": steps, "tokens": tokens, "val_loss": loss}]
    row = {"evals": evals, "final_val_loss": loss, "tokens": tokens, "tok_s": 500.0 if muon else 1000.0}
    return {"run": name, "flags": flags, "steps": steps, "process_s": 0.0, **row}


def test_the_race_over_stand_in_runs(tmp_path, monkeypatch, capsys):
    """The whole method, each fastpt.train run stood in for (fast): the sweep widens to the seed's
    best LR, every budget runs at three seeds there, the target is the seed's mean at the full budget,
    and Muon's tokens and time to it come from its budgets and its speed."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text('{"vocab_size": 256}')
    monkeypatch.setattr(race, "run", stand_in)
    argv = ["--corpora", str(tmp_path / "data"), "--recipes", "seed,muon", "--speed-rounds", "1"]
    assert race.main([*argv, "--work", str(tmp_path / "runs"), "--save", str(tmp_path / "out")]) == 0
    (r,) = json.loads((tmp_path / "out" / "race.json").read_text())["corpora"].values()
    seed, muon = r["rows"]
    sweep = [x["multiplier"] for x in r["runs"] if x["recipe"] == "seed" and x["fraction"] == 1 and x["seed"] == 1337]
    assert sweep == [0.5, 1, 2, 4, 8] and seed["multiplier"] == 4 and not seed["lr_at_edge"]
    assert muon["multiplier"] == 2 and len([x for x in r["runs"] if x["recipe"] == "muon"]) == 4 + 3 * 3 - 1
    for row in (seed, muon):
        assert [b["fraction"] for b in row["budgets"]] == [0.25, 0.5, 1] and all(
            len(b["seeds"]) == 3 for b in row["budgets"]
        )
        assert [b["tokens"] for b in row["budgets"]] == [b["steps"] * r["tokens_per_step"] for b in row["budgets"]]
        assert all(b["sd"] == pytest.approx(0.01) for b in row["budgets"])
    assert r["target_val_loss"] == seed["budgets"][-1]["mean"] and seed["tokens_to_target"] == r["tokens"]
    quarter, half = (b["tokens"] for b in muon["budgets"][:2])
    assert quarter < muon["tokens_to_target"] < half and muon["vs_baseline"]["beats"]
    assert r["best"]["members"] == ["muon"]
    assert muon["seconds_vs_seed"] == pytest.approx(2 * muon["tokens_vs_seed"])  # half the seed's tok/s
    given = ["--multiplier", "seed=2", "--multiplier", "muon=1", "--work", str(tmp_path / "given")]
    assert race.main([*argv, *given, "--save", str(tmp_path / "given-out")]) == 0
    (g,) = json.loads((tmp_path / "given-out" / "race.json").read_text())["corpora"].values()
    assert {(x["recipe"], x["multiplier"]) for x in g["runs"]} == {("seed", 2), ("muon", 1)}  # no sweep
    assert len(g["runs"]) == 2 * 3 * 3 and not any(row["lr_at_edge"] for row in g["rows"])
    md = (tmp_path / "out" / "race.md").read_text()
    for needed in (
        "Target: the seed's mean final val loss at the full budget",
        "at 0.25x budget",
        "**beats**",
        "(n=3)",
    ):
        assert needed in md, needed


def test_an_ablation_combines_what_beats_its_baseline_on_the_baselines_flags():
    """--baseline modern: the options beating modern by 2 SE join it by their own flags (those after
    modern's, or what a `modern-*` recipe adds to modern: `--recipe modern-unet` is `--unet-skips`);
    one whose own flags clash (another recipe, or a flag a better one set) stays out, as do worse
    ones. On the seed's baseline, the same rows give what beat the seed."""

    def row(name: str, flags: str, mean: float) -> dict:
        seeds = [{"seed": s, "final_val_loss": mean + d} for s, d in ((1, -0.01), (2, 0.0), (3, 0.01))]
        return {"recipe": name, "recipe_flags": flags.split(), "budgets": [{"mean": mean, "sd": 0.01, "seeds": seeds}]}

    rows = {
        "seed": row("seed", "", 4.2),
        "modern": row("modern", "--recipe modern", 3.6),
        "other": row("other", "--recipe seed --qk-norm", 3.3),
        **{n: row(n, " ".join(race_flags.RECIPES[n]), m) for n, m in (("modern-unet", 3.4), ("modern-softcap", 3.55))},
        "mu": row("mu", "--recipe modern --unet-skips", 3.5),
        "modern-relu2": row("modern-relu2", "--recipe modern-relu2", 3.7),
    }
    on_modern = race.best_combination(rows, "modern")
    assert on_modern == {
        "members": ["modern-unet", "modern-softcap"],
        "flags": "--recipe modern --unet-skips --logit-softcap 15".split(),
    }
    assert race.best_combination(rows) == {"members": ["other"], "flags": "--recipe seed --qk-norm".split()}


def test_modern_candidates_run_at_moderns_lr(tmp_path, monkeypatch):
    """Not swept, `modern-unet` runs at the multiplier modern's sweep chose (not the seed's)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text('{"vocab_size": 256}')
    monkeypatch.setattr(race, "run", stand_in)
    argv = ["--corpora", str(tmp_path / "data"), "--recipes", "seed,modern,modern-unet", "--speed-rounds", "1"]
    argv += ["--multiplier", "seed=4", "--multiplier", "modern=2", "--baseline", "modern"]
    assert race.main([*argv, "--work", str(tmp_path / "w"), "--save", str(tmp_path / "out")]) == 0
    (r,) = json.loads((tmp_path / "out" / "race.json").read_text())["corpora"].values()
    assert {row["recipe"]: row["multiplier"] for row in r["rows"]} == {"seed": 4, "modern": 2, "modern-unet": 2}


def test_the_baseline_is_every_rows_comparison(tmp_path, monkeypatch, capsys):
    """--baseline muon: each row's difference is against Muon's full budget (the seed loses to it), the
    table says so, the target stays the seed's; a baseline not in the race is refused first."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text('{"vocab_size": 256}')
    monkeypatch.setattr(race, "run", stand_in)
    argv = ["--corpora", str(tmp_path / "data"), "--recipes", "seed,muon", "--speed-rounds", "1"]
    argv += ["--multiplier", "seed=4", "--multiplier", "muon=2", "--work", str(tmp_path / "w")]
    assert race.main([*argv, "--baseline", "muon", "--save", str(tmp_path / "out")]) == 0
    (r,) = json.loads((tmp_path / "out" / "race.json").read_text())["corpora"].values()
    seed, muon = r["rows"]
    assert r["baseline"] == "muon" and r["target_val_loss"] == seed["budgets"][-1]["mean"]
    assert seed["vs_baseline"]["diff"] == pytest.approx(muon["budgets"][-1]["mean"] - seed["budgets"][-1]["mean"])
    assert seed["vs_baseline"]["diff"] < 0 and not seed["vs_baseline"]["beats"] and muon["vs_baseline"]["diff"] == 0
    md = (tmp_path / "out" / "race.md").read_text()
    assert "vs muon at 1x (± 2 SE)" in md and "none (no option beat muon by more than 2 SE)" in md
    capsys.readouterr()
    assert race.main([*argv, "--baseline", "modern"]) == 2
    assert "--baseline 'modern': not a recipe of this race (seed, muon)" in capsys.readouterr().err


def test_jobs_trains_runs_at_once_and_records_them_as_one_at_a_time_would(tmp_path, monkeypatch):
    """--jobs 2: two runs in flight at a time (never more), and the same runs, in the same order,
    with the same results as --jobs 1."""
    lock, flying, most = threading.Lock(), [0], [0]

    def slow_stand_in(*given, **kwargs) -> dict:
        with lock:
            flying[0] += 1
            most[0] = max(most[0], flying[0])
        time.sleep(0.05)
        with lock:
            flying[0] -= 1
        return stand_in(*given)

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text('{"vocab_size": 256}')
    monkeypatch.setattr(race, "run", slow_stand_in)
    argv = ["--corpora", str(tmp_path / "data"), "--recipes", "seed,muon", "--speed-rounds", "0"]
    results = {}
    for jobs in (1, 2):
        most[0] = 0
        out = tmp_path / f"out{jobs}"
        assert race.main([*argv, "--jobs", str(jobs), "--work", str(tmp_path / f"w{jobs}"), "--save", str(out)]) == 0
        assert most[0] == jobs
        (results[jobs],) = json.loads((out / "race.json").read_text())["corpora"].values()
    assert results[1]["runs"] == results[2]["runs"] and results[1]["rows"] == results[2]["rows"]
    assert race.main([*argv, "--jobs", "0"]) == 2


@pytest.mark.parametrize("code", [-9, 143])
def test_a_killed_run_fails_the_race_naming_it_and_a_diverged_one_is_a_failed_lr(code, tmp_path, monkeypatch, capsys):
    """--jobs 2: a run a signal killed (-9) or stopped (fastpt.train's 143 after a SIGTERM) is no
    verdict on its LR: the race exits 1 naming it (recipe, LR, budget, seed). A run that failed on
    its own (exit 1, a non-finite loss) is a failed LR, as before: the race goes on to its result."""

    def train(cmd, **kwargs):
        if "fastpt.train" not in cmd:  # the race's own `uptime`
            return run(cmd, **kwargs)
        out, lr = Path(cmd[cmd.index("--out") + 1]), float(cmd[cmd.index("--lr") + 1])
        if lr == 0.001:  # x0.5 of the CPU seed's 0.002: diverged
            return subprocess.CompletedProcess(cmd, 1, "", "fastpt: error: non-finite loss or gradient norm at step 3")
        if lr == 0.004 and killed:  # x2
            return subprocess.CompletedProcess(cmd, code, "", "")
        out.mkdir(parents=True)
        metrics(out / "metrics.jsonl", 2048, {10: 4.0 - lr})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    run = subprocess.run
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text('{"vocab_size": 256}')
    monkeypatch.setattr(race.subprocess, "run", train)
    argv = ["--corpora", str(tmp_path / "data"), "--recipes", "seed", "--speed-rounds", "0", "--seeds", "1"]
    argv += ["--budgets", "1", "--widen", "0", "--jobs", "2", "--work", str(tmp_path / "w")]
    killed = True
    assert race.main(argv) == 1
    err = capsys.readouterr().err
    stopped = "killed by SIGKILL" if code < 0 else "stopped by SIGTERM"
    assert err.startswith(f"bench race: error: run seed-x2-b1-seed1337 (--lr 0.004 --seed 1337) was {stopped}")
    assert err.count("\n") == 1, err
    killed = False
    assert race.main([*argv, "--save", str(tmp_path / "out")]) == 0
    (r,) = json.loads((tmp_path / "out" / "race.json").read_text())["corpora"].values()
    assert [x.get("error", "") for x in r["runs"]] == [
        "fastpt: error: non-finite loss or gradient norm at step 3",
        "",
        "",
    ]
    assert r["rows"][0]["multiplier"] == 2


def test_a_budget_counts_the_tokens_its_runs_trained(tmp_path, monkeypatch):
    """A batch warm-up trains fewer tokens than its steps' full batches: its budgets count those."""

    def ramped(name, flags, steps, args, data, out, reuse=False) -> dict:
        row = stand_in(name, flags, steps, args, data, out)
        return {**row, "tokens": row["tokens"] - 1024} if "--batch-warmup-steps" in flags else row

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text('{"vocab_size": 256}')
    monkeypatch.setattr(race, "run", ramped)
    argv = ["--corpora", str(tmp_path / "data"), "--recipes", "seed", "--speed-rounds", "1", "--seeds", "2"]
    argv += ["--recipe", "bw=--micro-batch 8 --grad-accum 2 --batch-warmup-steps 4", "--multiplier", "seed=1"]
    argv += ["--multiplier", "bw=1", "--work", str(tmp_path / "runs"), "--save", str(tmp_path / "out")]
    assert race.main(argv) == 0
    (r,) = json.loads((tmp_path / "out" / "race.json").read_text())["corpora"].values()
    seed, bw = ([b["tokens"] - b["steps"] * r["tokens_per_step"] for b in row["budgets"]] for row in r["rows"])
    assert seed == [0, 0, 0] and bw == [-1024, -1024, -1024]


def test_reuse_reads_back_a_finished_run_with_the_same_command(tmp_path, monkeypatch):
    """--reuse: a run finished with the same command is read back, not trained again; another
    command, or a run without --reuse, trains afresh."""
    trained = []

    def train(cmd, **kwargs):
        trained.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        metrics(out / "metrics.jsonl", 2048, {10: 4.0})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(race.subprocess, "run", train)
    args, out = race.parse_args(["--work", str(tmp_path)]), tmp_path / "seed-x1-b1-seed1337"
    first = race.run("seed", ["--lr", "0.002"], 10, args, tmp_path, out, reuse=True)
    again = race.run("seed", ["--lr", "0.002"], 10, args, tmp_path, out, reuse=True)
    assert len(trained) == 1 and again == first and first["final_val_loss"] == 4.0
    race.run("seed", ["--lr", "0.004"], 10, args, tmp_path, out, reuse=True)  # another LR: trained
    race.run("seed", ["--lr", "0.004"], 10, args, tmp_path, out)  # no --reuse (a speed round): trained
    assert len(trained) == 3


@pytest.mark.slow
def test_race_on_a_tiny_budget(bench_data, tmp_path):
    """Real fastpt.train processes (four: the seed at two budgets and two seeds), the results folder
    whole; the method itself is tested over stand-in runs above."""
    model = "--preset tiny --dim 32 --n-layers 1 --n-heads 2 --ffn-dim 64 --seq-len 32 --micro-batch 2"
    argv = ["--corpora", str(bench_data), "--model", model, "--tokens-per-param", "0.02", "--multipliers", "1"]
    argv += ["--budgets", "0.5,1", "--seeds", "2", "--recipes", "seed", "--speed-rounds", "0", "--eval-tokens", "128"]
    argv += ["--work", str(tmp_path / "runs"), "--save", str(tmp_path / "out")]
    cmd = [sys.executable, "-m", "bench", "race", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (r,) = json.loads((tmp_path / "out" / "race.json").read_text())["corpora"].values()
    assert r["steps"] == -(-r["params"] // 50 // r["tokens_per_step"])  # 0.02 tokens per parameter, rounded up
    assert [(x["fraction"], x["seed"], x["steps"]) for x in r["runs"]] == [
        (f, s, -(-r["steps"] * f // 1)) for f, s in ((1, 1337), (0.5, 1337), (0.5, 1338), (1, 1338))
    ]
    (seed,) = r["rows"]
    assert [len(b["seeds"]) for b in seed["budgets"]] == [2, 2] and seed["tokens_to_target"] == r["tokens"]
    assert r["target_val_loss"] == pytest.approx((r["runs"][0]["final_val_loss"] + r["runs"][3]["final_val_loss"]) / 2)
    md = (tmp_path / "out" / "race.md").read_text()
    for needed in ("Target: the seed's mean", "Full budget: ", "load average", "commit", "| seed |"):
        assert needed in md, needed
    assert (tmp_path / "out" / bench_data.name / "seed-x1-b0.5-seed1338" / "metrics.jsonl").is_file()
