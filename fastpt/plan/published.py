"""The published runs the step-time plan is checked against: measured training runs of other projects
that fastpt can express, each with the flags that express it, the step its source reports and the
step this planner gives it. ERROR_BAND (the median and worst |planned / reported - 1|) is what
--plan prints as its error; tests/test_timing.py re-plans every run (slow) and fails when a planned
step here is no longer the planner's. Sources, and why each run is expressed so: docs/performance.md,
"Published runs". Runs fastpt cannot express (other kernels, collectives across hosts) are not here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    name: str
    card: str  # --plan-gpu
    gpus: int  # --plan-world-size
    flags: str
    reported_ms: float  # the source's step: tokens per step / its reported tokens per second, or its step time

    @property
    def argv(self) -> list[str]:
        return [*self.flags.split(), "--plan-gpu", self.card, "--plan-world-size", str(self.gpus)]

    @property
    def error(self) -> float:
        """planned / reported - 1, the plan's error on this run."""
        return PLANNED_MS[self.name] / self.reported_ms - 1


def shape(d: int, layers: int, heads: int, vocab: int, seq: int, micro: int, accum: int, ffn: int = 0) -> str:
    """A run's shape as fastpt's flags; the FFN 8D/3 rounded up to 64 (SwiGLU with a 4x MLP's FLOPs)."""
    ffn = ffn or -(-(8 * d // 3) // 64) * 64
    return (
        f"--preset 0.1b --dim {d} --n-layers {layers} --n-heads {heads} --ffn-dim {ffn} --vocab-size {vocab} "
        f"--seq-len {seq} --max-seq-len {seq} --micro-batch {micro} --grad-accum {accum}"
    )


MPT = " --compile --parallel fsdp"  # MosaicML llm-foundry's benchmark tables: FSDP, Triton flash attention
MNG = (  # modded-nanogpt records 6 and 7: Muon over the ranks, ReLU^2, QK-norm, compiled
    shape(768, 12, 6, 50304, 1024, 64, 1, ffn=3072)  # relu2's own width (format-1 configs wrote 2048 and meant 3/2 x)
    + " --mlp relu2 --qk-norm --tie-embeddings --kernels torch --compile --optimizer muon --parallel ddp"
)
LLAMA3_8B = (  # torchtitan's Llama 3.1 8B, December 2024: FSDP2, bf16, selective AC
    shape(4096, 32, 32, 128256, 8192, 2, 1, ffn=14336)
    + " --n-kv-heads 8 --rope-theta 500000 --no-tie-embeddings --parallel fsdp --activation-checkpointing selective"
)
# reported_ms: MPT's GlobalBatchSize (tokens) / Throughput (T/s) where llm-foundry's README at b2a43a14 is
# typed in (bench/results/2026-12-04-cpu-published-plans/mpt_sweeps.py), else docs/performance.md's step;
# modded-nanogpt's logs' final step_avg; torchtitan's tokens per step per GPU / its TPS per GPU.
RUNS = [
    Run("MPT-125M", "a100-80", 8, shape(768, 12, 12, 50368, 2048, 32, 2) + MPT, 925),
    Run("MPT-350M", "a100-80", 8, shape(1024, 24, 16, 50368, 2048, 32, 2) + MPT, 8 * 32 * 2048 * 2 / 470263e-3),
    Run("MPT-760M", "a100-80", 8, shape(1536, 24, 12, 50368, 2048, 24, 2) + MPT, 8 * 24 * 2048 * 2 / 259472e-3),
    Run("MPT-1B", "a100-80", 8, shape(2048, 24, 16, 50368, 2048, 14, 4) + MPT, 8 * 14 * 2048 * 4 / 164109e-3),
    Run("MPT-1B H100", "h100-80", 8, shape(2048, 24, 16, 50368, 2048, 14, 1) + MPT, 8 * 14 * 2048 / 363645e-3),
    Run("MPT-760M H100", "h100-80", 8, shape(1536, 24, 12, 50368, 4096, 12, 2) + MPT, 8 * 12 * 4096 * 2 / 443674e-3),
    Run("MPT-3B H100", "h100-80", 8, shape(2560, 32, 20, 50368, 4096, 5, 6) + MPT, 8 * 5 * 4096 * 6 / 167712e-3),
    Run("MPT-7B H100", "h100-80", 8, shape(4096, 32, 32, 50368, 2048, 6, 1) + MPT, 1155),
    Run("MPT-3B A100 40GB", "a100-40", 8, shape(2560, 32, 20, 50368, 2048, 5, 8) + MPT, 8139),
    Run(
        "MPT-7B A100 40GB, AC",
        "a100-40",
        8,
        shape(4096, 32, 32, 50368, 2048, 12, 4) + MPT + " --activation-checkpointing full",
        26717,
    ),
    Run("modded-nanogpt record 6", "h100-80", 8, MNG, 153.84),
    Run("modded-nanogpt record 7", "h100-80", 8, MNG, 141.82),
    Run("torchtitan Llama 3.1 8B", "h100-80", 8, LLAMA3_8B, 2 * 8192 / 5762e-3),
    Run("torchtitan Llama 3.1 8B, compiled", "h100-80", 8, LLAMA3_8B + " --compile", 2 * 8192 / 6667e-3),
]

# What this planner gives each run: tests/test_timing.py::test_the_published_runs_plan_as_committed re-plans
# them (slow) and fails naming a run whose plan moved; FASTPT_UPDATE_PLANS=1 rewrites these.
PLANNED_MS = {
    "MPT-125M": 731.0,
    "MPT-350M": 2007.7,
    "MPT-760M": 2888.4,
    "MPT-1B": 5550.3,
    "MPT-1B H100": 508.9,
    "MPT-760M H100": 1265.8,
    "MPT-3B H100": 4797.9,
    "MPT-7B H100": 1009.2,
    "MPT-3B A100 40GB": 8062.5,
    "MPT-7B A100 40GB, AC": 25168.8,
    "modded-nanogpt record 6": 160.3,
    "modded-nanogpt record 7": 160.3,
    "torchtitan Llama 3.1 8B": 2028.8,
    "torchtitan Llama 3.1 8B, compiled": 1816.2,
}


def band(runs: list[Run]) -> tuple[float, float]:
    """The median and the worst |planned / reported - 1| over the runs."""
    errors = [abs(run.error) for run in runs]
    return statistics.median(errors), max(errors)


ERROR_BAND = band(RUNS)
CARDS = sorted({run.card for run in RUNS})  # the cards the band was measured on
