"""--schedule cosine|wsd|linear: each curve against its formula at every step, the loop logs it,
and a bad value is one line."""

from __future__ import annotations

import pytest

from conftest import TINY, read_metrics, run_main, train_refuses
from fastpt import train
from fastpt.optim import lr_at, lr_schedule

PEAK, WARMUP, STEPS, FLOOR = 3e-3, 10, 100, 0.1


def test_cosine_is_the_seeds_formula():
    for step in range(STEPS + 5):
        assert lr_schedule("cosine", step, PEAK, WARMUP, STEPS, FLOOR) == lr_at(step, PEAK, WARMUP, STEPS, FLOOR)


@pytest.mark.parametrize("fraction, decay_start", [(0.2, 80), (0.25, 75), (0.29, 71), (1.0, WARMUP)])
def test_wsd_warms_up_holds_the_peak_then_decays_linearly_over_the_last_fraction(fraction, decay_start):
    for step in range(STEPS + 5):
        if step < WARMUP:
            want = PEAK * step / WARMUP
        elif step < decay_start:
            want = PEAK
        else:
            want = PEAK * (1 - (1 - FLOOR) * min(1, (step - decay_start) / (STEPS - decay_start)))
        assert lr_schedule("wsd", step, PEAK, WARMUP, STEPS, FLOOR, fraction) == pytest.approx(want, rel=1e-12), step
    assert lr_schedule("wsd", decay_start, PEAK, WARMUP, STEPS, FLOOR, fraction) == PEAK
    assert lr_schedule("wsd", STEPS, PEAK, WARMUP, STEPS, FLOOR, fraction) == pytest.approx(FLOOR * PEAK)


def test_linear_decays_from_the_end_of_warmup():
    for step in range(STEPS + 5):
        want = (
            PEAK * step / WARMUP
            if step < WARMUP
            else PEAK * (1 - (1 - FLOOR) * min(1, (step - WARMUP) / (STEPS - WARMUP)))
        )
        assert lr_schedule("linear", step, PEAK, WARMUP, STEPS, FLOOR, 0.2) == pytest.approx(want, rel=1e-12)
    assert lr_schedule("linear", 55, PEAK, WARMUP, STEPS, FLOOR) == pytest.approx(PEAK * 0.55)


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="'step'"):
        lr_schedule("step", 3, PEAK, WARMUP, STEPS)


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
    assert logged == [lr_schedule(schedule, s, 1e-3, 2, 10, 0.1, 0.3) for s in range(10)]  # step s+1 runs at lr(s)


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("--schedule", "step", "'schedule'"),
        ("--decay-fraction", "0", "'decay_fraction'"),
        ("--decay-fraction", "1.5", "'decay_fraction'"),
    ],
)
def test_bad_schedule_flags_are_one_line(tmp_path, capsys, flag, value, named):
    train_refuses(capsys, [*TINY, "--out", str(tmp_path), flag, value], named, value)
