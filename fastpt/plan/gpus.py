"""What a CUDA GPU holds that a step traced over fake CPU tensors does not show, and the cards a
plan is measured against: the CUDA context, the cuBLAS workspace, the scratch that kernels allocate
inside (a fake implementation gives only an op's outputs), the cards' memory."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from fastpt.errors import ConfigError, suggest
from fastpt.kernels import scratch

GIB = 2**30
MIB = 2**20
# The card's whole memory, as nvidia-smi's memory.total reports it (MiB).
GPUS = {
    "h100-80": ("H100 80GB", 81559),
    "h200": ("H200", 143771),
    "a100-40": ("A100 40GB", 40960),
    "a100-80": ("A100 80GB", 81920),
    "l4": ("L4", 23034),
    "4090": ("RTX 4090", 24564),
    "h100-pcie": ("H100 PCIe", 81559),
    "l40s": ("L40S", 46068),
    "a10g": ("A10G", 23028),
    "3090": ("RTX 3090", 24576),
    "a6000": ("RTX A6000", 49140),
    # Meta's Grand Teton hosts (torchtitan's benchmarks): 96 GB of HBM2e; MiB as on the 80 GB card,
    # whose nvidia-smi reports 81,559 of its 81,920
    "h100-96": ("H100 96GB HBM2e", 97870),
}
# A bound on --plan-gpu NGiB (sixteen times today's largest cards' memory): past it a size is a
# mistake, and too large a number would overflow the byte count.
LARGEST_CARD = 4096 * GIB
# What a CUDA process holds outside torch's allocator: the CUDA context with lazily loaded kernels,
# the cuBLAS / cuDNN handles and their libraries' modules: 0.3-0.6 GiB on recent drivers. An
# estimate until bench/gpu.sh measures it (nvidia-smi's used memory less torch's reserved).
CUDA_CONTEXT = GIB // 2
# cuBLAS keeps a workspace per (handle, stream), allocated through torch's caching allocator at a
# thread's first matmul and held for the process. PyTorch's handle pool gives each thread its own
# handle, and a backward runs on autograd's device thread, not the forward's: a training step holds
# two workspaces, and a cuBLASLt workspace per handle (TORCH_CUBLASLT_WORKSPACE_SIZE, 1 MiB).
CUBLAS_WORKSPACE = 32 * MIB  # PyTorch's default on Hopper (CUBLAS_WORKSPACE_CONFIG :4096:8)
CUBLAS_WORKSPACE_BEFORE_HOPPER = 8 * MIB + 128 * 2**10  # Ampere, Ada (:4096:2:16:8)
CUBLASLT_WORKSPACE = MIB
BEFORE_HOPPER = {"a100-40", "a100-80", "l4", "4090", "l40s", "a10g", "3090", "a6000"}


@dataclass
class Card:
    name: str
    total: int  # bytes
    free: int | None = None  # this machine's own GPU: what was free on it when asked (others' use aside)

    def __str__(self) -> str:
        if self.free is not None:
            return f"{self.name} ({self.free / GIB:.1f} GiB free of {self.total / GIB:.1f} GiB)"
        return (
            f"{self.name} of {self.total / GIB:.1f} GiB"
            if self.name == "a card"
            else f"{self.name} ({self.total / GIB:.1f} GiB)"
        )

    @property
    def usable(self) -> int:
        """What a run may fill: the whole card, or on this machine's own GPU what is free plus this
        process's CUDA context, which it holds already (asking made it) and which a plan's need counts."""
        return self.total if self.free is None else self.free + CUDA_CONTEXT


def card(spec: str) -> Card | None:
    """--plan-gpu: a known card, 'NGiB' (or G, or a bare number of GiB), 'NGB' (10^9 bytes, as a
    spec sheet's '48 GB'), or '' for this machine's GPU (None without one)."""
    if not spec:
        return own_card()
    if spec.lower() in GPUS:
        name, mib = GPUS[spec.lower()]
        return Card(name, mib * MIB)
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*(gib|g|gb)?", spec.strip().lower()):
        size = float(m[1]) * (10**9 if m[2] == "gb" else GIB)  # inf for a 400-digit number
        if size <= CUDA_CONTEXT:
            raise ConfigError(
                f"'plan_gpu' = {spec!r} holds no more than the CUDA context ({CUDA_CONTEXT / GIB:.1f} GiB): "
                "give the card's memory, such as 24GiB"
            )
        if size > LARGEST_CARD:
            raise ConfigError(  # a model number (5090) read as GiB: say which cards there are
                f"'plan_gpu' = {spec!r} is larger than any card ({LARGEST_CARD // GIB:,} GiB at most): give one of "
                f"{', '.join(GPUS)}, or the card's memory, such as 32GiB"
            )
        return Card("a card", int(size))
    raise ConfigError(
        f"'plan_gpu' = {spec!r} is not a card: one of {', '.join(GPUS)}, or a size such as 24GiB"
        + suggest(spec.strip().lower(), GPUS)
    )


def cublas_workspaces(spec: str) -> list[int]:
    """The cuBLAS and cuBLASLt workspaces of a training step (the forward's thread and the
    backward's) on the card --plan-gpu names; Hopper's, the larger, where it names none known."""
    each = CUBLAS_WORKSPACE_BEFORE_HOPPER if spec.lower() in BEFORE_HOPPER else CUBLAS_WORKSPACE
    return [each, each, CUBLASLT_WORKSPACE, CUBLASLT_WORKSPACE]


def own_card() -> Card | None:
    """This process's GPU (LOCAL_RANK's under torchrun; None without one), made its device before
    anything asks it: asking makes a CUDA context, which must not be on GPU 0 for every rank. Its
    free memory is what the plan must fit: other processes may hold some."""
    if not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    free, total = torch.cuda.mem_get_info(index)
    return Card(f"{torch.cuda.get_device_name(index)} cuda:{index}", total, free)


# ---- what a CUDA kernel allocates inside, beyond its outputs


def flash_backward_bytes(args: tuple, out: object) -> int:
    """CUDA flash attention's backward: an fp32 dq accumulator (rows to 128, head dim to 32) and
    softmax statistics; with GQA, dk and dv at the full head count before their sum over groups."""
    q, k = args[1], args[2]
    b, h, t, hd = q.shape
    rows, width = -(-t // 128) * 128, -(-hd // 32) * 32
    gqa = 2 * b * t * h * hd * q.dtype.itemsize if k.shape[1] != h else 0
    return b * rows * h * width * 4 + b * h * rows * 4 + gqa


def linear_cross_entropy_bytes(args: tuple, out: object) -> int:
    input, weight, compute_dtype = args[0], args[1], args[6]
    return scratch.linear_cross_entropy_bytes(input, weight, compute_dtype)


def scratch_table() -> dict:
    fastpt_ops = torch.ops.fastpt
    return {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: flash_backward_bytes,
        fastpt_ops.linear_cross_entropy.default: linear_cross_entropy_bytes,
        fastpt_ops.linear_cross_entropy_backward.default: linear_cross_entropy_bytes,
    }


def machine_card() -> Card:
    """This machine's memory, the card of a plan for a CPU run."""
    return Card("this machine's memory", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# ---- how fast a card is (the step-time plan, plan.timing)


@dataclass(frozen=True)
class Speed:
    """A card's speed, from its vendor's data sheet (docs/performance.md names each), and the share
    of it that a large kernel reaches: measured where this project measured the card, else assumed."""

    bf16_tflops: float  # dense bf16 / fp16 tensor-core TFLOP/s with fp32 accumulate (PyTorch's)
    tf32_tflops: float  # dense TF32 tensor-core TFLOP/s
    fp32_tflops: float  # fp32 without tensor cores (PyTorch's default for fp32 matmuls)
    hbm_gbs: float  # memory bandwidth, GB/s
    sms: int  # streaming multiprocessors
    link_gbs: float  # GPU-to-GPU bandwidth per direction, GB/s (NVLink, else PCIe)
    link: str
    matmul_eff: float  # a large bf16 matmul's share of bf16_tflops
    copy_eff: float  # a large device copy's share of hbm_gbs
    measured: str = ""  # where matmul_eff and copy_eff were measured ('' : assumed)


# H200: measured by this project on 2026-11-30 (693-707 TFLOP/s bf16 matmul, 4.22 TB/s copy); the
# H100 SXM has the same GH100 compute and clocks, so its matmul share is the H200's (S. Bekman's
# published Maximum Achievable Matmul FLOPS finds the two the same). The A100's is that table's A100
# SXM figure brought to the same measure: 86.9% x (0.708 / the H100-H200's 80.3%) = 0.766.
A100_MATMUL = round(0.869 * 0.708 / 0.803, 3)
SPEEDS = {
    "h100-80": Speed(989.4, 494.7, 66.9, 3350, 132, 450, "NVLink 4", 0.708, 0.85),
    "h200": Speed(989.4, 494.7, 66.9, 4800, 132, 450, "NVLink 4", 0.708, 0.879, "H200, 2026-11-30"),
    "a100-40": Speed(312, 156, 19.5, 1555, 108, 300, "NVLink 3", A100_MATMUL, 0.85),
    "a100-80": Speed(312, 156, 19.5, 2039, 108, 300, "NVLink 3", A100_MATMUL, 0.85),
    "l4": Speed(121, 60, 30.3, 300, 58, 32, "PCIe 4.0 x16", 0.75, 0.85),
    "4090": Speed(165.2, 82.6, 82.6, 1008, 128, 25, "PCIe 4.0 x16, no P2P", 0.75, 0.85),
    "h100-pcie": Speed(756.5, 378, 51.2, 2000, 114, 64, "PCIe 5.0 x16", 0.708, 0.85),
    "l40s": Speed(362.05, 183, 91.6, 864, 142, 32, "PCIe 4.0 x16", 0.75, 0.85),
    "a10g": Speed(125, 62.5, 31.2, 600, 72, 32, "PCIe 4.0 x16", 0.75, 0.85),
    "3090": Speed(71, 35.6, 35.6, 936, 82, 32, "PCIe 4.0 x16", 0.75, 0.85),
    "a6000": Speed(154.8, 77.4, 38.7, 768, 84, 32, "PCIe 4.0 x16", 0.75, 0.85),
    # torchtitan's benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: 2.4 TB/s, at a 500 W power
    # limit (not modelled: the H100 SXM's compute, which at 700 W it may not sustain at 500 W)
    "h100-96": Speed(989.4, 494.7, 66.9, 2400, 132, 450, "NVLink 4", 0.708, 0.85),
}


def speed_of(gpu: Card) -> Speed | None:
    """The speed of a named card (a --plan-gpu name, or this machine's GPU by its CUDA name); None
    for a card given by its size or one not in SPEEDS."""
    for key, (name, _) in GPUS.items():
        if gpu.name == name:
            return SPEEDS[key]
    cuda_name = gpu.name.upper()
    names = (("h200", "H200"), ("h100-pcie", "H100 PCIE"), ("h100-96", "H100 96GB"), ("h100-80", "H100"))
    names += (("l40s", "L40S"), ("l4", " L4"))
    names += (("a10g", "A10G"), ("3090", "3090"), ("a6000", "A6000"), ("4090", "4090"))
    for key, model in names:
        if model in cuda_name:
            return SPEEDS[key]
    if "A100" in cuda_name:
        return SPEEDS["a100-80" if gpu.total > 48 * GIB else "a100-40"]
    return None
