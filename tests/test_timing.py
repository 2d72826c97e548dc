"""fastpt.plan.timing: a planned step's time on a card, from the traced step's kernels. The model's
parts against their formulas, grad_accum's scaling, the CPU side of a launch-bound step, overlap of
communication, the --plan output, the committed table of planned step times, and (slow) the 0.04b
preset's compiled step planned faster than its eager one on an H100 and an H200."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import re

import pytest
import torch

from conftest import REPO, table_entries, update_table
from fastpt.cli import parse_args
from fastpt.errors import ConfigError
from fastpt.plan import gpus, planner, report, timing
from fastpt.plan.flops import Cost
from fastpt.plan.memory import MemoryTrace

TABLE = REPO / "tests" / "planned_times.json"
TINY = ("--preset", "tiny", "--vocab-size", "512", "--micro-batch", "4", "--seq-len", "64")
H100, H200 = gpus.SPEEDS["h100-80"], gpus.SPEEDS["h200"]


def plan_of(*flags: str) -> planner.Plan:
    """The plan fastpt.train --plan makes of these flags, on the card their --plan-gpu names (the
    trace, which no card changes, made once per session)."""
    i = flags.index("--plan-gpu")
    return dataclasses.replace(traced(*flags[:i], *flags[i + 2 :]), card=gpus.card(flags[i + 1]))


@functools.cache
def traced(*flags: str) -> planner.Plan:
    cli, config_file = parse_args(list(flags))
    cfg, target = planner.planned_config(cli, config_file)
    return planner.trace(cfg, target, cfg.plan_world_size)


# ---- the parts of the model against their formulas


def test_a_large_matmul_runs_at_the_measured_ceiling_and_a_thin_one_below_it():
    """8192^3 in bf16 on the H200: within 4% of the 700 TFLOP/s this project measured (its last wave
    is 97% full); M = 64 reads a 128 MB weight for few FLOPs: memory-bound, far below it."""
    flops = 2.0 * 8192**3
    tflops = flops / timing.matmul_seconds(H200, (8192, 8192, 8192, 1), torch.bfloat16) / 1e12
    assert 0.96 * 700 <= tflops <= 1.04 * 700
    mm = (64, 8192, 8192, 1)
    thin = Cost("matmul", 2 * (64 * 8192 * 2 + 8192 * 8192), [mm], torch.bfloat16, 2.0 * 64 * 8192 * 8192)
    seconds, bound = timing.kernel_seconds(H200, thin, 1)
    assert bound == "memory" and thin.flops / seconds / 1e12 < 0.6 * tflops
    assert timing.matmul_seconds(H200, (100, 8192, 8192, 1), torch.bfloat16) > timing.matmul_seconds(
        H200, mm, torch.bfloat16
    )


def test_a_copy_runs_at_the_measured_bandwidth():
    seconds, bound = timing.kernel_seconds(H200, Cost("memory", 2 * 2**30), 1)
    assert bound == "memory"
    assert 2 * 2**30 / (seconds - timing.KERNEL_US * 1e-6) == pytest.approx(4.22e12, rel=0.01)


def test_ring_collectives_move_their_bytes_over_the_link():
    """An all-reduce over 8 GPUs: 2 (N-1)/N of the tensor over the link at COMM_EFF, plus the ring's steps."""
    cost = Cost("comm", comm="all-reduce", comm_bytes=2 * 10**9)
    seconds, _ = timing.kernel_seconds(H100, cost, 8)
    expected = 7 / 8 * 2e9 / (450e9 * timing.COMM_EFF) + 7 * timing.RING_STEP_US * 1e-6
    assert seconds == pytest.approx(expected)
    assert timing.kernel_seconds(H100, cost, 1)[0] == 0.0


def op(kind: str = "memory", nbytes: int = 0, cpu: float = timing.EAGER_FORWARD_US, **kw) -> timing.Op:
    cost = Cost(kind, nbytes, comm="all-gather" if kind == "comm" else "", comm_bytes=nbytes if kind == "comm" else 0)
    return timing.Op(kw.pop("label", kind), kw.pop("phase", "forward"), 1, cost, cpu, **kw)


