"""Cross-entropy over the last dim with the gradient produced in the forward pass (Liger-style).

One program per row: an online softmax over vocabulary blocks gives the log-sum-exp, then a
second sweep (mostly served from L2) writes grad = scale * (softmax - onehot), formed in fp32.
The z-loss coef * lse^2 (PaLM) rides along: it adds to the row's loss, and its gradient
2 * coef * lse * softmax to the softmax term. The caller later multiplies by the upstream
gradient with `scale_rows_`, which skips rows on device when that gradient is 1, so a plain
`loss.backward()` costs no extra pass over the logits.
"""
import torch
import triton
import triton.language as tl

from kernels.ops._launch import num_warps

MAX_BLOCK = 32768  # vocabulary elements per sweep step


@triton.jit
def _cross_entropy_kernel(
    logits_ptr, logits_stride, grad_ptr, grad_stride, target_ptr, loss_ptr, z_ptr, scale_ptr, scale_stride,
    n_cols, ignore_index, z_loss,
    WITH_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_stride
    y = tl.load(target_ptr + row)
    valid = y != ignore_index
    m = float("-inf")  # running max
    d = 0.0  # running sum of exp(x - m)
    x_y = 0.0  # target logit, picked up during the sweep so no out-of-row load happens
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # While every logit so far is -inf (masked), m_new is too and exp(m - m_new) would be
        # exp(-inf + inf) = nan: shift by 0 then, which adds exp(-inf) = 0.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        x_y += tl.sum(tl.where(cols == y, x, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(d)
    z = z_loss * lse * lse
    # Ignored rows still write: a zero loss here, a zero gradient below.
    tl.store(loss_ptr + row, tl.where(valid, lse - x_y + z, 0.0))
    tl.store(z_ptr + row, tl.where(valid, z, 0.0))
    if WITH_GRAD:
        grad_ptr += row * grad_stride
        scale = tl.where(valid, tl.load(scale_ptr + row * scale_stride).to(tl.float32), 0.0)
        p_scale = scale * (1.0 + 2.0 * z_loss * lse)  # d(lse - x_y + z)/dx = (1 + 2 z_loss lse) p - onehot
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(logits_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            # p_y - 1 is formed in fp32: rounding p_y first would lose the target's gradient.
            g = tl.exp(x - lse) * p_scale - tl.where(cols == y, scale, 0.0)
            tl.store(grad_ptr + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_rows_kernel(x_ptr, x_stride, scale_ptr, scale_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
    if s != 1.0:  # decided on device: no host sync, and no memory traffic for the common grad of 1
        x_ptr += row * x_stride
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(x_ptr + cols, (x * s).to(x_ptr.dtype.element_ty), mask=mask)


def _block(n_cols: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(n_cols))


def cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    z_loss: float = 0.0,
    grad: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp32 losses of logits (N, V), z-loss included, and the z-loss terms alone (both 0
    on ignored rows).

    With `grad` (N, V), which may be `logits` itself, also writes grad_scale[row] * dloss_row/dlogits
    into it; grad_scale is a 0-dim or (N,) tensor, and ignored rows get a zero gradient.
    """
    n_rows, n_cols = logits.shape
    assert logits.stride(1) == 1 and (grad is None or grad.stride(1) == 1)
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    z = torch.empty_like(loss)
    with_grad = grad is not None
    scale = grad_scale.expand(n_rows) if with_grad else loss  # stride 0 broadcasts a 0-dim scale
    block = _block(n_cols)
    _cross_entropy_kernel[(n_rows,)](
        logits, logits.stride(0), grad if with_grad else logits, grad.stride(0) if with_grad else 0,
        target, loss, z, scale, scale.stride(0), n_cols, ignore_index, float(z_loss),
        WITH_GRAD=with_grad, BLOCK=block, num_warps=num_warps(block),
    )
    return loss, z


def scale_rows_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x[row] *= scale[row] in place, x (N, V), scale 0-dim or (N,); rows with scale 1 are left alone."""
    n_rows, n_cols = x.shape
    assert x.stride(1) == 1
    scale = scale.expand(n_rows)
    block = _block(n_cols)
    _scale_rows_kernel[(n_rows,)](
        x, x.stride(0), scale, scale.stride(0), n_cols, BLOCK=block, num_warps=num_warps(block)
    )
