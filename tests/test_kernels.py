"""Kernel tests.

The Triton kernels run on CPU through Triton's interpreter, which must be switched on before
triton is first imported, so the interpreted tests run in a child pytest with TRITON_INTERPRET=1
(`test_interpreted_suite`; run `TRITON_INTERPRET=1 pytest tests/test_kernels.py` to see them one
by one). There they run in fp32 against the float64 reference, with every torch.empty poisoned
with nan so an element a kernel fails to write shows up. Where CUDA is present the same ops are
checked in bf16 and under torch.compile.
"""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels import reference

INTERPRETING = kernels._interpret()  # TRITON_INTERPRET as the ops read it
interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in test_interpreted_suite's child pytest")
cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING, reason="needs CUDA, no interpreter")
KERNELS = {
    "rms_norm": ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"),
    "cross_entropy": ("_cross_entropy_kernel", "_scale_rows_kernel"),
}


@pytest.mark.skipif(INTERPRETING, reason="this is the child run")
def test_interpreted_suite():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]


def _poisoned(alloc):
    def alloc_nan(*args, **kwargs):
        t = alloc(*args, **kwargs)
        if t.is_floating_point():
            with torch.no_grad():
                t.fill_(float("nan"))
        return t
    return alloc_nan


@pytest.fixture
def ops(monkeypatch):
    """The (interpreted) ops modules, with torch.empty and torch.empty_like returning nan-filled memory."""
    from kernels.ops import cross_entropy, linear_cross_entropy, rms_norm

    for name in ("empty", "empty_like"):
        monkeypatch.setattr(torch, name, _poisoned(getattr(torch, name)))
    return SimpleNamespace(cross_entropy=cross_entropy, linear_cross_entropy=linear_cross_entropy, rms_norm=rms_norm)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> None:
    """Elementwise within rtol of the reference, relative to its largest magnitude; no nan allowed."""
    assert actual.shape == expected.shape and actual.dtype != torch.float64
    atol = rtol * expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


def _leaves(*tensors: torch.Tensor, dtype=None) -> list[torch.Tensor]:
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


def _targets(rows: int, vocab: int, ignored: float, device="cpu") -> torch.Tensor:
    target = torch.randint(0, vocab, (rows,), device=device)
    target[torch.rand(rows, device=device) < ignored] = -100
    return target


def _check_op(op: str, inputs: list[torch.Tensor], args: tuple, backend: str, rtol: float, upstream_one: bool = False):
    """op(*inputs, *args) and its input gradients, against the float64 reference."""
    ours = _leaves(*inputs)
    ref = _leaves(*inputs, dtype=torch.float64)
    out = getattr(kernels, op)(*ours, *args, backend=backend)
    expected = getattr(reference, op)(*ref, *args)
    # A random upstream gradient, or exactly 1 (the case the cross-entropy backward skips on device).
    upstream = torch.ones_like(expected) if upstream_one else torch.randn_like(expected)
    out.backward(upstream.to(out.dtype))
    expected.backward(upstream)
    if expected.isnan().any():  # "mean" over zero tokens
        assert torch.equal(out.isnan(), expected.isnan())
    else:
        _assert_close(out, expected.detach(), rtol)
    for t, r in zip(ours, ref):
        _assert_close(t.grad, r.grad, rtol)


def _half_case(op: str, dtype: torch.dtype, device: str, rows: int, vocab: int) -> tuple[list[torch.Tensor], tuple]:
    randn = lambda *shape: torch.randn(shape, device=device, dtype=dtype)  # noqa: E731
    if op == "rms_norm":
        return [randn(rows, 512), 1 + 0.1 * randn(512)], (1e-6,)
    target = _targets(rows, vocab, 0.1, device)
    if op == "cross_entropy":
        return [3 * randn(rows, vocab)], (target, -100, "mean")
    return [randn(rows, 512), randn(vocab, 512) / 512**0.5], (target, -100, "mean")


# ---------------------------------------------------------------- interpreter, on CPU

@interpreted
@pytest.mark.parametrize("shape", [(1, 2048), (123, 760), (3, 41, 123)])
def test_rms_norm(ops, shape):
    x, w = torch.randn(shape), 1 + 0.1 * torch.randn(shape[-1])
    _check_op("rms_norm", [x, w], (1e-6,), "triton", 1e-4)


@interpreted
def test_rms_norm_strided_rows(ops):
    x = torch.randn(199, 300)[:, 11:134]  # row stride 300, not 123
    _check_op("rms_norm", [x, torch.randn(123)], (1e-5,), "triton", 1e-4)


