"""Autograd and torch.library registration of the Triton kernels.

Every op is a `torch.library.custom_op` with a fake (shape-only) implementation, and those on
the autograd path register their backward, so torch.compile(fullgraph=True) keeps each in the
graph as one opaque call; all of them pass torch.library.opcheck. None is twice differentiable:
a backward run with create_graph=True raises. The Triton modules are imported inside the op
bodies, so `import fastpt.kernels.api` does not import triton. TRITON_INTERPRET must be set before triton
is first imported: triton.jit reads it when a function is decorated, triton.language's own included.
"""

import torch
from torch import Tensor

from .reference import reduce_rows, row_scale

# The ops' namespace. The folder is fastpt.kernels (a top-level `import kernels` never loads it), so
# these are registered once.
NAMESPACE = "fastpt"


def _no_double_backward(op: str) -> None:
    """Autograd runs a backward with grad mode on only for create_graph=True; these backward
    formulas are not differentiable, so refuse rather than hand back a gradient with no graph."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{NAMESPACE}::{op}: double backward (create_graph=True) is not supported; "
            "use backend='torch' for higher-order gradients"
        )


# ----------------------------------------------------------------------------- RMSNorm


@torch.library.custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    from .ops import rms_norm as ops

    return ops.rms_norm_forward(x, weight, eps)


# The kernels write y, rstd and dx contiguous whatever x's strides: the fakes must say the same
# (empty_like would keep a transposed x's strides, and compiled code would misread the output).
@_rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    from .ops import rms_norm as ops

    return ops.rms_norm_backward(dy, x, weight, rstd)


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, rstd)


def _rms_norm_grad(ctx, dy, _):
    _no_double_backward("rms_norm")
    dx, dweight = _rms_norm_backward(dy, *ctx.saved_tensors)
    return dx, dweight, None


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim of x (any leading dims); output in x's dtype, statistics in fp32."""
    return _rms_norm(x, weight, eps)[0]


# ------------------------------------------------------------------ loss reduction helpers


def _loss_fake(rows: Tensor, reduction: str) -> Tensor:
    shape = rows.shape[:1] if reduction == "none" else ()
    return rows.new_empty(shape, dtype=torch.float32)


def _rows_fake(rows: Tensor) -> Tensor:
    return rows.new_empty(rows.shape[:1], dtype=torch.float32)


# ------------------------------------------------------------------------ cross-entropy
#
# The forward op makes the loss rows and saves their log-sum-exp; its backward writes the gradient
# in one pass with the upstream gradient of each row folded in (the reduction's 1/n arrives in it
# from reduce_rows' own autograd), into a new buffer or over the saved logits (cross_entropy_backward_).


@torch.library.custom_op(f"{NAMESPACE}::cross_entropy", mutates_args=())
def _cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int, z_loss: float, inplace_backward: bool, softcap: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss rows, z-loss rows, log-sum-exp rows of the capped logits); inplace_backward only tells
    the backward where to write."""
    from .ops import cross_entropy as ops

    return ops.cross_entropy_forward(logits, target, ignore_index, z_loss, softcap=softcap)


@_cross_entropy.register_fake
def _(logits, target, ignore_index, z_loss, inplace_backward, softcap):
    return _rows_fake(logits), _rows_fake(logits), _rows_fake(logits)


@torch.library.custom_op(f"{NAMESPACE}::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(
    logits: Tensor, target: Tensor, lse: Tensor, grad_rows: Tensor, ignore_index: int, z_loss: float, softcap: float
) -> Tensor:
    """d(sum_i grad_rows[i] * loss_i)/dlogits, (N, V) contiguous."""
    from .ops import cross_entropy as ops

    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    ops.cross_entropy_backward(logits, target, lse, grad_rows, ignore_index, z_loss, grad, softcap)
    return grad


@_cross_entropy_backward.register_fake
def _(logits, target, lse, grad_rows, ignore_index, z_loss, softcap):
    return logits.new_empty(logits.shape)


@torch.library.custom_op(f"{NAMESPACE}::cross_entropy_backward_", mutates_args=("logits",))
def _cross_entropy_backward_(
    logits: Tensor, target: Tensor, lse: Tensor, grad_rows: Tensor, ignore_index: int, z_loss: float, softcap: float
) -> None:
    """As cross_entropy_backward, the gradient written over the logits."""
    from .ops import cross_entropy as ops

    ops.cross_entropy_backward(logits, target, lse, grad_rows, ignore_index, z_loss, logits, softcap)


@_cross_entropy_backward_.register_fake
def _(logits, target, lse, grad_rows, ignore_index, z_loss, softcap):
    return None


def _cross_entropy_setup(ctx, inputs, output):
    logits, target, ctx.ignore_index, ctx.z_loss, ctx.inplace, ctx.softcap = inputs
    _, z_rows, lse = output
    ctx.mark_non_differentiable(z_rows, lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, target, lse)


def _cross_entropy_grad(ctx, grad_rows, _, __):
    _no_double_backward("cross_entropy")
    if grad_rows is None:
        return None, None, None, None, None, None
    logits, target, lse = ctx.saved_tensors
    args = (logits, target, lse, grad_rows, ctx.ignore_index, ctx.z_loss, ctx.softcap)
    if ctx.inplace:
        _cross_entropy_backward_(*args)
        # A fresh alias, not the saved tensor itself: autograd adopts a leaf's gradient without a
        # copy only when nothing else holds the tensor handed to it.
        return logits.detach(), None, None, None, None, None
    return _cross_entropy_backward(*args), None, None, None, None, None


_cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    inplace_backward: bool = False,
    softcap: float = 0.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of logits (N, V) against target (N,) plus z_loss * lse^2 per counted row; fp32
    loss, "mean" over non-ignored rows. With return_z_loss, (loss, the z-loss term alone, detached).
    softcap > 0: of the logits softcap * tanh(logits / softcap), capped in fp32 inside the kernels.

    inplace_backward=True makes the backward write the gradient over the logits, so the pair costs
    one (N, V) buffer instead of two: after the backward the logits' values are gone, and reading
    them gives the gradient. Targets outside [0, V) other than ignore_index are not checked (that
    would need a host sync).
    """
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    target = target.contiguous()
    loss_rows, z_rows, _ = _cross_entropy(logits, target, ignore_index, z_loss, inplace_backward, softcap)
    loss = reduce_rows(loss_rows, target, ignore_index, reduction)
    return (loss, reduce_rows(z_rows, target, ignore_index, reduction)) if return_z_loss else loss


