"""The compiled kernels on a CUDA device (`pytest -m gpu`; skipped without one): bf16 against the
float64 reference, memory (the logits never materialized, the in-place backward), torch.compile
with Inductor, and a tiny model training like the reference. The CPU checks are tests/test_kernels.py,
whose helpers these share."""

import pytest
import torch
from test_kernels import (
    HALF_CASES,
    _assert_close,
    _check_op,
    _compiled_vs_eager_reference,
    _half_case,
    _Head,
    _leaves,
    _targets,
    _train_losses,
    cuda,
)

from fastpt.kernels import api, reference


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("op, kwargs", HALF_CASES)
def test_bf16_cuda(op, kwargs):
    inputs, args = _half_case(op, torch.bfloat16, "cuda", 4096, 32000)
    _check_op(op, inputs, args, "auto", 1e-2, **kwargs)


@cuda
@pytest.mark.gpu
def test_autocast_linear_cross_entropy_cuda():
    """Under bf16 autocast the hidden is bf16 and the tied weight fp32: its gradient stays fp32."""
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(5000, 256, device="cuda") / 16).requires_grad_()
    target = _targets(1024, 5000, 0.1, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = api.linear_cross_entropy(x, w, target)
    loss.backward()
    assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32
    xr, wr = _leaves(x, w, dtype=torch.float64)
    ref = reference.linear_cross_entropy(xr, wr, target)
    ref.backward()
    _assert_close(loss.detach(), ref.detach(), 1e-2)
    _assert_close(w.grad, wr.grad, 1e-2)


def _extra_gib(fn) -> float:
    """Peak memory fn allocates beyond what existed before it, in GiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


@cuda
@pytest.mark.gpu
def test_linear_cross_entropy_memory_cuda():
    """Peak extra memory stays near one chunk of logits (4096 rows) plus the fp32 weight gradient,
    far below the (N, V) logits (1 GiB)."""
    n, d, v = 16384, 512, 32000
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = _targets(n, v, 0.0, "cuda")
    extra = _extra_gib(lambda: api.linear_cross_entropy(x, w, target, z_loss=1e-4).backward())
    chunk_and_fp32_dw = (4096 * v * 2 + v * d * 4) / 2**30  # 0.31 GiB
    assert extra < chunk_and_fp32_dw + 0.15, f"{extra:.2f} GiB"  # + the gradients returned, 0.05 GiB


@cuda
@pytest.mark.gpu
def test_cross_entropy_inplace_memory_cuda():
    """With inplace_backward the logits' gradient is the logits' memory: forward and backward
    allocate next to nothing, where the default allocates a second (N, V) buffer."""
    n, v = 8192, 32000
    logits_gib = n * v * 2 / 2**30  # bf16
    target = _targets(n, v, 0.1, "cuda")
    for inplace in (False, True):
        logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        extra = _extra_gib(lambda: api.cross_entropy(logits, target, inplace_backward=inplace).backward())
        if inplace:
            assert extra < 0.05 * logits_gib and logits.grad.data_ptr() == logits.data_ptr(), f"{extra:.3f} GiB"
        else:
            assert extra > 0.9 * logits_gib, f"{extra:.3f} GiB"


@cuda
@pytest.mark.gpu
def test_compile_fullgraph_cuda():
    torch._dynamo.reset()
    h = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    target = _targets(256, 4096, 0.1, "cuda")
    target[:4] = torch.arange(4)
    ours, ref = _compiled_vs_eager_reference(_Head(256, 4096, "auto").cuda(), h, target)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [0.0, 15.0])
def test_tiny_model_trains_like_reference_cuda(softcap):
    losses = _train_losses("triton", "cuda", 30, torch.bfloat16, softcap)
    assert losses == pytest.approx(_train_losses("torch", "cuda", 30, torch.bfloat16, softcap), rel=1e-2)
