"""Launch heuristics shared by the kernels."""

import functools

import torch


def num_warps(block_elements: int) -> int:
    """Warps for a program that holds `block_elements` values (Liger's heuristic)."""
    if block_elements >= 32768:
        return 32
    if block_elements >= 8192:
        return 16
    if block_elements >= 2048:
        return 8
    return 4


# Launches planned for a device that is not here: the AOT test sets an H200's 132 and plans on
# meta tensors. None: the tensor's own device decides.
SM_COUNT: int | None = None
PROGRAMS_PER_SM = 4


@functools.lru_cache
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (SM_COUNT when set); 1 for the CPU interpreter."""
    if SM_COUNT is not None:
        return SM_COUNT
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 1


def max_programs(device: torch.device) -> int:
    """Programs that fill the device once; the CPU interpreter gets a few to exercise the reduction."""
    return PROGRAMS_PER_SM * sm_count(device)
