"""Run metrics: metrics.jsonl always, TensorBoard and Weights & Biases on request; MFU."""
from __future__ import annotations

import json
import re
import resource
import sys
from pathlib import Path

import torch

# Dense bf16 tensor-core peak FLOP/s (no sparsity), by a substring of the device name.
PEAK_BF16_FLOPS = {
    "H200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12, "H800": 989e12,
    "GH200": 989e12, "B200": 2250e12, "A100": 312e12, "A800": 312e12, "A10G": 70e12,
    "A10": 125e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "RTX 4090": 165e12,
    "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12,
}


def peak_flops(device_name: str) -> float | None:
    """The table's peak for a GPU name, or None when the GPU is unknown (no guessed MFU)."""
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # "H100 NVL" before "H100"
        # Whole words only: "T4" must not match a "T400", nor "H200" a "GH200".
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", device_name):
            return PEAK_BF16_FLOPS[key]
    return None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_mem_gib(device: torch.device) -> float:
    """CUDA: max allocated by torch. CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


class MetricsLogger:
    """Appends one JSON object per logged step; mirrors scalars to TensorBoard / W&B if asked."""

    def __init__(self, run_dir: Path, config: dict, tensorboard: bool = False, wandb_project: str = ""):
        self.file = open(run_dir / "metrics.jsonl", "a")
        self.tb = self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise SystemExit("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise SystemExit("--wandb needs the wandb package: pip install wandb") from None
            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(run_dir))

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