def test_a_launch_bound_step_takes_its_cpu_side():
    """1,000 tiny eager kernels: the GPU waits for the CPU, the step is 1,000 x EAGER_FORWARD_US."""
    ops = [op(nbytes=1024) for _ in range(1000)]
    seconds = [timing.kernel_seconds(H100, o.cost, 1)[0] for o in ops]
    total, busy, cpu = timing.simulate(ops, seconds)
    assert total == pytest.approx(1000 * timing.EAGER_FORWARD_US * 1e-6, rel=1e-3) == cpu
    assert busy["forward"] < 0.5 * total


def test_communication_overlaps_compute_until_its_output_is_read():
    """A 1 ms all-gather beside 1 ms of independent compute is hidden; a kernel reading its output waits."""
    gather = op("comm", writes=(7,))
    compute = op(nbytes=0, label="compute")
    reader = op(nbytes=0, reads=(7,), label="reader")
    hidden, _, _ = timing.simulate([gather, compute], [1e-3, 1e-3])
    waited, _, _ = timing.simulate([gather, compute, reader], [1e-3, 1e-3, 1e-3])
    assert hidden == pytest.approx(1e-3 + 2 * timing.EAGER_FORWARD_US * 1e-6, rel=0.01)
    assert waited == pytest.approx(2e-3 + timing.EAGER_FORWARD_US * 1e-6, rel=0.01)


def test_a_buffer_at_a_freed_ones_address_waits_for_nothing():
    """The allocator hands freed storages' addresses to new buffers (which ones, by chance in a plan:
    a print between two ops changes them). The trace keeps them apart: 100 collectives into new
    buffers (0.01 s each) run beside the 100 matmuls (0.01 s each) that wrote the freed ones."""
    mem = MemoryTrace()
    gc.collect()  # no earlier test's garbage freed in between, into the free lists the buffers take
    gc.disable()
    with timing.KernelTrace(mem) as timed, mem, contextlib.ExitStack() as stack:
        stack.callback(gc.enable)
        x = torch.randn(8, 8)
        products = [x @ x for _ in range(100)]
        freed = {p.untyped_storage()._cdata for p in products}
        buffers = []
        while products:  # each buffer made as a product is freed: the free lists hand its address on
            products.pop()
            buffers.append(torch.empty(8, 8))
        for buffer in buffers:
            buffer.add_(1)  # stands for an all-reduce into it
    assert sum(b.untyped_storage()._cdata in freed for b in buffers) >= 10  # addresses were reused
    ops = [dataclasses.replace(o, cost=Cost("comm")) if o.label == "aten.add_" else o for o in timed.ops]
    seconds = [0.01 if o.cost.kind in ("matmul", "comm") else 0.0 for o in ops]
    total, _, _ = timing.simulate(ops, seconds)
    assert total == pytest.approx(1.0, abs=0.01)  # a collective waiting for a freed buffer's writer: 1.99 s


# ---- the traced step


def test_time_scales_with_grad_accum():
    """The trace runs two micro-steps; the run's step repeats the first: each further micro-step adds
    the same time."""
    log = plan_of(*TINY, "--grad-accum", "2", "--plan-gpu", "h100-80").kernels
    t = [timing.step_time(dataclasses.replace(log, grad_accum=n), H100).seconds for n in (2, 4, 8)]
    assert t[0] < t[1] < t[2]
    assert t[2] - t[1] == pytest.approx(2 * (t[1] - t[0]), rel=0.02)


def test_plan_prints_the_step_time_and_its_kernels():
    plan = plan_of(*TINY, "--plan-gpu", "h100-80")
    lines = planner.describe(plan)
    step = next(line for line in lines if line.startswith("step on H100 80GB: "))
    assert " tok/s, MFU " in step and "(HFU " in step and "communication 0.0 exposed" in step
    assert lines[lines.index(step) + 1].startswith("  10,000 steps = ")
    kernels = lines[lines.index(step) + 3 : lines.index(step) + 11]
    assert len(kernels) == 8 and all(" µs " in line for line in kernels)
    record = planner.to_json(plan)
    assert {"step_ms", "tok_s", "tok_s_per_gpu", "mfu", "time_parts", "kernels"} <= set(record)
    assert set(record["time_parts"]) == {"forward", "backward", "optimizer", "communication", "overhead"}
    assert sum(record["time_parts"].values()) == pytest.approx(record["step_ms"])
    assert record["tok_s"] == pytest.approx(4 * 64 / record["step_ms"] * 1e3)


