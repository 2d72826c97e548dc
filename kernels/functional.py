"""Autograd and torch.library registration of the Triton kernels.

Every op is a `torch.library.custom_op` with a fake (shape-only) implementation and a registered
autograd formula, so torch.compile(fullgraph=True) keeps it in the graph as one opaque call.
The Triton modules are imported inside the op bodies: triton.jit reads TRITON_INTERPRET when a
kernel is decorated, so importing them here would freeze that choice at `import kernels`.
"""
import torch
from torch import Tensor

_REDUCTIONS = ("mean", "sum", "none")


# ----------------------------------------------------------------------------- RMSNorm

@torch.library.custom_op("fastpt::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    from kernels.ops import rms_norm as ops

    return ops.rms_norm_forward(x, weight, eps)


# The kernels write y, rstd and dx contiguous whatever x's strides: the fakes must say the same
# (empty_like would keep a transposed x's strides, and compiled code would misread the output).
@_rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fastpt::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    from kernels.ops import rms_norm as ops

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
    dx, dweight = _rms_norm_backward(dy, *ctx.saved_tensors)
    return dx, dweight, None


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim of x (any leading dims); output in x's dtype, statistics in fp32."""
    return _rms_norm(x, weight, eps)[0]


# ------------------------------------------------------------------ loss reduction helpers

def _row_scale(target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """d loss / d loss_row of a counted row, 0-dim fp32, without a host sync: 1/n_counted for
    "mean" (1 if no row counts: every gradient is 0 then), else 1."""
    if reduction == "mean":
        return 1.0 / (target != ignore_index).sum().clamp(min=1).float()
    return torch.ones((), dtype=torch.float32, device=target.device)


def _reduce(loss_rows: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    if reduction == "none":
        return loss_rows
    # "mean" over zero counted rows is 0 / 0 = nan, as in F.cross_entropy.
    return loss_rows.sum() / (target != ignore_index).sum() if reduction == "mean" else loss_rows.sum()


def _loss_fake(rows: Tensor, reduction: str) -> Tensor:
    shape = rows.shape[:1] if reduction == "none" else ()
    return rows.new_empty(shape, dtype=torch.float32)


def _check(reduction: str, **matrices: Tensor) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    for name, t in matrices.items():
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


# ------------------------------------------------------------------------ cross-entropy

def _forward_scale(logits: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """The mean's 1/n goes into the gradient made in the forward, so that the common backward with
    an upstream gradient of 1 has nothing to do; fp16 would underflow on (p - onehot) / n, so
    there it waits for the backward."""
    if logits.dtype == torch.float16:
        return torch.ones((), dtype=torch.float32, device=logits.device)
    return _row_scale(target, ignore_index, reduction)


@torch.library.custom_op("fastpt::cross_entropy", mutates_args=())
def _cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int, reduction: str, with_grad: bool
) -> tuple[Tensor, Tensor]:
    """(loss, dloss/dlogits for an upstream gradient of 1, or an empty tensor without with_grad)."""
    from kernels.ops import cross_entropy as ops

    grad = torch.empty(logits.shape if with_grad else 0, dtype=logits.dtype, device=logits.device)
    scale = _forward_scale(logits, target, ignore_index, reduction)
    loss_rows = ops.cross_entropy_forward(logits, target, ignore_index, grad if with_grad else None, scale)
    return _reduce(loss_rows, target, ignore_index, reduction), grad


@_cross_entropy.register_fake
def _(logits, target, ignore_index, reduction, with_grad):
    return _loss_fake(logits, reduction), logits.new_empty(logits.shape if with_grad else 0)


@torch.library.custom_op("fastpt::scale_rows_", mutates_args=("x",))
def _scale_rows_(x: Tensor, scale: Tensor) -> None:
    from kernels.ops import cross_entropy as ops

    ops.scale_rows_(x, scale)


@_scale_rows_.register_fake
def _(x, scale):
    return None


def _cross_entropy_setup(ctx, inputs, output):
    _, target, ctx.ignore_index, ctx.reduction, _ = inputs
    _, grad = output
    ctx.mark_non_differentiable(grad)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad, target)


def _cross_entropy_grad(ctx, grad_loss, _):
    # The gradient was made in the forward; scaling it in place saves an (N, V) buffer. A second
    # backward through the same graph (retain_graph) trips autograd's saved-tensor version check.
    grad, target = ctx.saved_tensors
    if grad.dtype == torch.float16:  # the forward left the mean's 1/n out (_forward_scale)
        grad_loss = grad_loss * _row_scale(target, ctx.ignore_index, ctx.reduction)
    _scale_rows_(grad, grad_loss)
    return grad, None, None, None, None


_cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """Cross-entropy of logits (N, V) against target (N,); fp32 loss, "mean" over non-ignored rows.

    Targets outside [0, V) other than ignore_index are not checked (that would need a host sync).
    """
    _check(reduction, logits=logits)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    with_grad = torch.is_grad_enabled() and logits.requires_grad
    return _cross_entropy(logits, target.contiguous(), ignore_index, reduction, with_grad)[0]


# ------------------------------------------------------------------- linear + cross-entropy

@torch.library.custom_op("fastpt::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    input: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str,
    compute_dtype: torch.dtype, with_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, dinput, fp32 dweight), the gradients those of the summed loss: the mean's 1/n joins
    the upstream gradient in the backward, so fp16 never holds (p - onehot) / n. They are made in
    the forward unless reduction is "none" (then they depend on per-row upstream gradients) or
    with_grad is off; otherwise they come back empty."""
    from kernels.ops import linear_cross_entropy as ops

    early = with_grad and reduction != "none"
    ones = torch.ones((), dtype=torch.float32, device=input.device)
    # Autocast would recast the matmuls inside, including the fp32 weight-gradient accumulator.
    with torch.autocast(input.device.type, enabled=False):
        loss_rows, dinput, dweight = ops.linear_cross_entropy_forward(
            input, weight, target, ignore_index, compute_dtype, ones if early else None
        )
    if not early:
        dinput, dweight = input.new_empty(0), weight.new_empty(0, dtype=torch.float32)
    return _reduce(loss_rows, target, ignore_index, reduction), dinput, dweight


@_linear_cross_entropy.register_fake
def _(input, weight, target, ignore_index, reduction, compute_dtype, with_grad):
    early = with_grad and reduction != "none"
    return (
        _loss_fake(input, reduction),
        torch.empty_like(input) if early else input.new_empty(0),
        weight.new_empty(weight.shape if early else 0, dtype=torch.float32),
    )


@torch.library.custom_op("fastpt::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward(
    input: Tensor, weight: Tensor, target: Tensor, grad_loss: Tensor, ignore_index: int,
    compute_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """(dinput, fp32 dweight) for per-row upstream gradients grad_loss (N,): reduction "none"."""
    from kernels.ops import linear_cross_entropy as ops

    with torch.autocast(input.device.type, enabled=False):
        _, dinput, dweight = ops.linear_cross_entropy_forward(
            input, weight, target, ignore_index, compute_dtype, grad_loss
        )
    return dinput, dweight


@_linear_cross_entropy_backward.register_fake
def _(input, weight, target, grad_loss, ignore_index, compute_dtype):
    return torch.empty_like(input), torch.empty_like(weight, dtype=torch.float32)


def _linear_cross_entropy_setup(ctx, inputs, output):
    input, weight, target, ctx.ignore_index, ctx.reduction, ctx.compute_dtype, _ = inputs
    _, dinput, dweight = output
    ctx.mark_non_differentiable(dinput, dweight)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(input, weight, target, dinput, dweight)


def _linear_cross_entropy_grad(ctx, grad_loss, _, __):
    input, weight, target, dinput, dweight = ctx.saved_tensors
    if ctx.reduction == "none":
        dinput, dweight = _linear_cross_entropy_backward(
            input, weight, target, grad_loss, ctx.ignore_index, ctx.compute_dtype
        )
    else:
        scale = grad_loss * _row_scale(target, ctx.ignore_index, ctx.reduction)
        dinput, dweight = dinput * scale, dweight * scale
    return dinput, dweight.to(weight.dtype), None, None, None, None, None


_linear_cross_entropy.register_autograd(_linear_cross_entropy_grad, setup_context=_linear_cross_entropy_setup)


def linear_cross_entropy(
    input: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """cross_entropy(input @ weight.T, target) for input (N, D), weight (V, D), chunked over rows.

    The matmuls run in the autocast dtype when autocast is on (as F.linear would), else in the
    promoted dtype of input and weight; softmax and accumulation are fp32; the loss is fp32.
    """
    _check(reduction, input=input, weight=weight)
    device = input.device.type
    if torch.is_autocast_enabled(device):
        compute_dtype = torch.get_autocast_dtype(device)
    else:
        compute_dtype = torch.promote_types(input.dtype, weight.dtype)
    with_grad = torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)
    return _linear_cross_entropy(
        input, weight, target.contiguous(), ignore_index, reduction, compute_dtype, with_grad
    )[0]
