"""--float8: torchao's float8 training (dynamic tensorwise scaling) on the blocks' linear layers.

The matmuls of each converted nn.Linear run in float8 on the tensor cores, with the inputs, weights
and output gradients scaled per tensor; weights, optimizer state and everything else keep their
dtype, so checkpoints do not change. Only the transformer blocks' projections are converted: the
LM head (tied to the embedding, or `output`) stays in high precision, as do layers with a dimension
that is not a multiple of 16, which float8 matmuls (torch._scaled_mm) cannot take.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn as nn

from fastpt.errors import ConfigError, require

MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


# What importing torchao logs that a float8 run has no use for: its prebuilt C++/CUDA extensions that
# this torch build cannot load (float8 training is torch.compile's own code, not theirs), and the
# newer torch's note on each Enum it registers. Dropped while fastpt imports it; everything else stays.
IMPORT_NOISE = {"torchao": "Failed to load ", "torch.utils._pytree": "is an Enum subclass and is now natively"}


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """Import torchao inside this: the IMPORT_NOISE records are dropped, nothing else."""
    filters = {name: _Drop(text) for name, text in IMPORT_NOISE.items()}
    for name, f in filters.items():
        logging.getLogger(name).addFilter(f)
    try:
        yield
    finally:
        for name, f in filters.items():
            logging.getLogger(name).removeFilter(f)


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def require_torchao():
    with quiet_import():
        return require("torchao.float8", "--float8", "torchao", extra="float8")


def check(device: torch.device) -> None:
    """One line if this machine cannot train in float8: a CPU, an older GPU, or no torchao."""
    if device.type != "cuda":
        raise ConfigError(f"'float8' needs a CUDA GPU with compute capability >= 8.9 (got {device.type})")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"'float8' needs compute capability >= 8.9; {torch.cuda.get_device_name(device)} "
            f"has {capability[0]}.{capability[1]}"
        )
    require_torchao()


def convertible(module: nn.Module, fqn: str) -> bool:
    """A linear layer inside a transformer block whose dimensions float8 matmuls take."""
    return (
        isinstance(module, nn.Linear)
        and fqn.startswith("layers.")
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert(model: nn.Module) -> int:
    """Swap the convertible nn.Linear layers for torchao's Float8Linear, in place, before compiling
    and sharding (torchtitan's order); returns how many were converted."""
    require_torchao()
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert_to_float8_training(model, module_filter_fn=convertible)
    return sum(isinstance(m, Float8Linear) for m in model.modules())