@interpreted
def test_rms_norm_fakes_match_the_kernels_on_transposed_input(ops):
    """Compiled code lays out the outputs as the fake kernels say: they must match the real ones
    (contiguous) also for a transposed x, whose strides empty_like would copy."""
    x, w = torch.randn(64, 48).t(), 1 + 0.1 * torch.randn(64)
    _, rstd = torch.ops.fastpt.rms_norm(x, w, 1e-6)
    torch.library.opcheck(torch.ops.fastpt.rms_norm.default, (x.requires_grad_(), w.requires_grad_(), 1e-6))
    torch.library.opcheck(torch.ops.fastpt.rms_norm_backward.default,
                          (torch.randn(64, 48).t(), x.detach(), w.detach(), rstd))


@interpreted
@pytest.mark.parametrize("rows, vocab, reduction, upstream_one", [
    (1, 50257, "mean", True),
    (5, 50257, "none", False),
    (123, 4099, "sum", False),
    (199, 1000, "mean", False),
])
def test_cross_entropy(ops, rows, vocab, reduction, upstream_one):
    logits, target = 3 * torch.randn(rows, vocab), _targets(rows, vocab, 0.2)
    _check_op("cross_entropy", [logits], (target, -100, reduction), "triton", 1e-4, upstream_one)


@interpreted
@pytest.mark.parametrize("rows, hidden, vocab, reduction, chunk_bytes", [
    (1, 123, 50257, "mean", None),
    (123, 760, 4099, "sum", 600_000),  # 4 chunks of 31 rows, the last one short
    (123, 2048, 1000, "mean", 150_000),
    (199, 123, 1000, "none", 200_000),  # gradients recomputed in the backward
])
def test_linear_cross_entropy(ops, monkeypatch, rows, hidden, vocab, reduction, chunk_bytes):
    if chunk_bytes:
        monkeypatch.setattr(ops.linear_cross_entropy, "CHUNK_BYTES", chunk_bytes)
    x, w = torch.randn(rows, hidden), torch.randn(vocab, hidden) / hidden**0.5
    target = _targets(rows, vocab, 0.2)
    _check_op("linear_cross_entropy", [x, w], (target, -100, reduction), "triton", 1e-4, reduction == "mean")


@interpreted
@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_targets_ignored(ops, op, reduction):
    """As F.cross_entropy: "mean" over zero tokens is nan, "sum" is 0; the gradients are all 0."""
    inputs = [torch.randn(7, 1000)] if op == "cross_entropy" else [torch.randn(7, 32), torch.randn(1000, 32)]
    _check_op(op, inputs, (torch.full((7,), -100), -100, reduction), "triton", 1e-4, True)


