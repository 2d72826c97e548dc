"""Linear + cross-entropy in plain PyTorch, chunked over rows: the fallback that trains where the
Triton kernels do not run (--kernels torch, a kernel that failed its self-check, a CPU).

The reference (reference.linear_cross_entropy, the tests' oracle) builds the (N, V) logits, their
fp32 copy and their fp32 gradient: 16 GiB at 64K rows of a 64K vocabulary. Here one chunk of rows
exists at a time (scratch.chunk_rows of fp32 logits: 256 MiB), and the gradients of input and weight
are made in the forward, chunk by chunk, as the Triton path makes them: the backward only scales
them by the upstream gradient (with reduction="none" it recomputes them per row instead). Soft-cap,
z-loss and ignore_index as the reference. Under torch.compile the chunks are traced into the graph
(an autograd.Function, no custom op), so Inductor fuses each chunk's pointwise work.
"""

import torch
from torch import Tensor

from .reference import _upcast, reduce_rows, row_scale
from .scratch import chunk_rows


def _chunk(
    x: Tensor, w: Tensor, target: Tensor, ignore_index: int, z_loss: float, softcap: float, grad_scale: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk of rows x (n, D) against w (V, D): its loss rows (z-loss included), z-loss rows and,
    with grad_scale (n,), the gradient of sum_i grad_scale[i] * loss_i with respect to the (uncapped)
    logits x @ w.T, in w's dtype. Eager, the fp32 work is done in place: a chunk holds one fp32 copy
    of its logits (two when capped: tanh's, for the gradient) and at the end the gradient in w's
    dtype. Compiled, the same as pure expressions, which Inductor fuses into a pass or two per chunk
    (in-place chains and a scatter would each be a pass of their own)."""
    compiling = torch.compiler.is_compiling()
    counted = target != ignore_index
    safe = torch.where(counted, target, 0)[:, None]
    logits = _upcast(x @ w.T)  # the product in w's dtype lives only until its fp32 copy exists
    tanh = None
    if softcap:
        tanh = (logits / softcap).tanh() if compiling else logits.div_(softcap).tanh_()
        logits = tanh * softcap
    lse = logits.logsumexp(-1)
    z = torch.where(counted, z_loss * lse.square(), 0.0)
    loss = torch.where(counted, lse - logits.gather(1, safe).squeeze(1), 0.0) + z
    if grad_scale is None:
        return loss, z, None
    # d(lse - l_t + z * lse^2) / dl = softmax(l) * (1 + 2 z lse) - onehot(t), times 1 - tanh^2 when capped
    scale = torch.where(counted, grad_scale, 0.0).to(logits.dtype)  # fp64 where the inputs are
    coef = ((1 + 2 * z_loss * lse) * scale)[:, None]
    if compiling:
        onehot = torch.arange(logits.shape[1], device=logits.device) == safe
        grad = (logits - lse[:, None]).exp() * coef - onehot * scale[:, None]
        return loss, z, (grad if tanh is None else grad * (1 - tanh * tanh)).to(w.dtype)
    grad = logits.sub_(lse[:, None]).exp_().mul_(coef)
    grad.scatter_add_(1, safe, -scale[:, None])
    if tanh is not None:
        grad.mul_(tanh.square_().neg_().add_(1))
        del tanh
    return loss, z, grad.to(w.dtype)


def chunked_loss(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    ignore_index: int,
    z_loss: float,
    softcap: float,
    compute_dtype: torch.dtype,
    grad_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Loss rows and z-loss rows of input (N, D) @ weight (V, D).T, one chunk of rows at a time, the
    matmuls in compute_dtype; with grad_scale (0-dim or (N,)), the gradients of
    sum_i grad_scale[i] * loss_i too: with respect to input (its dtype) and weight (fp32 or wider)."""
    n_rows = input.shape[0]
    w, input_cast = weight.to(compute_dtype), input.to(compute_dtype)  # cast once, not per chunk (a launch each)
    rows_each = chunk_rows(n_rows, weight.shape[0], torch.promote_types(compute_dtype, torch.float32))
    losses, zs, dinputs = [], [], []
    dweight = None
    if grad_scale is not None:
        grad_scale = grad_scale.expand(n_rows)
        accumulator = torch.promote_types(weight.dtype, torch.float32)
        dweight = torch.zeros(weight.shape, dtype=accumulator, device=weight.device)
    for start in range(0, n_rows, rows_each):
        rows = slice(start, start + rows_each)
        x = input_cast[rows]
        scale = None if grad_scale is None else grad_scale[rows]
        loss, z, grad = _chunk(x, w, target[rows], ignore_index, z_loss, softcap, scale)
        losses.append(loss)
        zs.append(z)
        if grad is not None:
            dinputs.append((grad @ w).to(input.dtype))  # joined once at the end: compiled, a slice write copies it all
            dweight.add_(grad.T @ x)  # the product in compute_dtype, the sum over chunks in fp32
    return torch.cat(losses), torch.cat(zs), torch.cat(dinputs) if dinputs else None, dweight


class _LinearCrossEntropy(torch.autograd.Function):
    """(loss, z-loss term) reduced; the gradients of the summed loss made in the forward when wanted
    and the reduction is not "none" (then they depend on each row's upstream gradient: the backward
    makes them)."""

    @staticmethod
    def forward(ctx, input, weight, target, ignore_index, reduction, z_loss, softcap, compute_dtype, with_grad):
        early = with_grad and reduction != "none"
        ones = torch.ones((), dtype=torch.float32, device=input.device)
        with torch.autocast(input.device.type, enabled=False):  # the dtypes are chosen here, not recast
            loss_rows, z_rows, dinput, dweight = chunked_loss(
                input, weight, target, ignore_index, z_loss, softcap, compute_dtype, ones if early else None
            )
        ctx.options = ignore_index, reduction, z_loss, softcap, compute_dtype
        ctx.early, ctx.weight_dtype = early, weight.dtype
        ctx.save_for_backward(*((target, dinput, dweight) if early else (input, weight, target)))
        z = reduce_rows(z_rows, target, ignore_index, reduction)
        ctx.mark_non_differentiable(z)
        return reduce_rows(loss_rows, target, ignore_index, reduction), z

    @staticmethod
    def backward(ctx, grad_loss, _):
        ignore_index, reduction, z_loss, softcap, compute_dtype = ctx.options
        if ctx.early:
            target, dinput, dweight = ctx.saved_tensors
            scale = grad_loss * row_scale(target, ignore_index, reduction)
            return dinput * scale.to(dinput.dtype), (dweight * scale).to(ctx.weight_dtype), *[None] * 7
        input, weight, target = ctx.saved_tensors
        with torch.autocast(input.device.type, enabled=False):
            _, _, dinput, dweight = chunked_loss(
                input, weight, target, ignore_index, z_loss, softcap, compute_dtype, grad_loss.float()
            )
        return dinput, dweight.to(weight.dtype), *[None] * 7


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
    """reference.linear_cross_entropy's result without its (N, V) logits: input (N, D), weight (V, D).
    The matmuls run in the autocast dtype when autocast is on (as F.linear would), else in the
    promoted dtype of input and weight; the loss and softmax in (at least) fp32."""
    device = input.device.type
    if torch.is_autocast_enabled(device):
        compute_dtype = torch.get_autocast_dtype(device)
    else:
        compute_dtype = torch.promote_types(input.dtype, weight.dtype)
    with_grad = torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)
    loss, z = _LinearCrossEntropy.apply(
        input, weight, target, ignore_index, reduction, z_loss, softcap, compute_dtype, with_grad
    )
    return (loss, z) if return_z_loss else loss