def test_a_card_given_by_size_has_no_speed():
    plan = plan_of(*TINY, "--plan-gpu", "24GiB")
    lines = planner.describe(plan)
    assert any(line.startswith("step time: a card of 24.0 GiB has no known speed") for line in lines)
    assert not any(line.startswith("step on") for line in lines) and "step_ms" not in planner.to_json(plan)
    assert plan.peak.bytes > 0  # the memory plan is still there


def test_fsdp_plans_its_collectives_and_ddp_its_buckets():
    """FSDP over 2 (fake process group): the all-gathers and reduce-scatters the trace sees are priced
    over the link; DDP (planned in one process) all-reduces its gradient buckets in the backward."""
    fsdp = plan_of(*TINY, "--parallel", "fsdp", "--plan-world-size", "2", "--plan-gpu", "h100-80")
    comms = {o.cost.comm for o in fsdp.kernels.ops if o.cost.kind == "comm"}
    assert {"all-gather", "reduce-scatter"} <= comms
    ddp = plan_of(*TINY, "--grad-accum", "2", "--parallel", "ddp", "--plan-world-size", "2", "--plan-gpu", "l4")
    reduces = [o for o in ddp.kernels.sequence() if o.label == "DDP all-reduce"]
    assert len(reduces) == len(ddp.kernels.ddp_buckets) > 0
    slow_link = timing.step_time(ddp.kernels, dataclasses.replace(gpus.SPEEDS["l4"], link_gbs=0.01))
    assert slow_link.parts["communication"] > 0.5 * slow_link.seconds


# ---- Muon, MFU, what the renter reads


def newton_schulz_ops(plan: planner.Plan) -> list[timing.Op]:
    return [o for o in plan.kernels.sequence() if o.label.startswith("Newton-Schulz")]


def test_newton_schulz_is_priced_in_bf16_on_cuda():
    """The CPU trace runs Newton-Schulz in fp32; on CUDA fastpt.muon runs it in bf16 on the tensor cores."""
    ops = newton_schulz_ops(plan_of(*TINY, "--optimizer", "muon", "--plan-gpu", "h100-80"))
    assert ops and all(o.cost.dtype == torch.bfloat16 and o.phase == "optimizer" for o in ops)
    fp32 = dataclasses.replace(ops[0].cost, dtype=torch.float32)
    assert timing.kernel_seconds(H100, fp32, 1)[0] > timing.kernel_seconds(H100, ops[0].cost, 1)[0]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_muon_plans_one_ranks_share_and_its_all_gathers(parallel):
    """On 4 ranks each orthogonalizes ceil(n / 4) of each shape's n matrices (the tiny preset's: 8, 4
    and 2, a share of 1/4 to 1/2) and all-gathers the rest. FSDP's trace runs rank 0 of 4 over a
    fake process group; DDP's runs one process, which the plan cuts to a rank's share."""
    flags = (*TINY, "--optimizer", "muon", "--parallel", parallel, "--plan-gpu", "h100-80")
    one, four = plan_of(*flags), plan_of(*flags, "--plan-world-size", "4")
    flops = [sum(o.cost.flops for o in newton_schulz_ops(p)) for p in (one, four)]
    assert 0.25 * flops[0] < flops[1] < 0.5 * flops[0]
    gathers = [o for o in four.kernels.sequence() if o.phase == "optimizer" and o.cost.comm == "all-gather"]
    assert len(gathers) >= 3 and not [o for o in one.kernels.sequence() if o.cost.kind == "comm"]