@interpreted
@pytest.mark.parametrize("op", ["rms_norm", "cross_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(ops, op, dtype):
    """16-bit loads, stores and casts (none of these kernels uses the interpreter's broken bf16 tl.dot)."""
    inputs, args = _half_case(op, dtype, "cpu", 37, 4099)
    _check_op(op, inputs, args, "triton", 1e-2)


class _CountingKernel:
    """Stands in for a Triton kernel and counts its launches, kernel[grid](...)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@interpreted
def test_auto_runs_triton_under_interpreter(ops, monkeypatch):
    spies = {}
    for module, names in KERNELS.items():
        for name in names:
            spies[name] = _CountingKernel(getattr(getattr(ops, module), name))
            monkeypatch.setattr(getattr(ops, module), name, spies[name])
    x, w, t = torch.randn(4, 64, requires_grad=True), torch.randn(100, 64, requires_grad=True), _targets(4, 100, 0)
    h = kernels.rms_norm(x, torch.ones(64))
    (kernels.linear_cross_entropy(h, w, t) + 0.5 * kernels.cross_entropy(h @ w.T, t)).backward()
    launches = {name: spy.launches for name, spy in spies.items()}
    assert all(launches.values()), launches
    kernels.rms_norm(x, torch.ones(64), backend="torch")
    monkeypatch.delenv("TRITON_INTERPRET")
    kernels.rms_norm(x, torch.ones(64))  # a CPU tensor without the interpreter: the reference
    assert launches == {name: spy.launches for name, spy in spies.items()}


def test_bad_arguments(monkeypatch):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="'cuda'"):
        kernels.rms_norm(x, torch.ones(8), backend="cuda")
    with pytest.raises(ValueError, match="'avg'"):
        kernels.functional.cross_entropy(x, torch.zeros(2, dtype=torch.long), reduction="avg")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        assert not kernels.available()
    with pytest.raises(RuntimeError, match="backend='triton' cannot run"):
        kernels.rms_norm(x, torch.ones(8), backend="triton")


class _Head(torch.nn.Module):
    """RMSNorm then the tied-head loss: the two ops the model calls."""

    def __init__(self, dim: int, vocab: int, backend: str):
        super().__init__()
        self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.embedding = torch.nn.Parameter(torch.randn(vocab, dim) / dim**0.5)
        self.backend = backend

    def forward(self, h, target):
        h = kernels.rms_norm(h, self.norm_weight, backend=self.backend)
        loss = kernels.linear_cross_entropy(h.flatten(0, 1), self.embedding, target, backend=self.backend)
        logits = h[:, -1] @ self.embedding.T
        return loss + kernels.cross_entropy(logits, target[: logits.shape[0]], backend=self.backend)


def _compiled_vs_eager_reference(head: _Head, h: torch.Tensor, target: torch.Tensor, **compile_kwargs):
    """Loss and gradients of the compiled head on the kernels, and of the eager head on the reference."""
    results = []
    for fn, backend in ((torch.compile(head, fullgraph=True, **compile_kwargs), head.backend), (head, "torch")):
        head.backend = backend
        head.zero_grad()
        h.grad = None
        loss = fn(h, target)
        loss.backward()
        results.append([loss, h.grad, head.norm_weight.grad, head.embedding.grad])
    return results


@interpreted
def test_compile_fullgraph_cpu(ops):
    """torch.compile(fullgraph=True) traces through the custom ops (aot_eager keeps it quick on CPU)."""
    torch._dynamo.reset()
    h, target = torch.randn(2, 5, 48, requires_grad=True), _targets(10, 300, 0.2)
    ours, ref = _compiled_vs_eager_reference(_Head(48, 300, "triton"), h, target, backend="aot_eager")
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _train_losses(backend: str, device: str, steps: int, dtype: torch.dtype) -> list[float]:
    """Losses of a few AdamW steps of a small fastpt model on fixed random tokens."""
    from fastpt.config import ModelConfig
    from fastpt.model import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, ffn_dim=192, max_seq_len=64)
    model = Transformer(cfg, backend).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 512, (steps, 4, 33), generator=torch.Generator().manual_seed(1)).to(device)
    losses = []
    for batch in tokens:
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            _, loss, _ = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@interpreted
def test_tiny_model_trains_like_reference(ops):
    triton_losses = _train_losses("triton", "cpu", 3, torch.float32)
    assert triton_losses == pytest.approx(_train_losses("torch", "cpu", 3, torch.float32), rel=1e-5)


# ---------------------------------------------------------------------------- CUDA only

@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms_norm", "cross_entropy", "linear_cross_entropy"])
def test_bf16_cuda(op):
    inputs, args = _half_case(op, torch.bfloat16, "cuda", 4096, 32000)
    _check_op(op, inputs, args, "auto", 1e-2)


@cuda
@pytest.mark.gpu
def test_autocast_linear_cross_entropy_cuda():
    """Under bf16 autocast the hidden is bf16 and the tied weight fp32: its gradient stays fp32."""
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(5000, 256, device="cuda") / 16).requires_grad_()
    target = _targets(1024, 5000, 0.1, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = kernels.linear_cross_entropy(x, w, target)
    loss.backward()
    assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32
    xr, wr = _leaves(x, w, dtype=torch.float64)
    ref = reference.linear_cross_entropy(xr, wr, target)
    ref.backward()
    _assert_close(loss.detach(), ref.detach(), 1e-2)
    _assert_close(w.grad, wr.grad, 1e-2)


@cuda
@pytest.mark.gpu
def test_linear_cross_entropy_memory_cuda():
    """Peak extra memory stays near one chunk of logits, far below the (N, V) logits."""
    n, d, v = 16384, 512, 32000
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = _targets(n, v, 0.0, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    kernels.linear_cross_entropy(x, w, target).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 0.25 * 2**30, f"{extra / 2**30:.2f} GiB"


@cuda
@pytest.mark.gpu
def test_compile_fullgraph_cuda():
    torch._dynamo.reset()
    h = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    target = _targets(256, 4096, 0.1, "cuda")
    ours, ref = _compiled_vs_eager_reference(_Head(256, 4096, "auto").cuda(), h, target)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@cuda
@pytest.mark.gpu
def test_tiny_model_trains_like_reference_cuda():
    losses = _train_losses("triton", "cuda", 30, torch.bfloat16)
    assert losses == pytest.approx(_train_losses("torch", "cuda", 30, torch.bfloat16), rel=1e-2)
