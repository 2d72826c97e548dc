"""RMSNorm: y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps), statistics in fp32.

Each program owns a [BLOCK_ROWS, BLOCK_COLS] tile: at small hidden sizes (512) one row per
program would leave most lanes of a warp idle. The backward runs a fixed number of programs,
each reducing its rows' weight gradient into one fp32 partial sum (a column vector, summed over
each tile's rows as it goes); torch sums the partials in fp32.
"""

import torch
import triton
import triton.language as tl

from ._launch import max_programs, num_warps

MAX_COLS = 65536  # one row must fit in a program's registers
# Values per program. The backward holds x, dy, w and the weight-gradient column per value: its
# tile is smaller and it runs about 8 values per thread (4-16 warps), so that sm_90 keeps 4+
# programs per SM at hidden 512-2048 (2 of 16 warps at 4096: half the SM's threads) with no spill.
FWD_TILE, BWD_TILE, BWD_VALUES_PER_THREAD = 4096, 1024, 8


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    x_stride,
    y_ptr,
    y_stride,
    w_ptr,
    rstd_ptr,
    n_rows,
    n_cols,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # int64: rows * stride can pass 2**31
    cols = tl.arange(0, BLOCK_COLS)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # The cast keeps rsqrt in fp32 even if eps arrives as fp64 (as Inductor passes Python floats).
    rstd = tl.rsqrt((tl.sum(x * x, axis=1) / n_cols + eps).to(tl.float32))
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    dy_stride,
    x_ptr,
    x_stride,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dx_stride,
    dw_partial_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_COLS,), dtype=tl.float32)  # a column vector: a full fp32 tile cost 4x the registers
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for start in range(first, last, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < last
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd[:, None]
        wdy = w[None, :] * dy
        # dx = rstd * (w*dy - x_hat * mean(w*dy*x_hat)); masked lanes are 0 and add nothing to the mean.
        c = tl.sum(x_hat * wdy, axis=1) / n_cols
        dx = (wdy - x_hat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * dx_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=col_mask)


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """View t as (rows, n_cols) with unit column stride, copying only if it has to."""
    t = t.reshape(-1, n_cols)
    return t if t.stride(1) == 1 else t.contiguous()


def _tile(n_cols: int, elements: int) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_COLS) of a tile of about `elements` values, whole rows."""
    if n_cols > MAX_COLS:
        raise ValueError(f"rms_norm kernel supports a last dim of at most {MAX_COLS}, got {n_cols}")
    block_cols = triton.next_power_of_2(n_cols)
    return max(1, elements // block_cols), block_cols


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y (x's shape and dtype) and the fp32 rstd (x's shape without the last dim)."""
    n_cols = x.shape[-1]
    x2 = _as_rows(x, n_cols)
    n_rows = x2.shape[0]
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_rows, block_cols = _tile(n_cols, FWD_TILE)
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_rows),)](
        x2,
        x2.stride(0),
        y,
        y.stride(0),
        weight.contiguous(),
        rstd,
        n_rows,
        n_cols,
        eps,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=num_warps(block_rows * block_cols),
    )
    return y.view(x.shape), rstd.view(x.shape[:-1])


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns dx (x's shape and dtype) and dweight (weight's dtype, reduced in fp32)."""
    n_cols = x.shape[-1]
    x2, dy2 = _as_rows(x, n_cols), _as_rows(dy, n_cols)
    n_rows = x2.shape[0]
    block_rows, block_cols = _tile(n_cols, BWD_TILE)
    # Whole tiles per program, and no more programs than fill the device once.
    tiles_per_program = triton.cdiv(triton.cdiv(n_rows, block_rows), max_programs(x.device))
    rows_per_program = max(1, tiles_per_program) * block_rows
    grid = triton.cdiv(n_rows, rows_per_program)
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    dw_partial = torch.empty((grid, n_cols), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(grid,)](
        dy2,
        dy2.stride(0),
        x2,
        x2.stride(0),
        weight.contiguous(),
        rstd.reshape(-1),
        dx,
        dx.stride(0),
        dw_partial,
        n_rows,
        n_cols,
        rows_per_program,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=max(4, min(16, block_rows * block_cols // (32 * BWD_VALUES_PER_THREAD))),
    )
    return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)