@pytest.mark.slow  # 14 blocks traced whole beside the two shallow traces
def test_a_deep_ddp_muon_plan_takes_the_ranks_share_at_its_depth(monkeypatch):
    """A deep model is planned from 3 and 4 of its blocks; over 8 ranks each takes ceil(n / 8) of a
    shape's n matrices: 1 of 3 and of 4, 2 of 14. The share is a ceiling, so no line through the two
    shallow plans gives it: both are priced at the model's own count, and the deep plan's
    Newton-Schulz work and all-gathers are the whole model's trace's."""
    flags = (*TINY, "--n-layers", "14", "--optimizer", "muon", "--parallel", "ddp", "--plan-world-size", "8")
    cfg, target = planner.planned_config(*parse_args([*flags, "--plan-gpu", "h100-80"]))
    deep = dataclasses.replace(planner.trace(cfg, target, 8), card=gpus.card("h100-80"))
    monkeypatch.setattr(planner.depth, "traced_layers", lambda *a: None)
    planner.TRACED.clear()
    whole = dataclasses.replace(planner.trace(cfg, target, 8), card=gpus.card("h100-80"))
    assert deep.depths == (3, 4, 14) and not whole.depths

    def muon(plan: planner.Plan) -> tuple[float, float]:
        step = plan.step_time()
        work = sum(k.flops * k.count for k in step.kernels if k.label.startswith("Newton-Schulz"))
        gathered = sum(k.bytes * k.count for k in step.kernels if k.label == "Muon all-gather")
        assert step.parts["communication"] >= 0
        return work, gathered

    assert muon(deep) == pytest.approx(muon(whole), rel=1e-6)


def test_mfu_is_the_models_whatever_the_kernels():
    """MFU counts the model's FLOPs per token: fastpt's fused linear + cross-entropy (auto) and
    PyTorch's (torch) give the same MFU x step time; its extra work shows in the time only."""
    steps = [plan_of(*TINY, "--kernels", k, "--plan-gpu", "h100-80").step_time() for k in ("auto", "torch")]
    model_flops = [s.mfu * s.seconds for s in steps]
    assert model_flops[0] == pytest.approx(model_flops[1], rel=1e-12)
    assert steps[0].hfu > 0 and steps[0].seconds != steps[1].seconds


def model_and_kernel_flops(plan: planner.Plan) -> tuple[float, float, float]:
    """One GPU's step: MFU's numerator (the model's FLOPs), what its forward and backward kernels do
    (the optimizer's Newton-Schulz and clipping left out), and its attention forwards' FLOPs."""
    log = plan.kernels
    ops = [o for o in log.sequence() if o.phase != "optimizer"]
    attention = sum(o.cost.flops for o in ops if o.cost.kind == "attention" and not o.cost.backward)
    return log.flops_per_token * log.tokens / log.world_size, sum(o.cost.flops for o in ops), attention


def check_hfu_covers_mfu(plan: planner.Plan, recomputed: bool) -> None:
    """HFU >= MFU; without activation checkpointing the kernels do exactly the model's FLOPs (norm
    scales aside) plus FlashAttention's backward recomputing the causal scores (half a forward)."""
    step = plan.step_time()
    model, kernels, attention = model_and_kernel_flops(plan)
    assert step.hfu >= step.mfu and kernels >= model
    if not recomputed:
        assert kernels - attention / 2 == pytest.approx(model, rel=5e-3)


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--recipe", "modern"),
        ("--recipe", "modern-relu2"),
        ("--recipe", "modern-softcap"),
        ("--recipe", "modern-unet"),
        ("--activation-checkpointing", "full"),
        ("--recipe", "modern", "--activation-checkpointing", "selective"),
    ],
    ids=lambda f: " ".join(f) or "seed",
)
def test_hfu_is_at_least_mfu_and_mfu_counts_the_kernels_matmuls(flags):
    """MFU's numerator (ModelConfig.flops_per_token) is no more than the step's kernels do: an untied
    input embedding (modern's) is a lookup, not a matmul, and causal attention does half the scores."""
    check_hfu_covers_mfu(plan_of(*TINY, *flags, "--plan-gpu", "h100-80"), "--activation-checkpointing" in flags)


@pytest.mark.slow  # ~20 s of traces
@pytest.mark.parametrize("preset", ["0.04b", "0.1b", "0.35b", "1b"])
def test_hfu_is_at_least_mfu_on_every_preset(preset):
    """Each preset's widths, vocabulary and sequence, at 2 of its blocks: FLOPs are counted per block,
    and the head's share, which the fewer blocks raise, is held as well."""
    for flags in ((), ("--recipe", "modern"), ("--activation-checkpointing", "full")):
        plan = plan_of("--preset", preset, "--n-layers", "2", *flags, "--plan-gpu", "h100-80")
        check_hfu_covers_mfu(plan, "--activation-checkpointing" in flags)


