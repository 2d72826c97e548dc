"""Cross-entropy over the last dim: the loss rows in one pass, the gradient in one more.

Each program owns ROWS rows (several when the vocabulary is small, so no lane idles). The loss
pass is an online softmax over vocabulary blocks giving the log-sum-exp (saved, N floats), the
target logit read by one masked load per row. The gradient pass writes
scale * (softmax - onehot), formed in fp32, where `scale` is d(total loss)/d(row loss): the
upstream gradient and the mean's 1/n are folded into the pass that writes the gradient, so no
backward pays a second pass over the (N, V) gradient. The z-loss coef * lse^2 (PaLM) rides
along: it adds to the row's loss, and its gradient 2 * coef * lse * softmax to the softmax term.
A soft-cap (Gemma 2's final_logit_softcapping) replaces each logit x by c = cap * tanh(x / cap) as
it is loaded, in fp32, in both passes: the loss, the log-sum-exp and so the z-loss are the capped
logits', and the gradient is the capped one times dc/dx = 1 - tanh(x / cap)^2. The cap is a
constexpr, 0 = off: the uncapped kernel compiles with none of it.
Linear + cross-entropy runs both passes in one launch (its logits live for one chunk only); the
standalone op runs the loss pass in the forward and the gradient pass in the backward.
"""

import torch
import triton
import triton.language as tl

# The launch per (vocabulary, dtype): BLOCK_BYTES of a row per sweep step, THREAD_BYTES of it per
# thread (four 128-bit loads in flight), so that a program needs few enough registers for 2-4 of
# them per SM on sm_90 with no spill (BLOCK 32768 at 32 warps filled the register file and spilled).
BLOCK_BYTES = 16384
THREAD_BYTES = 64


@triton.jit
def _soft_cap(x, cap: tl.constexpr):
    """(cap * tanh(x / cap), its derivative 1 - tanh^2) in fp32, from one exp of a non-positive
    number: no overflow, and -inf gives (-cap, 0). Written out because Triton's interpreter has no
    libdevice tanh, so that the tests check the code the GPU runs; the derivative as 4e / (1 + e)^2,
    which keeps its relative accuracy where 1 - tanh^2 would cancel (saturated logits)."""
    e = tl.exp(-2.0 / cap * tl.abs(x))
    r = 1.0 / (1.0 + e)
    t = 2.0 * r - 1.0  # tanh(|x| / cap)
    return tl.where(x < 0, -cap * t, cap * t), 4.0 * e * r * r


