"""A deep model planned from two shallow traces: its identical blocks traced twice, not once per block.

The planner traces the same model with a and a + period blocks (traced_layers) and extrapolates
every figure along the line through the two plans (extrapolated_peak here; the parameters and the
step time in plan.planner and plan.timing). The first block and the last differ from the rest
(their neighbours are the embedding and the head; FSDP prefetches a next block into all but the
last; the peak may sit in the first block's backward), so a has FIRST_LAYERS: the first, a middle
one and the last. A choice that repeats every other block (U-net skips) takes
a period of two blocks and an a of the model's parity; a compiled graph's kernels alternate from one
depth to the next, so compiled traces are two blocks apart too (the line then averages over both).
tests/test_plan.py holds the result to the whole model's trace.
"""

from __future__ import annotations

from fastpt.config import TrainConfig
from fastpt.plan.memory import Peak
from fastpt.presets import ModelConfig

FIRST_LAYERS = 3


def traced_layers(cfg: TrainConfig, mcfg: ModelConfig) -> tuple[int, int] | None:
    """The two block counts the model is planned from; None when tracing them would cost more than
    half of tracing the model itself (then it is traced whole)."""
    alternate = mcfg.unet_skips
    period = 2 if alternate or cfg.compile else 1
    a = FIRST_LAYERS + ((mcfg.n_layers - FIRST_LAYERS) % 2 if alternate else 0)
    return (a, a + period) if 2 * (2 * a + period) <= mcfg.n_layers else None


def extrapolated_peak(a: Peak, b: Peak, k: float, fragmentation: int) -> Peak:
    """The peak of the model k times as many blocks deeper than a's as b's is: its bytes and each
    part on the line through a's and b's; where it is and its largest transient, b's; the reserve,
    the peak and `fragmentation` (below)."""
    line = lambda x, y: round(x + (y - x) * k)
    parts = {p: line(a.parts.get(p, 0), b.parts.get(p, 0)) for p in {**a.parts, **b.parts}}
    nbytes = line(a.bytes, b.bytes)
    reserved = nbytes + fragmentation if b.reserved else 0
    return Peak(nbytes, parts, nbytes - sum(parts.values()), b.largest, b.where, reserved)


def fragmentation(a: Peak, b: Peak) -> int:
    """The caching allocator's reserve beyond its peak, of the deeper model: the larger of a's and
    b's. No line through two depths holds it: it moves unevenly with the depth, by a few percent of
    the reserve from one block more to the next, either way (1b, compiled, 16 x 2048: 0.7, 0.6, 1.5,
    1.0 and 1.1 GiB at 3 to 7 blocks, 1.3 GiB at its 22), so a line's slope would multiply that
    noise by the depth; the plan's peak, which the verdict and the margins rest on, is on its line."""
    return max(a.reserved - a.bytes, b.reserved - b.bytes)