def test_a_batch_warmup_is_priced_at_the_micro_batches_its_ramp_trains():
    """The first 100 of 1,000 steps ramp 1 -> 4 micro-batches: the same full step, but the run is
    priced without the forward and backward of the micro-batches the ramp leaves out, and says so."""
    flags = (*TINY, "--grad-accum", "4", "--max-steps", "1000")
    full, ramp = (plan_of(*flags, *more, "--plan-gpu", "h100-80") for more in ((), ("--batch-warmup-steps", "100")))
    step = ramp.step_time()
    assert step.seconds == full.step_time().seconds
    left_out = 100 * 4 - sum(1 + 3 * s // 100 for s in range(100))
    per_micro = (step.parts["forward"] + step.parts["backward"]) / 4
    assert planner.to_json(full)["run_s"] == pytest.approx(1000 * step.seconds)
    assert planner.to_json(ramp)["run_s"] == pytest.approx(1000 * step.seconds - left_out * per_micro)
    line = next(line for line in planner.describe(ramp) if line.startswith("  1,000 steps"))
    assert "(the first 100 ramping 4 -> 16 sequences per rank: " in line and " ms a step on average)" in line


def test_no_printed_figure_rounds_to_zero():
    """336 tok/s over 8 GPUs is '42 per GPU', not '0k'; 0.04 ms of optimizer is not '0.0'."""
    assert report.count(336 / 8) == "42" and report.count(336_000) == "336k" and report.count(0.3) == "0.3"
    assert report.figure(0.04) == "0.04" and report.figure(0.0004, 2) == "0.0004" and report.figure(0.0) == "0.0"
    assert report.duration(0.4) == "0.4s" and report.duration(3 * 3600 + 300) == "3h05m"
    assert planner.gib(2**20) == "0.00098 GiB"


def test_the_plan_prices_the_run_and_names_its_link():
    """GPU-hours for max_steps on every GPU, a cost with --plan-price, the link of a many-GPU plan."""
    plan = plan_of(*TINY, "--parallel", "ddp", "--plan-world-size", "2", "--plan-price", "2.5", "--plan-gpu", "l40s")
    step, record = plan.step_time(), planner.to_json(plan)
    assert record["gpu_hours"] == pytest.approx(step.seconds * 10_000 * 2 / 3600)
    assert record["cost_usd"] == pytest.approx(2.5 * record["gpu_hours"])
    line = next(line for line in planner.describe(plan) if line.startswith("  10,000 steps = "))
    assert "on 2 GPUs" in line and " per GPU-hour" in line and "link assumed: PCIe 4.0 x16" in line


@pytest.mark.parametrize("price", ["-1", "1e308"])
def test_a_price_out_of_range_is_refused(price):
    """A negative price, or one so large the run cost $inf."""
    cli, config_file = parse_args([*TINY, "--plan-price", price, "--plan-gpu", "h100-80"])
    with pytest.raises(ConfigError, match=re.escape(f"'plan_price' must be in [0, 1000], got {float(price)}")):
        planner.planned_config(cli, config_file)


@pytest.mark.parametrize(
    "cuda_name, key",
    [
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 80GB HBM3", "h100-80"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA GeForce RTX 3090", "3090"),
        ("NVIDIA RTX A6000", "a6000"),
    ],
)
def test_a_renters_card_is_known_by_its_cuda_name(cuda_name, key):
    assert gpus.speed_of(gpus.Card(cuda_name, 24 * gpus.GIB)) is gpus.SPEEDS[key]
    assert gpus.speed_of(gpus.card(key)) is gpus.SPEEDS[key]


