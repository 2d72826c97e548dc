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


@functools.lru_cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def max_programs(device: torch.device) -> int:
    """Programs that fill the device once; the CPU interpreter gets a few to exercise the reduction."""
    if device.type == "cuda":
        return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4
