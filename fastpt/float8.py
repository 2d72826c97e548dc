"""--float8: torchao's float8 training (dynamic tensorwise scaling) on the blocks' linear layers.

The matmuls of each converted nn.Linear run in float8 on the tensor cores, with the inputs, weights
and output gradients scaled per tensor; weights, optimizer state and everything else keep their
dtype, so checkpoints do not change. Only the transformer blocks' projections are converted: the
LM head (tied to the embedding, or `output`) stays in high precision, as do layers with a dimension
that is not a multiple of 16, which float8 matmuls (torch._scaled_mm) cannot take.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from fastpt.errors import ConfigError, require

MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


def check(device: torch.device) -> None:
    """One line if this machine cannot train in float8: a CPU, an older GPU, or no torchao."""
    if device.type != "cuda":
        raise ConfigError(f"'float8' needs a CUDA GPU with compute capability >= 8.9 (got {device.type})")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(f"'float8' needs compute capability >= 8.9; {torch.cuda.get_device_name(device)} "
                          f"has {capability[0]}.{capability[1]}")
    require("torchao.float8", "--float8", "torchao")


def convertible(module: nn.Module, fqn: str) -> bool:
    """A linear layer inside a transformer block whose dimensions float8 matmuls take."""
    return (isinstance(module, nn.Linear) and fqn.startswith("layers.")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert(model: nn.Module) -> int:
    """Swap the convertible nn.Linear layers for torchao's Float8Linear, in place, before compiling
    and sharding (torchtitan's order); returns how many were converted."""
    require("torchao.float8", "--float8", "torchao")
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert_to_float8_training(model, module_filter_fn=convertible)
    return sum(isinstance(m, Float8Linear) for m in model.modules())
