"""Fused head projection + cross-entropy, chunked over rows so the (N, V) logits never exist.

Per chunk: logits = x @ W.T (torch matmul, fp32 accumulation), the cross-entropy kernel turns
them into the gradient in place, then dx = grad @ W and dW += grad.T @ x into an fp32
accumulator. Extra memory is one chunk of logits plus the fp32 dW. Every chunk reads and writes
the whole dW (131 MB at 32000 x 512), so chunks are large: 8 of 4096 rows at 32k tokens x 32k vocab.

The chunk's logits have a row stride rounded up to ROW_ALIGN elements (W is zero-padded to that
many rows for the matmul; the kernel reads the padding, treats it as -inf and writes it a zero
gradient): with an odd vocabulary such as GPT-2's 50257 the rows would otherwise be misaligned
and the masks ragged, and the kernel's loads and stores 16-bit scalars, not 128-bit.
"""

import functools

import torch

from ..scratch import ROW_ALIGN, chunk_rows
from .cross_entropy import cross_entropy_forward


@functools.lru_cache
def _addmm_accumulates_in_fp32(device: torch.device) -> bool:
    """Whether addmm can add a bf16 product straight into an fp32 tensor here, keeping the sum in
    fp32: recent torch on CUDA only (older releases require `self` in the inputs' dtype), so ask
    once per device, and check the value: 1 + 2**-10 survives fp32 but rounds to 1 in bf16."""
    acc = torch.ones(1, 1, device=device)
    a, b = (torch.full((1, 1), v, device=device, dtype=torch.bfloat16) for v in (2.0**-5, 2.0**-5))
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return acc.item() == 1 + 2.0**-10
    except (RuntimeError, TypeError, NotImplementedError):  # meta tensors have no value: the fallback
        return False


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, with acc fp32 and a, b possibly bf16/fp16."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _addmm_accumulates_in_fp32(acc.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).float()  # the product is rounded once, the sum over chunks stays fp32


def _padded_rows(weight: torch.Tensor, dtype: torch.dtype, multiple: int) -> torch.Tensor:
    """weight (V, D) in dtype and contiguous, zero rows appended up to a multiple of `multiple`
    (weight itself when nothing changes)."""
    pad = -weight.shape[0] % multiple
    if not pad:
        return weight.to(dtype).contiguous()
    out = weight.new_zeros((weight.shape[0] + pad, weight.shape[1]), dtype=dtype)
    out[: weight.shape[0]] = weight
    return out


def linear_cross_entropy_forward(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    compute_dtype: torch.dtype,
    z_loss: float = 0.0,
    grad_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-row fp32 losses of (input @ weight.T) against target, z-loss included, and the z-loss
    terms alone; input (N, D), weight (V, D).

    With grad_scale (0-dim or (N,)), also returns d(sum_i grad_scale[i] * loss_i) with respect to
    input (in its dtype) and weight (in fp32); otherwise None for both. Matmuls run in compute_dtype.
    softcap > 0: the loss of the logits softcap * tanh(logits / softcap), capped inside the kernel.
    """
    n_rows, n_cols = input.shape[0], weight.shape[0]
    w_padded = _padded_rows(weight, compute_dtype, ROW_ALIGN)  # (V rounded up, D): logits rows 128-byte aligned
    w = w_padded[:n_cols]  # (V, D)
    loss = torch.empty(n_rows, dtype=torch.float32, device=input.device)
    z = torch.empty_like(loss)
    dinput = dweight = None
    if grad_scale is not None:
        grad_scale = grad_scale.expand(n_rows)
        dinput = torch.empty_like(input)
        dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    chunk = chunk_rows(n_rows, w_padded.shape[0], compute_dtype)
    for start in range(0, n_rows, chunk):
        rows = slice(start, start + chunk)
        x = input[rows].to(compute_dtype)
        logits = (x @ w_padded.T)[:, :n_cols]  # (chunk, V), row stride V rounded up
        if grad_scale is None:
            loss[rows], z[rows], _ = cross_entropy_forward(
                logits, target[rows], ignore_index, z_loss, row_width=w_padded.shape[0], softcap=softcap
            )
            continue
        # The gradient overwrites the logits in place.
        loss[rows], z[rows], _ = cross_entropy_forward(
            logits, target[rows], ignore_index, z_loss, logits, grad_scale[rows], w_padded.shape[0], softcap
        )
        dinput[rows] = logits @ w
        _accumulate_mm(dweight, logits.T, x)
    return loss, z, dinput, dweight
