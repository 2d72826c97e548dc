"""The scratch memory the Triton launchers allocate beyond their outputs, computed without Triton:
what a memory planner adds while an op runs (an op's fake implementation shows only its outputs)."""

import contextlib
from collections.abc import Iterator

import torch

CHUNK_BYTES = 256 * 2**20  # logits held at once by linear + cross-entropy; 4K rows of a 32K vocabulary in bf16
ROW_ALIGN = 64  # elements: each chunk's logits rows padded to 128 bytes of bf16, a cache line


def chunk_rows(n_rows: int, n_cols: int, dtype: torch.dtype) -> int:
    """Rows per linear + cross-entropy chunk: equal chunks, none above CHUNK_BYTES of logits."""
    bytes_per_row = n_cols * dtype.itemsize
    n_chunks = max(1, -(-n_rows * bytes_per_row // CHUNK_BYTES))
    return max(1, -(-n_rows // n_chunks))


@contextlib.contextmanager
def chunk_limit(limit: int) -> Iterator[None]:
    """While inside, linear + cross-entropy's chunks hold at most `limit` bytes of logits: the
    self-check's few rows split into several chunks, as a run's many are."""
    global CHUNK_BYTES
    before, CHUNK_BYTES = CHUNK_BYTES, limit
    try:
        yield
    finally:
        CHUNK_BYTES = before


def linear_cross_entropy_bytes(input: torch.Tensor, weight: torch.Tensor, compute_dtype: torch.dtype) -> int:
    """Peak scratch of ops.linear_cross_entropy.linear_cross_entropy_forward with gradients, for
    input (N, D) and weight (V, D): the weight cast and padded, the per-row losses, then one chunk's
    input cast, logits, input-gradient product and row statistics (on CUDA, where dW accumulates
    in fp32 through addmm, with no product of its own)."""
    (n_rows, dim), vocab = input.shape, weight.shape[0]
    padded = vocab + -vocab % ROW_ALIGN
    item = compute_dtype.itemsize
    cast_weight = padded * dim * item if (weight.dtype != compute_dtype or padded != vocab) else 0
    rows = chunk_rows(n_rows, padded, compute_dtype)
    cast_input = rows * dim * item if input.dtype != compute_dtype else 0
    chunk = cast_input + rows * padded * item + rows * dim * item + 3 * rows * 4
    return cast_weight + 2 * n_rows * 4 + chunk
