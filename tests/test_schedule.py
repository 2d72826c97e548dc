"""--schedule cosine|wsd|linear: each curve against its formula at every step (wsd to its own floor,
linearly or as 1 - sqrt), the loop logs it, and a bad value (a decay of no steps too) is one line."""

from __future__ import annotations

import pytest

from conftest import TINY, read_metrics, run_main, train_refuses
from fastpt import train
from fastpt.config import TrainConfig
from fastpt.optim import lr_at, lr_schedule

PEAK, WARMUP, STEPS, FLOOR = 3e-3, 10, 100, 0.1


def lr(schedule: str, step: int, fraction: float = 0.2, **settings) -> float:
    """The schedule's LR at `step` for a run of STEPS steps, WARMUP of warmup, peaking at PEAK."""
    cfg = TrainConfig(
        schedule=schedule, warmup_steps=WARMUP, max_steps=STEPS, min_lr_ratio=FLOOR, decay_fraction=fraction, **settings
    )
    return lr_schedule(cfg, step, PEAK)


def test_cosine_is_the_seeds_formula():
    for step in range(STEPS + 5):
        assert lr("cosine", step) == lr_at(step, PEAK, WARMUP, STEPS, FLOOR)
    seed = TrainConfig()  # the seed's run: 5e-4, warmup 500, 10000 steps, floor 10%
    for step, want in ((0, 0.0), (500, 5e-4), (10_000, 5e-5)):
        assert lr_schedule(seed, step, seed.lr) == pytest.approx(want, rel=1e-12, abs=0)


@pytest.mark.parametrize("fraction, decay_start", [(0.2, 80), (0.25, 75), (0.29, 71), (1.0, WARMUP)])
@pytest.mark.parametrize("floor", [0.0, 0.25])
def test_wsd_warms_up_holds_the_peak_then_decays_linearly_over_the_last_fraction(fraction, decay_start, floor):
    """To its own floor (decay_floor, 0 by default: to zero); min_lr_ratio is not wsd's."""
    for step in range(STEPS + 5):
        if step < WARMUP:
            want = PEAK * step / WARMUP
        elif step < decay_start:
            want = PEAK
        else:
            want = PEAK * (1 - (1 - floor) * min(1, (step - decay_start) / (STEPS - decay_start)))
        got = lr("wsd", step, fraction, decay_floor=floor)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-18), step
    assert lr("wsd", decay_start, fraction, decay_floor=floor) == PEAK
    assert lr("wsd", STEPS, fraction, decay_floor=floor) == floor * PEAK
    assert lr("wsd", STEPS) == 0.0  # the default: to zero


def test_wsd_sqrt_decays_as_one_minus_the_root_of_progress():
    """Hägele et al. 2024's cooldown: floor + (peak - floor) * (1 - sqrt(progress)), from step 80."""
    for step, progress in ((79, 0.0), (80, 0.0), (85, 0.25), (90, 0.5), (95, 0.75), (100, 1.0), (120, 1.0)):
        for floor in (0.0, 0.1):
            want = floor * PEAK + (PEAK - floor * PEAK) * (1 - progress**0.5)
            assert lr("wsd", step, decay_shape="sqrt", decay_floor=floor) == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert all(lr("wsd", step, decay_shape="sqrt") < lr("wsd", step) for step in range(81, 100))  # below linear


def test_linear_decays_from_the_end_of_warmup():
    for step in range(STEPS + 5):
        want = (
            PEAK * step / WARMUP
            if step < WARMUP
            else PEAK * (1 - (1 - FLOOR) * min(1, (step - WARMUP) / (STEPS - WARMUP)))
        )
        assert lr("linear", step) == pytest.approx(want, rel=1e-12)
    assert lr("linear", 55) == pytest.approx(PEAK * 0.55)


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="'step'"):
        lr("step", 3)


@pytest.mark.parametrize("schedule", ["wsd", "linear"])
def test_the_loop_runs_each_step_at_the_schedules_lr(tiny_data, tmp_path, capsys, schedule):
    args = [
        *TINY,
        "--data",
        str(tiny_data),
        "--out",
        str(tmp_path),
        "--max-steps",
        "10",
        "--warmup-steps",
        "2",
        "--lr",
        "1e-3",
        "--log-every",
        "1",
        "--eval-every",
        "10",
        "--eval-tokens",
        "128",
        "--schedule",
        schedule,
        "--decay-fraction",
        "0.3",
    ]
    code, _, err = run_main(train.main, args, capsys)
    assert code == 0, err
    logged = [r["lr"] for r in read_metrics(tmp_path)]
    cfg = TrainConfig(schedule=schedule, warmup_steps=2, max_steps=10, decay_fraction=0.3)
    assert logged == [lr_schedule(cfg, s, 1e-3) for s in range(10)]  # step s+1 runs at lr(s)


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("--schedule", "step", "'schedule'"),
        ("--decay-fraction", "0", "'decay_fraction'"),
        ("--decay-fraction", "1.5", "'decay_fraction'"),
        ("--decay-shape", "cosine", "'decay_shape'"),
        ("--decay-floor", "1.5", "'decay_floor'"),
    ],
)
def test_bad_schedule_flags_are_one_line(tmp_path, capsys, flag, value, named):
    train_refuses(capsys, [*TINY, "--out", str(tmp_path), flag, value], named, value)


def test_a_wsd_decay_of_no_steps_is_one_line(tmp_path, capsys):
    """0.04 of 10 steps rounds to 0: the run would never decay."""
    flags = ["--schedule", "wsd", "--max-steps", "10", "--warmup-steps", "1", "--decay-fraction", "0.04"]
    train_refuses(capsys, [*TINY, "--out", str(tmp_path), *flags], "'decay_fraction' 0.04", "'max_steps' 10", "0 steps")
