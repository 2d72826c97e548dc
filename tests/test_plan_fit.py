"""fastpt.plan's fit to a card: --micro-batch auto's choice, the verdict (fits, at risk, does NOT
fit) and, for a run that does not fit, the search for the cheapest combination that does."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from test_plan import MIB, SMALL, TABLE, plan_of

from fastpt.cli import parse_args
from fastpt.config import resolve
from fastpt.errors import ConfigError
from fastpt.plan import fit, gpus, planner, search

# ---- --micro-batch auto


def card_between(low: planner.Plan, high: planner.Plan) -> str:
    """A card size (GiB) that fits `low` and not `high`, with the fit margin."""
    gib = (low.card_bytes + high.card_bytes) / 2 / (1 - fit.FIT_MARGIN) / 2**30
    return f"{gib:.6f}GiB"


def test_micro_batch_auto_picks_the_largest_that_fits():
    """16 sequences per step (the preset's micro-batch x 1); a card that fits micro-batch 8 (x 2
    accum) but not 16: auto picks 8 x 2, the same tokens per step, and says why, from three plans
    (at 4, for the guess; 16, which does not fit; 8, which does)."""
    flags = ("--preset", "tiny", "--vocab-size", "512", "--seq-len", "128")
    at8 = plan_of(*flags, "--micro-batch", "8", "--grad-accum", "2")
    at16 = plan_of(*flags, "--micro-batch", "16", "--grad-accum", "1")
    cli, config_file = parse_args([*flags, "--micro-batch", "auto", "--grad-accum", "1"])
    cfg, target = planner.planned_config(cli, config_file)
    assert fit.config_sequences(cfg) == 16
    traced = []
    with pytest.MonkeyPatch.context() as mp:  # one plan places the guess: no plan at 1 while a larger one fits
        mp.setattr(fit, "trace", lambda cfg, *args: traced.append(cfg.micro_batch) or planner.trace(cfg, *args))
        chosen, why = fit.fit_micro_batch(cfg, target, 1, gpus.card(card_between(at8, at16)))
    assert traced == [4, 16, 8]
    assert (chosen.cfg.micro_batch, chosen.cfg.grad_accum) == (8, 2)
    assert chosen.peak.bytes == at8.peak.bytes
    assert "micro-batch auto: 8 x 2 accum = 16 sequences/step; the largest that fits a card of" in why


def test_micro_batch_auto_says_when_even_one_does_not_fit():
    with pytest.raises(
        ConfigError, match=r"even micro-batch 1 does not fit .* planned, peak .*activation-checkpointing full"
    ):
        fit.main(parse_args([*SMALL[:4], "--micro-batch", "auto", "--plan", "--plan-gpu", "0.51"])[0], None)


def test_micro_batch_auto_keeps_the_sequences_when_a_divisor_fits():
    """16 sequences on a card that fits micro-batch 6 but not 8: 4 x 4 (16 exactly), not 6 x 3 = 18;
    the line says 6 fits too."""
    flags = ("--preset", "tiny", "--vocab-size", "512", "--seq-len", "128")
    at6 = plan_of(*flags, "--micro-batch", "6", "--grad-accum", "3")
    at8 = plan_of(*flags, "--micro-batch", "8", "--grad-accum", "2")
    cli, config_file = parse_args([*flags, "--micro-batch", "auto", "--grad-accum", "1"])
    cfg, target = planner.planned_config(cli, config_file)
    chosen, why = fit.fit_micro_batch(cfg, target, 1, gpus.card(card_between(at6, at8)))
    assert (chosen.cfg.micro_batch, chosen.cfg.grad_accum) == (4, 4)
    assert "4 x 4 accum = 16 sequences/step; the largest divisor of 16 that fits" in why and "6 fits too" in why


def test_exact_micro_batch_takes_a_divisor_unless_it_halves_the_batch():
    """The docs' case, 64 sequences where 22 fits: 16 x 4; where the best divisor is under half the
    largest that fits (14 sequences, 5 fits: divisor 2), the largest, and the nearest above."""
    assert fit.exact_micro_batch(22, 64) == 16
    assert fit.exact_micro_batch(6, 16) == 4
    assert fit.exact_micro_batch(5, 14) == 5
    assert fit.exact_micro_batch(7, 7) == 7


def test_auto_line_says_what_set_the_limit_and_per_rank():
    """All the step's sequences in one micro-batch with room to spare: the sequences per step set
    the limit, not the card; over 2 ranks the numbers are per rank, with the global batch."""
    flags = ("--preset", "tiny", "--vocab-size", "512", "--seq-len", "64")
    cli, config_file = parse_args([*flags, "--micro-batch", "auto", "--grad-accum", "1", "--plan-world-size", "2"])
    cfg, target = planner.planned_config(cli, config_file)
    chosen, why = fit.fit_micro_batch(cfg, target, 2, gpus.card("80GiB"))
    assert (chosen.cfg.micro_batch, chosen.cfg.grad_accum) == (16, 1)
    assert "16 sequences/step per rank (global batch 32 sequences)" in why
    assert "the sequences per step set the limit, not a card of 80.0 GiB" in why and "to spare" in why


def test_fit_margin_covers_the_error_band_and_the_context():
    """auto's margin: the plan's error band plus the CUDA context's spread on the smallest card,
    rounded up to a whole percent (5% eager, 12% compiled); the band covers every error measured on a
    GPU (tests/planned_peaks.json's "measured", an H200 run), and no known card is smaller than the
    smallest the margin assumes."""
    for compiled, mode in ((False, "eager"), (True, "compiled")):
        need = planner.PLAN_ERROR[mode] + planner.CONTEXT_SPREAD / planner.SMALLEST_CARD
        assert planner.fit_margin(compiled) == math.ceil(100 * need) / 100
    assert (fit.FIT_MARGIN, planner.fit_margin(True)) == (0.05, 0.12)
    for name, error in json.loads(TABLE.read_text())["measured"]["plan_error"].items():
        assert -error <= planner.PLAN_ERROR[name.split()[0]], name
    assert all(mib * MIB >= planner.SMALLEST_CARD for _, mib in gpus.GPUS.values())


def test_unmodelled_warns_only_when_it_applies():
    """One warning line naming CUDA graphs' pools, NCCL's buffers and FSDP's stream pools when those
    apply; nothing for one GPU in the default compile mode or for a CPU run."""
    plain = plan_of(*SMALL)
    assert planner.unmodelled(plain) == "" and planner.unmodelled(plan_of(*SMALL, "--device", "cpu")) == ""
    fsdp = plan_of(*SMALL, "--parallel", "fsdp", "--plan-world-size", "2")
    line = planner.unmodelled(fsdp)
    assert line.startswith("fastpt: warning:") and "NCCL" in line and "all-gather and reduce-scatter" in line
    graphs = dataclasses.replace(
        plain, cfg=resolve(dict(compile=True, compile_mode="max-autotune", grad_accum=1), None, "cuda")
    )
    assert "CUDA graphs' memory pools (max-autotune)" in planner.unmodelled(graphs)


def test_own_gpu_is_the_ranks_own_and_its_free_memory(monkeypatch):
    """Without --plan-gpu under torchrun: LOCAL_RANK's GPU made the device before its memory is asked
    (so no rank makes a context on GPU 0), and the plan fits what is free on it, not its total."""
    plan = plan_of(*SMALL)  # before CUDA is faked available (a CUDA build's optimizer would ask the driver)
    calls = []
    current = [0]
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda i: (calls.append(("set_device", i)), current.__setitem__(0, i))
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "H200")

    def mem_get_info(i=None):
        calls.append(("mem_get_info", i, current[0]))
        return 20 * 2**30, 140 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    gpu = gpus.card("")
    assert calls == [("set_device", 3), ("mem_get_info", 3, 3)]
    assert (gpu.total, gpu.free, gpu.usable) == (140 * 2**30, 20 * 2**30, 20 * 2**30 + gpus.CUDA_CONTEXT)
    assert "cuda:3" in str(gpu) and "20.0 GiB free of 140.0 GiB" in str(gpu)
    big = SimpleNamespace(reserved=19 * 2**30)  # fits the card's total, not what is free
    plan.peak, plan.card = SimpleNamespace(**vars(plan.peak) | vars(big)), gpu
    assert plan.card_bytes < 0.95 * gpu.total and not plan.fits(fit.FIT_MARGIN)


def test_first_guess_keeps_tokens_or_goes_just_above():
    """A plan at 4 with 4 GiB of activations and transient (1 GiB a sequence) and 0.5 GiB besides,
    a limit that holds 22: 64 sequences take 3 micro-steps (of 22), 16 sequences one."""
    parts = {"parameters": 2**29, "activations": 3.5 * 2**30, "transient": 2**29}
    probe = SimpleNamespace(
        card_bytes=4.5 * 2**30, peak=SimpleNamespace(parts=parts), cfg=SimpleNamespace(micro_batch=4)
    )
    assert fit.guess_accum(probe, 64, 22.6 * 2**30) == 3
    assert fit.guess_accum(probe, 16, 22.6 * 2**30) == 1


# ---- the verdict: fits, at risk, does NOT fit and what would


def test_a_plan_that_fits_within_its_error_band_is_at_risk():
    """A card with room beyond the plan's error band (fit_margin: 5% eager) fits; one with less room
    than the band fits 'but at risk', and says how much is to spare and how large the band is."""
    plan = plan_of(*SMALL)
    for size, verdict in ((plan.card_bytes / 0.9, "fits a card of"), (plan.card_bytes / 0.97, "fits a card of")):
        plan.card = gpus.card(f"{size / 2**30:.6f}GiB")
        line = next(line for line in planner.describe(plan) if line.startswith(verdict))
        at_risk = size < plan.card_bytes / (1 - fit.FIT_MARGIN)
        assert ("but at risk" in line) == at_risk, line
        if at_risk:
            assert "to spare, within the plan's error band (5% of the card eager: " in line


def test_a_plan_that_does_not_fit_names_the_cheapest_combination_that_does():
    """16 sequences of 256 tokens on a card that micro-batch 16 overflows and 8 x 2 fits with the
    margin free: the verdict names --micro-batch 8 --grad-accum 2 (no checkpointing to recompute, one
    card), and the smallest named card that holds the plan as it is."""
    flags = ("--preset", "tiny", "--vocab-size", "512", "--seq-len", "256")
    at8, at16 = plan_of(*flags, "--micro-batch", "8", "--grad-accum", "2"), plan_of(*flags, "--micro-batch", "16")
    assert at8.card_bytes / (1 - fit.FIT_MARGIN) < at16.card_bytes
    at16.card = gpus.card(f"{(at8.card_bytes / (1 - fit.FIT_MARGIN) + at16.card_bytes) / 2 / 2**30:.6f}GiB")
    lines = planner.describe(at16, search.next_steps(at16))
    verdict = next(i for i, line in enumerate(lines) if line.startswith("does NOT fit a card of"))
    assert lines[verdict + 1].startswith(f"  next: --micro-batch 8 --grad-accum 2 fits ({planner.gib(at8.card_bytes)} ")
    assert lines[verdict + 2].startswith("  or a card with ") and lines[verdict + 2].endswith(": the A10G, 22.5 GiB")
    assert search.next_steps(at8) == []  # it fits: nothing to say


def test_a_search_never_traces_a_configuration_twice(monkeypatch):
    """The search's plans are each a configuration not planned before in this process, the run's own
    plan included (it was planned: the verdict is its), and what no trace depends on (the run's
    steps, its price) does not make a configuration new."""
    flags = ("--preset", "tiny", "--vocab-size", "512", "--seq-len", "256", "--micro-batch", "16")
    plan = plan_of(*flags)
    plan.card = gpus.card(f"{plan.card_bytes * 0.99 / 2**30:.6f}GiB")
    keys = []
    traced = planner.traced
    monkeypatch.setattr(planner, "traced", lambda *a: keys.append(planner.traced_key(*a)) or traced(*a))
    assert search.next_steps(plan)[0].startswith("  next: ")
    assert plan_of(*flags, "--max-steps", "20", "--plan-price", "2").peak == plan.peak
    assert keys and len(set(keys)) == len(keys) and planner.traced_key(plan.cfg, "cuda", 1) not in keys


def test_a_run_that_does_not_fit_is_not_priced():
    """The step time is said (it is what the run would take), the run's hours and cost are not: it
    cannot start on the card. The JSON's run figures are null."""
    plan = plan_of(*SMALL, "--plan-price", "2")
    plan.card = gpus.card("h100-80")
    assert any(line.startswith("  10,000 steps = ") for line in planner.describe(plan))
    plan.card = dataclasses.replace(plan.card, total=plan.card_bytes // 2)
    lines = planner.describe(plan)
    assert any(line.startswith("step on H100 80GB: ") for line in lines)
    assert not any("GPU-hours" in line for line in lines)
    assert any(line.startswith("  not priced: the run does not fit H100 80GB; ") for line in lines)
    record = planner.to_json(plan)
    assert record["step_ms"] > 0 and record["gpu_hours"] is None and record["cost_usd"] is None


@pytest.mark.slow  # some plans of FSDP
def test_when_only_sharding_fits_does_not_fit_says_so():
    """Micro-batch 1 with full checkpointing already: the only lever left is FSDP over more GPUs; the
    cheapest whose plan fits with the margin free is named, and priced."""
    flags = (*SMALL[:4], "--vocab-size", "32000", "--dim", "256", "--n-heads", "4", "--micro-batch", "1")
    flags += ("--activation-checkpointing", "full")
    one, two = plan_of(*flags), plan_of(*flags, "--parallel", "fsdp", "--plan-world-size", "2")
    assert two.card_bytes / (1 - fit.FIT_MARGIN) < one.card_bytes
    one.card = gpus.card(f"{(two.card_bytes / (1 - fit.FIT_MARGIN) + one.card_bytes) / 2 / 2**30:.6f}GiB")
    lines = search.next_steps(one)
    assert lines[0].startswith("  next: --parallel fsdp over ") and " planned per GPU" in lines[0]


@pytest.mark.slow  # the 1b preset's plan and its search: a few traces of 3 and 4 of its blocks
def test_the_1b_preset_on_a_4090_is_offered_what_fits():
    """'Does the 1b preset fit an RTX 4090?' No (51 GiB): the levers searched together find a
    combination that fits with the margin free, at least as good as FSDP over 8 GPUs with full
    checkpointing (which fits in about 10.5 GiB): no more GPUs than that, and within twice the
    plan's own time."""
    plan = plan_of("--preset", "1b", "--plan-gpu", "4090")
    plan.card = gpus.card("4090")
    found = search.search(plan)
    assert found.option is not None and found.plan.fits(fit.FIT_MARGIN), found
    assert found.option.world_size <= 8 and found.seconds <= search.BUDGET * plan.seconds
    line = search.next_steps(plan)[0]
    assert line.startswith(f"  next: {found.option.flags(plan)} fits ")


@pytest.mark.slow  # ~15-20 s of FSDP traces (auto's search among them): the fast half's largest
def test_fsdp_reshard_grads_keeps_no_unsharded_gradients():
    """--fsdp-reshard-grads (reduce-scatter at every micro-step): no unsharded fp32 gradients across
    micro-steps, a peak lower by about their size; the plan prints the other choice's peak; auto
    takes it when keeping them leaves not even micro-batch 1 fitting, and says so."""
    flags = (*SMALL, "--grad-accum", "2", "--dim", "256", "--n-heads", "4", "--n-layers", "2", "--parallel", "fsdp")
    flags += ("--plan-world-size", "4")
    keep, reshard = plan_of(*flags), plan_of(*flags, "--fsdp-reshard-grads")
    assert keep.peak.parts["unsharded gradients"] == pytest.approx(4 * keep.params, rel=0.05)
    assert reshard.peak.parts.get("unsharded gradients", 0) == 0
    assert reshard.peak.bytes < keep.peak.bytes - 2 * keep.params
    (line,) = fit.other_gradient_sync(keep)
    assert line.startswith("reduce-scattering at every micro-step") and planner.gib(reshard.peak.bytes) in line
    shape = [*SMALL[:4], "--seq-len", "64", *flags[10:]]  # 16 sequences per step (tiny's micro-batch x 1)
    cfg, target = planner.planned_config(*parse_args([*shape, "--micro-batch", "auto"]))
    at1 = [plan_of(*shape, "--micro-batch", "1", "--grad-accum", "16", *r) for r in ((), ("--fsdp-reshard-grads",))]
    chosen, why = fit.fit_micro_batch_fsdp(cfg, target, 4, gpus.card(card_between(at1[1], at1[0])))
    assert chosen.cfg.fsdp_reshard_grads and "with --fsdp-reshard-grads" in why
