"""Fused head projection + cross-entropy, chunked over rows so the (N, V) logits never exist.

Per chunk: logits = x @ W.T (torch matmul, fp32 accumulation), the cross-entropy kernel turns
them into the gradient in place, then dx = grad @ W and dW += grad.T @ x into an fp32
accumulator. Extra memory is one chunk of logits plus the fp32 dW.
"""
import functools

import torch
import triton

from kernels.ops.cross_entropy import cross_entropy_forward

CHUNK_BYTES = 64 * 2**20  # logits held at once; ~1K rows of a 32K vocabulary in bf16


def _chunk_rows(n_rows: int, n_cols: int, dtype: torch.dtype) -> int:
    """Rows per chunk: equal chunks, none above CHUNK_BYTES of logits."""
    bytes_per_row = n_cols * torch.finfo(dtype).bits // 8
    n_chunks = max(1, triton.cdiv(n_rows * bytes_per_row, CHUNK_BYTES))
    return max(1, triton.cdiv(n_rows, n_chunks))


@functools.lru_cache
def _addmm_accumulates_in_fp32(device: torch.device) -> bool:
    """Whether addmm can add a bf16 product straight into an fp32 tensor here: recent torch on
    CUDA only (older releases require `self` in the inputs' dtype), so ask once per device."""
    acc, one = torch.zeros(1, 1, device=device), torch.ones(1, 1, device=device, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return True


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, with acc fp32 and a, b possibly bf16/fp16."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _addmm_accumulates_in_fp32(acc.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).float()  # the product is rounded once, the sum over chunks stays fp32


def linear_cross_entropy_forward(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    compute_dtype: torch.dtype,
    z_loss: float = 0.0,
    grad_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-row fp32 losses of (input @ weight.T) against target, z-loss included, and the z-loss
    terms alone; input (N, D), weight (V, D).

    With grad_scale (0-dim or (N,)), also returns d(sum_i grad_scale[i] * loss_i) with respect to
    input (in its dtype) and weight (in fp32); otherwise None for both. Matmuls run in compute_dtype.
    """
    n_rows = input.shape[0]
    w = weight.to(compute_dtype).contiguous()
    loss = torch.empty(n_rows, dtype=torch.float32, device=input.device)
    z = torch.empty_like(loss)
    dinput = dweight = None
    if grad_scale is not None:
        grad_scale = grad_scale.expand(n_rows)
        dinput = torch.empty_like(input)
        dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    chunk = _chunk_rows(n_rows, w.shape[0], compute_dtype)
    for start in range(0, n_rows, chunk):
        rows = slice(start, start + chunk)
        x = input[rows].to(compute_dtype)
        logits = x @ w.T  # (chunk, V)
        if grad_scale is None:
            loss[rows], z[rows] = cross_entropy_forward(logits, target[rows], ignore_index, z_loss)
            continue
        # The gradient overwrites the logits in place.
        loss[rows], z[rows] = cross_entropy_forward(logits, target[rows], ignore_index, z_loss, logits,
                                                    grad_scale[rows])
        dinput[rows] = logits @ w
        _accumulate_mm(dweight, logits.T, x)
    return loss, z, dinput, dweight
