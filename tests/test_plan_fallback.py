"""A plan on fastpt's kernels (--kernels auto on CUDA) also plans the PyTorch fallback that a kernel
failing its self-check would switch the run to, and says before the run starts whether it fits."""

import dataclasses

import pytest
from test_plan import plan_of

from fastpt.plan import fit
from fastpt.plan.gpus import Card

# Wide and shallow, eager: the fallback's RMSNorm keeps its fp32 product for the backward, the kernel
# only its statistics, so the fallback needs ~0.1 GiB more.
WIDE = "--preset tiny --vocab-size 512 --dim 1024 --n-layers 2 --n-heads 8 --ffn-dim 256 --micro-batch 16 --seq-len 256"


def test_a_plan_says_when_the_fallback_would_not_fit():
    """On a card between the two plans the kernels' plan fits and its fallback line says 'does NOT
    fit'; with --kernels torch or triton (no fallback) there is no line."""
    plan = plan_of(*WIDE.split(), "--max-seq-len", "256")
    torch_plan = plan_of(*WIDE.split(), "--max-seq-len", "256", "--kernels", "torch")
    assert torch_plan.card_bytes > plan.card_bytes
    plan.card = Card("a card", (plan.card_bytes + torch_plan.card_bytes) // 2)
    assert plan.fits()
    [line] = fit.fallback(plan)
    assert line.startswith("if a kernel fails its self-check, the PyTorch fallback needs ") and "does NOT fit" in line
    for kernels in ("torch", "triton"):
        assert fit.fallback(dataclasses.replace(plan, cfg=dataclasses.replace(plan.cfg, kernels=kernels))) == []


def test_a_plan_with_room_for_the_fallback_traces_it_not(monkeypatch):
    """fallback_extra bounds what the fallback needs beyond the kernels (here, the traced difference);
    with that much to spare the line says the fallback fits too, and no second trace is made."""
    plan = plan_of(*WIDE.split(), "--max-seq-len", "256")
    torch_plan = plan_of(*WIDE.split(), "--max-seq-len", "256", "--kernels", "torch")
    extra = fit.fallback_extra(plan.cfg)
    assert torch_plan.card_bytes - plan.card_bytes <= extra
    plan.card = Card("a roomy card", plan.card_bytes + extra + 2**30)
    monkeypatch.setattr(fit, "trace", lambda *args: pytest.fail("the fallback was traced"))
    [line] = fit.fallback(plan)
    assert line.startswith("if a kernel fails its self-check, the PyTorch fallback fits too")
