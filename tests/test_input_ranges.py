"""Numbers each command bounds before any work: the model's epsilon and RoPE base, bench's flags,
export's shard size, prepare's workers; one line each (a range), never a traceback or a run of nothing."""

from __future__ import annotations

import json

import pytest

from bench.__main__ import main as bench_main
from bench.train_step_report import losses_agree
from conftest import assert_one_line_error, run_main, train_refuses
from fastpt import cores, export, hf
from fastpt.errors import ConfigError
from fastpt.prepare import prepare
from fastpt.presets import PRESETS


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("--norm-eps", "1e300", "'norm_eps' must be in (0, 0.01], got 1e+300"),
        ("--norm-eps", "0.5", "'norm_eps' must be in (0, 0.01]"),
        ("--rope-theta", "1e300", "'rope_theta' must be in (1, 1_000_000_000], got 1e+300"),
        ("--rope-theta", "0.5", "'rope_theta' must be in (1, 1_000_000_000]"),
    ],
)
def test_norm_eps_and_rope_theta_are_bounded(capsys, flag, value, named):
    """--norm-eps 1e300 trained a dead model (every norm's output ~0); both take the values models use."""
    train_refuses(capsys, ["--device", "cpu", "--preset", "tiny", flag, value], named)


def test_the_presets_and_published_values_are_inside_the_bounds():
    import dataclasses

    for cfg in PRESETS.values():
        dataclasses.replace(cfg, vocab_size=cfg.vocab_size or 256).check()
    for eps, theta in ((1e-5, 5e5), (1e-6, 1e6), (1e-8, 1e7)):  # Llama 3's, Qwen's, long-context models'
        dataclasses.replace(PRESETS["0.04b"], norm_eps=eps, rope_theta=theta).check()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--steps", "0"], "argument --steps: must be in [1, 1_000_000], got 0"),
        (["--micro-batch", "0"], "argument --micro-batch: must be in [1, 65_536], got 0"),
        (["--grad-accum", "-1"], "argument --grad-accum"),
        (["--warmup", "-1"], "argument --warmup"),
        (["--mode-timeout", "nan"], "argument --mode-timeout: must be in (0, 1_000_000], got nan"),
        (["--time-budget", "-1"], "argument --time-budget: must be in [20, 1_000_000], got -1"),
        (["--threads", "-1"], "argument --threads: must be in [0, 2_147_483_647], got -1"),
        (["--steps", "x"], "argument --steps: 'x' is not a whole number"),
    ],
)
def test_bench_refuses_flags_out_of_range_in_one_line(capsys, flags, named):
    """--steps 0 ran the default 10, --time-budget -1 skipped every mode and said 'losses agree', --threads -1
    was a traceback after the run: now one line and exit 2 before anything is measured."""
    code, out, err = run_main(bench_main, ["--device", "cpu", *flags], capsys)
    assert_one_line_error(code, err, "python -m bench: ", named)
    assert out == ""


def test_bench_never_says_losses_agree_when_no_mode_ran(capsys):
    """Every mode skipped (CUDA graphs on a CPU): no loss to agree, so the run fails, saying why."""
    assert not losses_agree([{"mode": "eager", "skipped": "out of time"}], 1e-4)
    args = ["--device", "cpu", "--preset", "tiny", "--data", "random", "--modes", "compiled+cudagraphs"]
    code = bench_main([*args, "--steps", "1", "--warmup", "0", "--no-plan"])
    out = capsys.readouterr().out
    assert code == 1 and "FAILED: no mode ran" in out and "losses agree" not in out


@pytest.mark.parametrize("size", ["1e400GB", "nanMB", "infKB", "-5GB"])
def test_export_refuses_a_shard_size_that_is_no_number(size):
    """1e400GB overflowed the hub's int() into a traceback."""
    with pytest.raises(ConfigError, match="'--max-shard-size' must be a size such as 5GB"):
        hf.parse_size(size)
    assert hf.parse_size("1e3GB") == "1e3GB" and hf.parse_size("100") == 100


def test_export_command_says_it_in_one_line(tmp_path, capsys):
    args = [str(tmp_path), "--out", str(tmp_path / "hf"), "--max-shard-size", "1e400GB"]
    code, _, err = run_main(export.main, args, capsys)
    assert_one_line_error(code, err, "'--max-shard-size' must be a size such as 5GB or 500MB, got '1e400GB'")
    assert not (tmp_path / "hf").exists()


def test_prepare_workers_are_at_most_the_cores(tmp_path, capsys):
    """Each worker is a process: --workers 1000000 is the cores this process may use, said in one line."""
    text = tmp_path / "a.txt"
    text.write_text("hello world\n" * 200)
    meta = prepare([text], tmp_path / "out", "bytes", workers=10**6)
    usable = cores.all_cores()
    assert meta["workers"] == usable == json.loads((tmp_path / "out" / "meta.json").read_text())["workers"]
    warning = f"fastpt: warning: --workers 1000000 is more than the {usable} cores this process may use: using {usable}"
    assert warning in capsys.readouterr().err