@triton.jit
def _cross_entropy_kernel(
    logits_ptr,
    logits_stride,
    grad_ptr,
    grad_stride,
    target_ptr,
    lse_ptr,
    loss_ptr,
    z_ptr,
    scale_ptr,
    scale_stride,
    n_rows,
    n_cols,
    row_width,
    ignore_index,
    z_loss,
    WITH_LOSS: tl.constexpr,
    WITH_GRAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,); int64: rows * stride can pass 2**31
    row_mask = rows < n_rows
    y = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int32)  # int32: cheap compares below
    valid = row_mask & (y != ignore_index)
    row_ptrs = logits_ptr + rows[:, None] * logits_stride  # (ROWS, 1)
    if WITH_LOSS:
        m = tl.full((ROWS,), float("-inf"), tl.float32)  # running max
        d = tl.zeros((ROWS,), tl.float32)  # running sum of exp(x - m)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & (cols < row_width)[None, :]
            x = tl.load(row_ptrs + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)  # (ROWS, BLOCK)
            if SOFTCAP > 0:
                x, _ = _soft_cap(x, SOFTCAP)
            x = tl.where((cols < n_cols)[None, :], x, float("-inf"))  # the padding past the vocabulary
            m_new = tl.maximum(m, tl.max(x, axis=1))
            # While every logit so far is -inf (masked), m_new is too and exp(m - m_new) would be
            # exp(-inf + inf) = nan: shift by 0 then, which adds exp(-inf) = 0.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
            m = m_new
        # Rows past the end (all masked) get lse 0, not -inf + log(0): nans even where nothing is stored.
        lse = tl.where(row_mask, m + tl.log(tl.where(row_mask, d, 1.0)), 0.0)
        # Targets outside [0, V) other than ignore_index are not checked, and never read either.
        x_y = tl.load(logits_ptr + rows * logits_stride + y, mask=valid & (y >= 0) & (y < n_cols), other=0.0).to(
            tl.float32
        )
        if SOFTCAP > 0:
            x_y, _ = _soft_cap(x_y, SOFTCAP)
        z = z_loss * lse * lse
        # Ignored rows still write: a zero loss here, a zero gradient below.
        tl.store(loss_ptr + rows, tl.where(valid, lse - x_y + z, 0.0), mask=row_mask)
        tl.store(z_ptr + rows, tl.where(valid, z, 0.0), mask=row_mask)
        tl.store(lse_ptr + rows, lse, mask=row_mask)
    else:
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    if WITH_GRAD:
        grad_ptrs = grad_ptr + rows[:, None] * grad_stride
        scale = tl.where(valid, tl.load(scale_ptr + rows * scale_stride, mask=row_mask, other=0.0).to(tl.float32), 0.0)
        p_scale = scale * (1.0 + 2.0 * z_loss * lse)  # d(lse - x_y + z)/dx = (1 + 2 z_loss lse) p - onehot
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & (cols < row_width)[None, :]
            x = tl.load(row_ptrs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if SOFTCAP > 0:
                x, slope = _soft_cap(x, SOFTCAP)
            # p_y - 1 is formed in fp32: rounding p_y first would lose the target's gradient.
            g = tl.exp(x - lse[:, None]) * p_scale[:, None] - tl.where(cols[None, :] == y[:, None], scale[:, None], 0.0)
            if SOFTCAP > 0:
                g *= slope  # through the cap
            # Zero on ignored rows (one of -inf logits would give exp(nan) * 0 = nan) and on the padding.
            g = tl.where(valid[:, None] & (cols < n_cols)[None, :], g, 0.0)
            tl.store(grad_ptrs + cols[None, :], g.to(grad_ptr.dtype.element_ty), mask=mask)


def launch_plan(n_cols: int, element_size: int) -> tuple[int, int, int]:
    """(rows per program, BLOCK, num_warps) for rows of n_cols elements of element_size bytes."""
    block = min(triton.next_power_of_2(n_cols), BLOCK_BYTES // element_size)
    rows = max(1, BLOCK_BYTES // element_size // block)  # small vocabularies: several rows per program
    warps = max(1, min(8, rows * block * element_size // (32 * THREAD_BYTES)))
    return rows, block, warps


def _launch(logits, target, ignore_index, z_loss, softcap, lse, loss, z, grad, scale, row_width) -> None:
    n_rows, n_cols = logits.shape
    assert logits.stride(1) == 1 and (grad is None or grad.stride(1) == 1) and (row_width or n_cols) >= n_cols
    rows, block, warps = launch_plan(n_cols, logits.element_size())
    with_loss, with_grad = loss is not None, grad is not None
    scale = scale.expand(n_rows) if with_grad else lse  # stride 0 broadcasts a 0-dim scale
    _cross_entropy_kernel[(triton.cdiv(n_rows, rows),)](
        logits,
        logits.stride(0),
        grad if with_grad else logits,
        grad.stride(0) if with_grad else 0,
        target,
        lse,
        loss if with_loss else lse,
        z if with_loss else lse,
        scale,
        scale.stride(0),
        n_rows,
        n_cols,
        row_width or n_cols,
        ignore_index,
        float(z_loss),
        WITH_LOSS=with_loss,
        WITH_GRAD=with_grad,
        ROWS=rows,
        BLOCK=block,
        SOFTCAP=float(softcap),
        num_warps=warps,
    )


def cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    z_loss: float = 0.0,
    grad: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    row_width: int | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row fp32 losses of logits (N, V), z-loss included, the z-loss terms alone (both 0 on
    ignored rows) and the rows' log-sum-exp.

    With `grad` (N, V), which may be `logits` itself, also writes grad_scale[row] * dloss_row/dlogits
    into it in the same launch; grad_scale is a 0-dim or (N,) tensor, and ignored rows get a zero gradient.
    row_width (default V) is how many elements each row of logits and grad holds in memory: the kernel
    reads and writes (zeros) up to there, so a row width that is a multiple of 16 while V is not
    keeps the masks, and so the loads and stores, 128-bit. softcap > 0 caps the logits first
    (softcap * tanh(logits / softcap)); the log-sum-exp returned is the capped logits'.
    """
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    z, lse = torch.empty_like(loss), torch.empty_like(loss)
    _launch(logits, target, ignore_index, z_loss, softcap, lse, loss, z, grad, grad_scale, row_width)
    return loss, z, lse


def cross_entropy_backward(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    grad_scale: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    grad: torch.Tensor,
    softcap: float = 0.0,
) -> None:
    """grad[row] = grad_scale[row] * dloss_row/dlogits from the forward's log-sum-exp: one pass over
    logits (N, V) that writes grad (N, V), which may be `logits` itself; softcap as the forward had it."""
    _launch(logits, target, ignore_index, z_loss, softcap, lse, None, None, grad, grad_scale, None)