# ------------------------------------------------------------------- linear + cross-entropy


@torch.library.custom_op(f"{NAMESPACE}::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    z_loss: float,
    compute_dtype: torch.dtype,
    with_grad: bool,
    softcap: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, z-loss term, dinput, fp32 dweight), the gradients those of the summed loss: the mean's
    1/n joins the upstream gradient in the backward, so fp16 never holds (p - onehot) / n. They are
    made in the forward unless reduction is "none" (then they depend on per-row upstream gradients)
    or with_grad is off (the backward recomputes them then); otherwise they come back empty."""
    from .ops import linear_cross_entropy as ops

    early = with_grad and reduction != "none"
    ones = torch.ones((), dtype=torch.float32, device=input.device)
    # Autocast would recast the matmuls inside, including the fp32 weight-gradient accumulator.
    with torch.autocast(input.device.type, enabled=False):
        loss_rows, z_rows, dinput, dweight = ops.linear_cross_entropy_forward(
            input, weight, target, ignore_index, compute_dtype, z_loss, ones if early else None, softcap
        )
    if not early:
        dinput, dweight = input.new_empty(0), weight.new_empty(0, dtype=torch.float32)
    return (
        reduce_rows(loss_rows, target, ignore_index, reduction),
        reduce_rows(z_rows, target, ignore_index, reduction),
        dinput,
        dweight,
    )


@_linear_cross_entropy.register_fake
def _(input, weight, target, ignore_index, reduction, z_loss, compute_dtype, with_grad, softcap):
    early = with_grad and reduction != "none"
    return (
        _loss_fake(input, reduction),
        _loss_fake(input, reduction),
        torch.empty_like(input) if early else input.new_empty(0),
        weight.new_empty(weight.shape if early else 0, dtype=torch.float32),
    )


@torch.library.custom_op(f"{NAMESPACE}::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    grad_scale: Tensor,
    ignore_index: int,
    z_loss: float,
    compute_dtype: torch.dtype,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    """(dinput, fp32 dweight) of sum_i grad_scale[i] * loss_i, grad_scale 0-dim or (N,)."""
    from .ops import linear_cross_entropy as ops

    with torch.autocast(input.device.type, enabled=False):
        _, _, dinput, dweight = ops.linear_cross_entropy_forward(
            input, weight, target, ignore_index, compute_dtype, z_loss, grad_scale, softcap
        )
    return dinput, dweight


@_linear_cross_entropy_backward.register_fake
def _(input, weight, target, grad_scale, ignore_index, z_loss, compute_dtype, softcap):
    return torch.empty_like(input), torch.empty_like(weight, dtype=torch.float32)


def _linear_cross_entropy_setup(ctx, inputs, output):
    input, weight, target, ctx.ignore_index, ctx.reduction, ctx.z_loss, ctx.compute_dtype, with_grad, ctx.softcap = (
        inputs
    )
    _, z, dinput, dweight = output
    ctx.early = with_grad and ctx.reduction != "none"
    ctx.mark_non_differentiable(z, dinput, dweight)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(input, weight, target, dinput, dweight)


def _linear_cross_entropy_grad(ctx, grad_loss, _, __, ___):
    _no_double_backward("linear_cross_entropy")
    input, weight, target, dinput, dweight = ctx.saved_tensors
    scale = grad_loss * row_scale(target, ctx.ignore_index, ctx.reduction)
    if ctx.early:
        dinput, dweight = dinput * scale, dweight * scale
    else:
        dinput, dweight = _linear_cross_entropy_backward(
            input, weight, target, scale, ctx.ignore_index, ctx.z_loss, ctx.compute_dtype, ctx.softcap
        )
    return dinput, dweight.to(weight.dtype), None, None, None, None, None, None, None


_linear_cross_entropy.register_autograd(_linear_cross_entropy_grad, setup_context=_linear_cross_entropy_setup)


def linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    softcap: float = 0.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """cross_entropy(input @ weight.T, target, ...) for input (N, D), weight (V, D), chunked over rows;
    softcap as in cross_entropy, applied to each chunk's logits inside the kernel.

    The matmuls run in the autocast dtype when autocast is on (as F.linear would), else in the
    promoted dtype of input and weight; softmax and accumulation are fp32; the loss is fp32.
    """
    device = input.device.type
    if torch.is_autocast_enabled(device):
        compute_dtype = torch.get_autocast_dtype(device)
    else:
        compute_dtype = torch.promote_types(input.dtype, weight.dtype)
    with_grad = torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)
    loss, z, _, _ = _linear_cross_entropy(
        input, weight, target.contiguous(), ignore_index, reduction, z_loss, compute_dtype, with_grad, softcap
    )
    return (loss, z) if return_z_loss else loss