def test_the_step_names_the_clock_that_bounds_it():
    """The tiny step at 4 x 64 is launch-bound: the CPU side is the step, the stream idles (`overhead`);
    at 64 x 512 on an L4 the same kernels have 128x the work and the GPU bounds the step. The plan's
    line and its JSON name the clock."""
    small = plan_of(*TINY, "--plan-gpu", "h100-80")
    large = plan_of(*TINY[:-4], "--micro-batch", "64", "--seq-len", "512", "--plan-gpu", "l4")
    for plan, bound in ((small, "CPU"), (large, "GPU")):
        step, record = plan.step_time(), planner.to_json(plan)
        line = next(line for line in planner.describe(plan) if line.startswith("step on "))
        assert step.bound == record["bound"] == bound and f"; {bound}-bound)" in line
        assert record["cpu_ms"] == pytest.approx(step.cpu_seconds * 1e3)
    host, gpu = small.step_time(), large.step_time()
    assert host.seconds == pytest.approx(host.cpu_seconds, rel=0.05) and host.parts["overhead"] > 0.5 * host.seconds
    assert gpu.cpu_seconds < 0.5 * gpu.seconds and gpu.parts["overhead"] < 0.05 * gpu.seconds


def test_the_host_prices_eager_ops_by_where_they_run_and_each_compiled_graph_call():
    """Eager: an op called from Python (forward, optimizer) costs EAGER_FORWARD_US, one the autograd
    engine runs EAGER_BACKWARD_US, per launch. Compiled (the whole model one graph): each micro-step
    calls its forward and its backward graph once, GRAPH_CALL_US each, on top of the kernels' launches."""
    eager = plan_of(*TINY, "--plan-gpu", "h100-80").kernels.ops
    for o in (o for o in eager if o.cost.kind not in ("free", "sync") and o.micro == 1):
        per_launch = timing.EAGER_BACKWARD_US if o.phase == "backward" else timing.EAGER_FORWARD_US
        assert o.cpu_us == pytest.approx(per_launch * o.cost.launches), o.label
    compiled = plan_of(*TINY, "--compile", "--plan-gpu", "h100-80").kernels.ops
    calls = [o for o in compiled if o.micro == 1 and o.phase != "optimizer" and o.cpu_us >= timing.GRAPH_CALL_US]
    assert [o.phase for o in calls] == ["forward", "backward"]


# ---- the committed table of planned step times, and eager vs compiled


@pytest.mark.parametrize("name, entry", table_entries(TABLE))
def test_planned_times_hold(name, entry):
    """A change that moves a fixed config's planned step time by more than 3% fails here, naming the
    config and the kernels that moved. FASTPT_UPDATE_PLANS=1 writes the new values instead."""
    step = plan_of(*entry["flags"].split()).step_time()
    kernels = {f"{k.label} ({k.phase})": round(k.seconds * 1e6, 1) for k in step.kernels[:8]}
    if os.environ.get("FASTPT_UPDATE_PLANS"):
        update_table(TABLE, name, step_ms=round(step.seconds * 1e3, 3), kernels_us=kernels)
        return
    change = step.seconds * 1e3 / entry["step_ms"] - 1
    moved = [
        f"{k}: {entry['kernels_us'].get(k, 0):,.0f} -> {kernels.get(k, 0):,.0f} µs"
        for k in sorted(set(kernels) | set(entry["kernels_us"]))
        if abs(kernels.get(k, 0) - entry["kernels_us"].get(k, 0))
        > 0.03 * max(kernels.get(k, 0), entry["kernels_us"].get(k, 0))
    ]
    assert abs(change) <= 0.03, (
        f"{name}: planned {step.seconds * 1e3:.2f} ms, table {entry['step_ms']:.2f} ms ({change:+.1%}); moved: "
        + "; ".join(moved)
    )


@pytest.mark.slow
@pytest.mark.parametrize("gpu", ["h100-80", "h200"])
def test_the_compiled_step_plans_faster_than_the_eager_one(gpu):
    """The mission's 'eager vs compiled in CI', for a GPU: the 0.04b preset, its default batch."""
    eager, compiled = (plan_of("--preset", "0.04b", *extra, "--plan-gpu", gpu) for extra in ((), ("--compile",)))
    t_eager, t_compiled = eager.step_time(), compiled.step_time()
    assert t_compiled.seconds < t_eager.seconds, (t_eager.kernels[:8], t_compiled.kernels[:8])
    assert t_compiled.launches < t_eager.launches
