"""The published runs the step-time plan is held to (fastpt/plan/published.json): data, not code;
each run's source named; identical configurations counted once; the band --plan prints resting on
the runs no constant was fitted to, and saying how many they are; each run on the card it ran on;
(slow) every run re-planned as committed."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

import pytest

from conftest import REPO, update_table
from fastpt.cli import parse_args
from fastpt.plan import gpus, planner, published, report

TINY = ("--preset", "tiny", "--vocab-size", "512", "--micro-batch", "4", "--seq-len", "64")


def test_the_table_is_data_with_a_source_for_every_run():
    rows = json.loads(published.TABLE.read_text())["runs"]
    assert len(rows) == len(published.RUNS) >= 14
    for run in published.RUNS:
        assert run.source.startswith(("https://", "http://")) or "/" in run.source.split()[0], run.name
        assert run.card in gpus.GPUS and gpus.speed_of(gpus.card(run.card)) is not None, run.name
        assert parse_args(run.argv)  # flags fastpt takes


def test_identical_configurations_count_once():
    """modded-nanogpt records 6 and 7 are the same code, flags and card (torch 2.4.1 against 2.5.0):
    one plan, one configuration of the band, its error against the median of their steps."""
    groups = published.configurations(published.RUNS)
    (records,) = [g for g in groups if len(g) > 1]
    assert {run.name for run in records} == {"modded-nanogpt record 6", "modded-nanogpt record 7"}
    assert published.config_error(records) == pytest.approx(
        records[0].planned_ms / statistics.median(r.reported_ms for r in records) - 1
    )
    assert published.ERROR_BAND.configurations == len(groups) == len(published.RUNS) - 1


def test_the_band_rests_on_the_held_out_runs_only():
    """A run a constant was fitted to leaves the band: its error, however small, is not evidence."""
    runs = list(published.RUNS)
    fitted = [dataclasses.replace(run, fitted=True) if run.name == "MPT-1B" else run for run in runs]
    assert published.band(fitted).configurations == published.band(runs).configurations - 1
    errors = sorted(abs(published.config_error(g)) for g in published.configurations(runs) if not g[0].fitted)
    assert published.ERROR_BAND == published.Band(
        statistics.median(errors), errors[-1], len(errors), published.ERROR_BAND.cards
    )


def test_the_band_holds_on_nine_in_ten_runs_it_did_not_rest_on():
    """Leave one configuration out, and the band of the others still covers it, for at least 9 in 10
    of them: the worst error printed is a bound a renter's unseen run is likely within."""
    groups = [g for g in published.configurations(published.RUNS) if not g[0].fitted]
    covered = 0
    for i, group in enumerate(groups):
        others = [run for g in groups[:i] + groups[i + 1 :] for run in g]
        covered += abs(published.config_error(group)) <= published.band(others).worst
    assert covered >= 0.9 * len(groups), f"{covered} of {len(groups)}"


def test_torchtitans_runs_are_planned_on_their_own_card():
    """torchtitan's Llama 3.1 8B benchmarks ran on H100s with 96 GB of HBM2e at 2.4 TB/s (Meta's
    Grand Teton hosts), not on the 80 GB HBM3 card."""
    for run in (r for r in published.RUNS if r.name.startswith("torchtitan")):
        assert run.card == "h100-96"
    card = gpus.card("h100-96")
    assert card.name == "H100 96GB HBM2e" and 95 * gpus.GIB < card.total < 96 * gpus.GIB
    assert gpus.speed_of(card).hbm_gbs == 2400 and gpus.speed_of(card).link.startswith("NVLink")


def test_the_plan_says_how_many_independent_runs_its_band_rests_on():
    """The step's run line gives the band's configurations, their cards and that no constant was
    fitted to them; on a card none of them ran on it says the band is less certain there."""
    band = published.ERROR_BAND
    cli, config_file = parse_args([*TINY, "--plan-gpu", "h100-80"])
    cfg, target = planner.planned_config(cli, config_file)
    traced = planner.trace(cfg, target, 1)
    for gpu, measured in (("h100-80", True), ("4090", True), ("h200", False), ("l4", False)):
        plan = dataclasses.replace(traced, card=gpus.card(gpu))
        line = next(line for line in planner.describe(plan) if line.startswith("  10,000 steps = "))
        assert (
            f"the plan's error against {band.configurations} independent published runs on RTX 4090, A100 40GB, "
            f"A100 80GB, H100 80GB, H100 96GB HBM2e, none of them used to set its constants: median {band.median:.0%}, "
            f"worst {band.worst:.0%}" in line
        )
        assert ("less certain there" in line) != measured, gpu
        record = planner.to_json(plan)["error_band"]
        assert record["measured_on_this_card"] == measured and record["runs"] == band.configurations
    assert report.ERROR_BAND is band


@pytest.mark.slow  # a trace of FSDP x 8 or DDP x 8 steps, 124M-8B, each
@pytest.mark.parametrize("group", published.configurations(published.RUNS), ids=lambda group: group[0].name)
def test_each_published_configuration_plans_as_committed(group):
    """A published configuration re-planned with its flags, card and GPUs gives the step committed for
    it (within 0.5%), so the band --plan prints is this planner's, not an older one's.
    FASTPT_UPDATE_PLANS=1 rewrites the committed steps instead (then the diff shows what moved)."""
    cli, config_file = parse_args(group[0].argv)
    cfg, target = planner.planned_config(cli, config_file)
    plan = dataclasses.replace(planner.trace(cfg, target, cfg.plan_world_size), card=gpus.card(group[0].card))
    planned_ms = plan.step_time().seconds * 1e3
    if os.environ.get("FASTPT_UPDATE_PLANS"):
        for run in group:
            update_table(published.TABLE, run.name, planned_ms=round(planned_ms, 1))
        return
    moved = [
        f"{r.name}: {r.planned_ms:,.1f} -> {planned_ms:,.1f} ms"
        for r in group
        if abs(planned_ms / r.planned_ms - 1) > 0.005
    ]
    assert not moved, "; ".join(moved)


def test_the_docs_table_is_the_data():
    """docs/performance.md shows published.json as published.markdown writes it: the page cannot
    drift from the band --plan prints."""
    page = (REPO / "docs" / "performance.md").read_text()
    start = page.index("<!-- published runs: fastpt.plan.published.markdown -->\n")
    end = page.index("<!-- end of published runs -->")
    assert page[start:end].split("\n", 1)[1] == published.markdown(published.RUNS)
