"""Kernel tests.

On CPU the Triton kernels run through Triton's interpreter, switched on for one test at a time by
the `ops` fixture: fp32 against the float64 reference (16-bit loads and stores too: no kernel uses
tl.dot, which the interpreter gets wrong in bf16), with every torch.empty poisoned with nan so an
element a kernel fails to write shows up. Outside that fixture CPU tensors get the reference, as in
the other test files. Where CUDA is present (`pytest -m gpu`) the compiled kernels are checked in
bf16, for memory, and under torch.compile with Inductor.
"""

import contextlib
import functools
import importlib
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fastpt.kernels import api, reference, scratch

OPS_MODULES = (
    "fastpt.kernels.ops.cross_entropy",
    "fastpt.kernels.ops.linear_cross_entropy",
    "fastpt.kernels.ops.rms_norm",
)
cuda = pytest.mark.skipif(not torch.cuda.is_available() or api.interpreting(), reason="needs CUDA, no interpreter")
KERNELS = {
    "rms_norm": ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"),
    "cross_entropy": ("_cross_entropy_kernel",),
}


@functools.cache
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def _interpret(monkeypatch) -> None:
    """TRITON_INTERPRET=1 for one test. triton.jit reads it when a function is decorated (Triton
    3.6 to 3.9), and triton.language's own jit functions (tl.max, tl.sum) were decorated when
    triton was imported, so setting the variable is not enough: every jit function of
    triton.language and kernels.ops is swapped for the twin the decorator would have made, and
    swapped back after the test, so CUDA tests still compile the real kernels."""
    pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    for name in OPS_MODULES:
        importlib.import_module(name)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    modules = [m for name, m in list(sys.modules.items()) if name.startswith(("triton.language", "fastpt.kernels.ops"))]
    for owner in [*filter(None, modules), tl.tensor]:  # tl.tensor holds x.sum() and friends
        for name, fn in list(vars(owner).items()):
            if isinstance(fn, JITFunction):
                monkeypatch.setattr(owner, name, _interpreted(fn.fn))


def _poisoned(alloc):
    def alloc_nan(*args, **kwargs):
        t = alloc(*args, **kwargs)
        if t.is_floating_point():
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    return alloc_nan


@contextlib.contextmanager
def _language_restored():
    """triton.language exactly as it was afterwards. The interpreter patches it for each interpreted
    call, and a call of a jit helper (tl.max, tl.sum) patches triton.language.core without undoing
    it (Triton 3.6 to 3.9): left so, the real compiler (tests/test_aot.py) fails later in the process."""
    import triton.language as tl

    owners = [tl, tl.core, tl.math, tl.tensor, getattr(tl.core, "tensor_descriptor_base", None)]
    saved = [(owner, dict(vars(owner))) for owner in owners if owner is not None]
    try:
        yield
    finally:
        for owner, before in saved:
            for name in set(vars(owner)) - set(before):
                delattr(owner, name)
            for name, value in before.items():
                if vars(owner).get(name) is not value:
                    setattr(owner, name, value)


@pytest.fixture
def ops(monkeypatch):
    """The kernels.ops modules run by the interpreter, with torch.empty and torch.empty_like
    returning nan-filled memory."""
    _interpret(monkeypatch)
    for name in ("empty", "empty_like"):
        monkeypatch.setattr(torch, name, _poisoned(getattr(torch, name)))
    modules = [sys.modules[name] for name in OPS_MODULES]
    with _language_restored():
        yield SimpleNamespace(**{m.__name__.rsplit(".", 1)[1]: m for m in modules})


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> None:
    """Elementwise within rtol of the reference, relative to its largest magnitude; nan only where
    the reference has it ("mean" over zero tokens)."""
    assert actual.shape == expected.shape and actual.dtype != torch.float64
    assert torch.equal(actual.isnan(), expected.isnan()), (actual, expected)
    actual, expected = actual.nan_to_num(), expected.nan_to_num()
    atol = rtol * expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


def _leaves(*tensors: torch.Tensor, dtype=None) -> list[torch.Tensor]:
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


def _targets(rows: int, vocab: int, ignored: float, device="cpu") -> torch.Tensor:
    target = torch.randint(0, vocab, (rows,), device=device)
    target[torch.rand(rows, device=device) < ignored] = -100
    return target


def _check_op(
    op: str, inputs: list[torch.Tensor], args: tuple, backend: str, rtol: float, upstream_one: bool = False, **kwargs
):
    """op(*inputs, *args, **kwargs) and its input gradients, against the float64 reference (the
    same call of kernels.reference, which has no in-place backward); with return_z_loss, the z-loss
    term too."""
    ours = _leaves(*inputs)
    ref = _leaves(*inputs, dtype=torch.float64)
    out = getattr(api, op)(*ours, *args, backend=backend, **kwargs)
    oracle = {k: v for k, v in kwargs.items() if k != "inplace_backward"}
    expected = getattr(reference, op)(*ref, *args, **oracle)
    if kwargs.get("return_z_loss"):
        (out, z), (expected, z_expected) = out, expected
        assert not z.requires_grad
        _assert_close(z, z_expected, rtol)
    # A random upstream gradient, or exactly 1 (the case the cross-entropy backward skips on device).
    upstream = torch.ones_like(expected) if upstream_one else torch.randn_like(expected)
    out.backward(upstream.to(out.dtype))
    expected.backward(upstream)
    _assert_close(out.detach(), expected.detach(), rtol)
    for t, r in zip(ours, ref):
        _assert_close(t.grad, r.grad, rtol)


# (op, keyword arguments) of the 16-bit checks: interpreted on CPU, compiled in bf16 on CUDA.
HALF_CASES = [
    ("rms_norm", {}),
    ("cross_entropy", {}),
    ("cross_entropy", {"z_loss": 1e-3, "inplace_backward": True}),
    ("linear_cross_entropy", {}),
    ("linear_cross_entropy", {"z_loss": 1e-3}),
    ("cross_entropy", {"softcap": 2.0, "inplace_backward": True}),  # logits of 3 sigma: the cap bites
    ("linear_cross_entropy", {"z_loss": 1e-3, "softcap": 2.0}),
]


def _half_case(op: str, dtype: torch.dtype, device: str, rows: int, vocab: int) -> tuple[list[torch.Tensor], tuple]:
    randn = lambda *shape: torch.randn(shape, device=device, dtype=dtype)  # noqa: E731
    if op == "rms_norm":
        return [randn(rows, 512), 1 + 0.1 * randn(512)], (1e-6,)
    target = _targets(rows, vocab, 0.1, device)
    if op == "cross_entropy":
        return [3 * randn(rows, vocab)], (target, -100, "mean")
    return [randn(rows, 512), randn(vocab, 512) / 512**0.5], (target, -100, "mean")


# ---------------------------------------------------------------- interpreter, on CPU


@pytest.mark.parametrize("shape", [(1, 2048), (123, 760), (3, 41, 123)])
def test_rms_norm(ops, shape):
    x, w = torch.randn(shape), 1 + 0.1 * torch.randn(shape[-1])
    _check_op("rms_norm", [x, w], (1e-6,), "triton", 1e-4)


def test_rms_norm_strided_rows(ops):
    x = torch.randn(199, 300)[:, 11:134]  # row stride 300, not 123
    _check_op("rms_norm", [x, torch.randn(123)], (1e-5,), "triton", 1e-4)


@pytest.mark.parametrize(
    "rows, vocab, reduction, upstream_one, kwargs",
    [
        (1, 50257, "mean", True, {}),
        (5, 50257, "none", False, {"z_loss": 1e-2, "return_z_loss": True}),
        (123, 4099, "sum", False, {"inplace_backward": True}),
        (199, 1000, "mean", False, {"z_loss": 1e-2, "return_z_loss": True, "inplace_backward": True}),
        (123, 123, "mean", True, {}),  # 32 rows per program, the last program's rows partly past the end
        (199, 1, "sum", False, {"z_loss": 1e-2, "inplace_backward": True}),
    ],
)
def test_cross_entropy(ops, rows, vocab, reduction, upstream_one, kwargs):
    logits, target = 3 * torch.randn(rows, vocab), _targets(rows, vocab, 0.2)
    _check_op("cross_entropy", [logits], (target, -100, reduction), "triton", 1e-4, upstream_one, **kwargs)


@pytest.mark.parametrize("reduction, kwargs", [("mean", {}), ("none", {"z_loss": 1e-2})])
def test_cross_entropy_masked_leading_blocks(ops, monkeypatch, reduction, kwargs):
    """-inf logits filling whole vocabulary blocks before the first finite one (the running max
    stays -inf there) give F.cross_entropy's finite results, not nan."""
    monkeypatch.setattr(ops.cross_entropy, "BLOCK_BYTES", 256)  # blocks of 64 fp32 logits
    logits, target = 3 * torch.randn(5, 200), torch.tensor([100, 150, 199, -100, 7])
    logits[0, :64] = logits[2, :128] = logits[3, :64] = float("-inf")
    logits[1, torch.arange(200) != 150] = float("-inf")  # only the target is finite: loss 0
    _check_op("cross_entropy", [logits], (target, -100, reduction), "triton", 1e-4, **kwargs)


def test_cross_entropy_inplace_backward_reuses_the_logits(ops):
    """The backward writes the logits' gradient over the logits' own memory (a non-leaf's and a
    leaf's), equal to the reference's; the forward leaves them intact; and autograd sees the
    overwrite: a graph that saved the logits and runs its backward afterwards refuses to."""
    x, target = torch.randn(37, 1000, requires_grad=True), _targets(37, 1000, 0.2)
    logits = x * 2  # a non-leaf, as a head's output would be
    before = logits.detach().clone()
    grads = []
    logits.register_hook(grads.append)
    loss = api.cross_entropy(logits, target, z_loss=1e-2, inplace_backward=True, backend="triton")
    assert torch.equal(logits.detach(), before)
    loss.backward(retain_graph=True)
    assert grads[0].data_ptr() == logits.data_ptr()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # the saved logits are the gradient now
    xr = x.detach().double().requires_grad_()
    expected = reference.cross_entropy(xr * 2, target, z_loss=1e-2)
    expected.backward()
    _assert_close(loss.detach(), expected.detach())
    _assert_close(x.grad, xr.grad)

    logits = x * 2
    saved = logits.pow(2).sum()  # pow saves its input; made first, its backward runs after the loss's
    loss = api.cross_entropy(logits, target, inplace_backward=True, backend="triton")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + saved).backward()

    leaf = (2 * x).detach().requires_grad_()  # a leaf's .grad is its own memory too, not a copy
    api.cross_entropy(leaf, target, z_loss=1e-2, inplace_backward=True, backend="triton").backward()
    assert leaf.grad.data_ptr() == leaf.data_ptr()
    _assert_close(leaf.grad, xr.grad / 2)


@pytest.mark.parametrize("vocab", [1000, 123])
def test_cross_entropy_strided_rows_write_only_their_columns(ops, vocab):
    """Logits and gradient as column slices of wider buffers (the padded row stride linear +
    cross-entropy uses; a user's sliced tensor): loss and gradient in one launch match the
    reference, and the columns past the vocabulary are never written (they stay nan)."""
    rows = 37
    logits = torch.randn(rows, vocab + 100)[:, :vocab]
    grad_buffer = torch.full((rows, vocab + 64), float("nan"))
    target, scale = _targets(rows, vocab, 0.2), torch.rand(rows)
    loss, _, lse = ops.cross_entropy.cross_entropy_forward(logits, target, -100, 1e-2, grad_buffer[:, :vocab], scale)
    ref = logits.double().requires_grad_()
    ref_rows = reference.cross_entropy(ref, target, reduction="none", z_loss=1e-2)
    (ref_rows * scale).sum().backward()
    _assert_close(loss, ref_rows.detach())
    _assert_close(lse, ref.detach().logsumexp(-1))
    _assert_close(grad_buffer[:, :vocab], ref.grad)
    assert grad_buffer[:, vocab:].isnan().all()


def test_cross_entropy_padded_row_width(ops):
    """Linear + cross-entropy's layout: rows of 128 elements in memory holding a vocabulary of 123,
    the gradient written in place. Whatever the padding holds is no logit, and it gets a zero gradient."""
    rows, vocab, width = 37, 123, 128
    buffer = 3 * torch.randn(rows, width)
    logits = buffer[:, :vocab]
    ref = logits.double().requires_grad_()
    target, scale = _targets(rows, vocab, 0.2), torch.rand(rows)
    loss, _, _ = ops.cross_entropy.cross_entropy_forward(logits, target, -100, 1e-2, logits, scale, width)
    ref_rows = reference.cross_entropy(ref, target, reduction="none", z_loss=1e-2)
    (ref_rows * scale).sum().backward()
    _assert_close(loss, ref_rows.detach())
    _assert_close(buffer[:, :vocab], ref.grad)
    assert (buffer[:, vocab:] == 0).all()


@pytest.mark.parametrize(
    "rows, hidden, vocab, reduction, chunk_bytes, z_loss",
    [
        (1, 123, 50257, "mean", None, 0.0),
        (123, 760, 4099, "sum", 600_000, 1e-2),  # 4 chunks of 31 rows, the last one short
        (123, 2048, 1000, "mean", 150_000, 1e-2),
        (199, 123, 1000, "none", 200_000, 1e-2),  # gradients recomputed in the backward
        (199, 64, 123, "mean", 20_000, 0.0),  # row stride 128; 6 chunks of 34 rows, several rows per program
        (123, 32, 1, "sum", None, 1e-2),  # row stride 64
    ],
)
def test_linear_cross_entropy(ops, monkeypatch, rows, hidden, vocab, reduction, chunk_bytes, z_loss):
    _check_linear_cross_entropy(monkeypatch, rows, hidden, vocab, reduction, chunk_bytes, 1e-4, z_loss=z_loss)


def _check_linear_cross_entropy(monkeypatch, rows, hidden, vocab, reduction, chunk_bytes, rtol, scale=1.0, **kwargs):
    """linear_cross_entropy on x (rows, hidden) and a weight giving logits of about `scale` sigma,
    chunked at `chunk_bytes`, against the float64 reference."""
    if chunk_bytes:
        monkeypatch.setattr(scratch, "CHUNK_BYTES", chunk_bytes)
    x, w = torch.randn(rows, hidden), scale * torch.randn(vocab, hidden) / hidden**0.5
    target = _targets(rows, vocab, 0.2)
    _check_op(
        "linear_cross_entropy",
        [x, w],
        (target, -100, reduction),
        "triton",
        rtol,
        reduction == "mean",
        return_z_loss=True,
        **kwargs,
    )


# Soft-capped losses: logits of about 4 sigma capped at 5, so that some saturate and some barely
# bend; the kernels cap in fp32 as they load, the oracle in float64. fp32 agrees to ~1e-6.
SOFTCAP = 5.0


@pytest.mark.parametrize(
    "rows, vocab, reduction, kwargs",
    [
        (1, 50257, "mean", {}),
        (123, 1000, "sum", {"z_loss": 1e-2, "return_z_loss": True, "inplace_backward": True}),
        (199, 123, "none", {"z_loss": 1e-2, "return_z_loss": True}),  # 32 rows per program
    ],
)
def test_cross_entropy_softcap(ops, rows, vocab, reduction, kwargs):
    logits, target = 4 * torch.randn(rows, vocab), _targets(rows, vocab, 0.2)
    _check_op("cross_entropy", [logits], (target, -100, reduction), "triton", 1e-5, softcap=SOFTCAP, **kwargs)


@pytest.mark.parametrize(
    "rows, hidden, vocab, reduction, chunk_bytes",
    [
        (1, 123, 50257, "mean", None),  # row stride 50304: the padding capped, then -inf
        pytest.param(199, 760, 50257, "sum", None, marks=pytest.mark.slow),
        (123, 760, 4099, "sum", 600_000),  # 4 chunks of 31 rows
        (199, 64, 123, "none", 20_000),  # gradients recomputed in the backward; several rows per program
        (199, 123, 1000, "mean", 200_000),
    ],
)
def test_linear_cross_entropy_softcap(ops, monkeypatch, rows, hidden, vocab, reduction, chunk_bytes):
    _check_linear_cross_entropy(
        monkeypatch, rows, hidden, vocab, reduction, chunk_bytes, 1e-5, scale=4.0, z_loss=1e-2, softcap=SOFTCAP
    )


def test_fp32_accumulation_probe_checks_the_value(monkeypatch):
    """An addmm that accepts out_dtype=fp32 but sums in bf16 (no exception) is not trusted with
    the weight gradient, nor one that raises; one that keeps the fp32 sum is."""
    pytest.importorskip("triton")
    from fastpt.kernels.ops import linear_cross_entropy as ops

    def bf16_sum(acc, a, b, out_dtype=None, out=None):
        out.copy_((acc.bfloat16() + a @ b).float())

    def refuses(*args, **kwargs):
        raise RuntimeError("out_dtype is not supported")

    def fp32_sum(acc, a, b, out_dtype=None, out=None):
        out.copy_(acc + a.float() @ b.float())

    for addmm, trusted in ((bf16_sum, False), (refuses, False), (fp32_sum, True)):
        monkeypatch.setattr(torch, "addmm", addmm)
        ops._addmm_accumulates_in_fp32.cache_clear()
        assert ops._addmm_accumulates_in_fp32(torch.device("cpu")) is trusted
    ops._addmm_accumulates_in_fp32.cache_clear()


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_targets_ignored(ops, op, reduction):
    """As F.cross_entropy: "mean" over zero tokens is nan, "sum" is 0, and so is the z-loss term;
    the gradients are all 0."""
    inputs = [torch.randn(7, 1000)] if op == "cross_entropy" else [torch.randn(7, 32), torch.randn(1000, 32)]
    _check_op(
        op, inputs, (torch.full((7,), -100), -100, reduction), "triton", 1e-4, True, z_loss=1e-2, return_z_loss=True
    )


@pytest.mark.parametrize("op, kwargs", HALF_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(ops, op, kwargs, dtype):
    """16-bit loads, stores and casts."""
    inputs, args = _half_case(op, dtype, "cpu", 37, 4099)
    _check_op(op, inputs, args, "triton", 1e-2, **kwargs)


@pytest.mark.parametrize("op", ["rms_norm", "cross_entropy", "linear_cross_entropy"])
def test_double_backward_refused(ops, op):
    """create_graph=True would need the backward's own graph, which the kernels do not build: an
    error naming the op, not a gradient that silently drops the second-order terms."""
    inputs = [torch.randn(4, 64), torch.randn(100, 64)] if op == "linear_cross_entropy" else [torch.randn(4, 64)]
    inputs = _leaves(*inputs)
    args = (torch.ones(64),) if op == "rms_norm" else (_targets(4, 64 if op == "cross_entropy" else 100, 0),)
    out = getattr(api, op)(*inputs, *args, backend="triton")
    torch.autograd.grad(out.sum(), inputs, retain_graph=True)  # first order is fine
    with pytest.raises(RuntimeError, match=f"fastpt::{op}: double backward"):
        torch.autograd.grad(out.sum(), inputs, create_graph=True)


def _opcheck_cases(dtype: torch.dtype) -> dict[str, tuple]:
    """(op, args) for every fastpt custom op. rms_norm gets a transposed x: compiled code lays
    out outputs as the fakes say, and they must match the kernels' contiguous ones, not copy the
    input's strides as empty_like would. The losses' variants alternate between uncapped and a
    soft-cap of 5 (the logits reach past it)."""
    fastpt = torch.ops.fastpt
    randn = functools.partial(torch.randn, dtype=dtype)
    x, norm_w = randn(64, 48).t(), 1 + 0.1 * randn(64)
    logits, target, rows = 3 * randn(6, 50), _targets(6, 50, 0.3), torch.rand(6)
    h, w = randn(6, 16), randn(50, 16) / 4
    rstd = 0.5 + torch.rand(48)
    lse = logits.float().logsumexp(-1)
    grad = lambda t: t.clone().requires_grad_()  # noqa: E731
    cases = {
        "rms_norm": (fastpt.rms_norm, (grad(x), grad(norm_w), 1e-6)),
        "rms_norm_backward": (fastpt.rms_norm_backward, (randn(64, 48).t(), x, norm_w, rstd)),
        "cross_entropy_backward": (fastpt.cross_entropy_backward, (logits, target, lse, rows, -100, 1e-2, 5.0)),
        "cross_entropy_backward_": (
            fastpt.cross_entropy_backward_,
            (logits.clone(), target, lse, rows, -100, 1e-2, 0.0),
        ),
        "linear_cross_entropy_backward": (
            fastpt.linear_cross_entropy_backward,
            (h, w, target, rows, -100, 1e-2, dtype, 5.0),
        ),
    }
    for inplace, cap in ((False, 0.0), (True, 5.0)):
        cases[f"cross_entropy/{inplace}"] = (fastpt.cross_entropy, (grad(logits), target, -100, 1e-2, inplace, cap))
    for reduction in ("mean", "none"):
        for with_grad, cap in ((True, 5.0), (False, 0.0)):
            cases[f"linear_cross_entropy/{reduction}/{with_grad}"] = (
                fastpt.linear_cross_entropy,
                (grad(h), grad(w), target, -100, reduction, 1e-2, dtype, with_grad, cap),
            )
    return cases


def test_opcheck_covers_every_op():
    covered = {op._qualified_op_name for op, _ in _opcheck_cases(torch.float32).values()}
    assert covered == {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("fastpt::")}


@pytest.mark.parametrize("case", list(_opcheck_cases(torch.float32)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck(ops, case, dtype):
    """torch.library.opcheck's default tests: schema, autograd registration, fake tensors, and AOT
    dispatch with dynamic shapes (what torch.compile relies on)."""
    op, args = _opcheck_cases(dtype)[case]
    torch.library.opcheck(op, args)


class _CountingKernel:
    """Stands in for a Triton kernel and counts its launches, kernel[grid](...)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def test_auto_runs_triton_under_interpreter(ops, monkeypatch):
    spies = {}
    for module, names in KERNELS.items():
        for name in names:
            spies[name] = _CountingKernel(getattr(getattr(ops, module), name))
            monkeypatch.setattr(getattr(ops, module), name, spies[name])
    x, w, t = torch.randn(4, 64, requires_grad=True), torch.randn(100, 64, requires_grad=True), _targets(4, 100, 0)
    h = api.rms_norm(x, torch.ones(64))
    (api.linear_cross_entropy(h, w, t) + 0.5 * api.cross_entropy(h @ w.T, t)).backward()
    launches = {name: spy.launches for name, spy in spies.items()}
    assert all(launches.values()), launches
    api.rms_norm(x, torch.ones(64), backend="torch")
    monkeypatch.delenv("TRITON_INTERPRET")
    api.rms_norm(x, torch.ones(64))  # a CPU tensor without the interpreter: the reference
    assert launches == {name: spy.launches for name, spy in spies.items()}


def test_bad_arguments(monkeypatch):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="'cuda'"):
        api.rms_norm(x, torch.ones(8), backend="cuda")
    for backend in api.BACKENDS[1:]:  # checked before a backend is chosen: each refuses alike
        with pytest.raises(ValueError, match="'avg'"):
            api.cross_entropy(x, torch.zeros(2, dtype=torch.long), reduction="avg", backend=backend)
        with pytest.raises(ValueError, match="logits must be 2-D"):
            api.cross_entropy(x[None], torch.zeros(1, 2, dtype=torch.long), backend=backend)
        with pytest.raises(ValueError, match="input must be 2-D"):
            api.linear_cross_entropy(x[None], torch.ones(3, 8), torch.zeros(1, 2, dtype=torch.long), backend=backend)
        for cap in (-1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match=f"softcap must be a finite number >= 0 .*got {cap}"):
                api.linear_cross_entropy(
                    x, torch.ones(3, 8), torch.zeros(2, dtype=torch.long), softcap=cap, backend=backend
                )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        assert not api.available()
    with pytest.raises(RuntimeError, match="backend='triton' cannot run"):
        api.rms_norm(x, torch.ones(8), backend="triton")


def test_reference_z_loss():
    """The oracle itself, against the formula written out: z_loss * logsumexp^2 per counted row,
    averaged over counted rows like the loss; reported alone and detached with return_z_loss."""
    logits = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([3, -100, 0, 10, -100, 5])
    counted = target != -100
    lse = [torch.log(torch.exp(row).sum()).item() for row in logits[counted].detach()]
    z_expected = 1e-2 * sum(v * v for v in lse) / len(lse)
    loss, z = reference.cross_entropy(logits, target, z_loss=1e-2, return_z_loss=True)
    assert z.item() == pytest.approx(z_expected, rel=1e-12) and not z.requires_grad
    ce = F.cross_entropy(logits, target)
    assert loss.item() == pytest.approx(ce.item() + z_expected, rel=1e-12)
    assert torch.equal(reference.cross_entropy(logits, target, z_loss=0.0), ce)
    loss.backward()  # d/dx (ce + 1e-2 lse^2 / n) = (softmax - onehot) / n + 2e-2 lse softmax / n
    p = logits.detach().softmax(-1)
    expected = p * (1 + 2e-2 * logits.detach().logsumexp(-1, keepdim=True)) - F.one_hot(target.clamp(min=0), 11)
    expected = expected * counted[:, None] / counted.sum()
    torch.testing.assert_close(logits.grad, expected)


def test_reference_softcap():
    """The oracle's soft-cap, against the formula written out: the loss, the z-loss (of the capped
    logits' log-sum-exp) and the gradient through cap * tanh(x / cap), summed."""
    logits = 10 * torch.randn(6, 11, dtype=torch.float64)
    logits.requires_grad_()
    target, counted = torch.tensor([3, -100, 0, 10, -100, 5]), torch.tensor([1, 0, 1, 1, 0, 1.0])[:, None]
    t = torch.tanh(logits.detach() / 2.0)
    capped = 2.0 * t
    lse = capped.logsumexp(-1, keepdim=True)
    loss, z = reference.cross_entropy(logits, target, reduction="sum", z_loss=1e-2, return_z_loss=True, softcap=2.0)
    z_expected = 1e-2 * (lse.square() * counted).sum()
    assert z.item() == pytest.approx(z_expected.item(), rel=1e-12)
    ce = F.cross_entropy(capped, target, reduction="sum")
    assert loss.item() == pytest.approx(ce.item() + z_expected.item(), rel=1e-12)
    assert abs(ce - F.cross_entropy(logits.detach(), target, reduction="sum")) > 1  # the cap bites
    loss.backward()
    dcapped = capped.softmax(-1) * (1 + 2e-2 * lse) - F.one_hot(target.clamp(min=0), 11)
    torch.testing.assert_close(logits.grad, dcapped * counted * (1 - t.square()))


class _Head(torch.nn.Module):
    """RMSNorm then the tied-head loss (the two ops the model calls), plus the standalone
    cross-entropy on the last position's logits, z-loss on and overwriting its logits."""

    def __init__(self, dim: int, vocab: int, backend: str):
        super().__init__()
        self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.embedding = torch.nn.Parameter(torch.randn(vocab, dim) / dim**0.5)
        self.backend = backend

    def forward(self, h, target):
        h = api.rms_norm(h, self.norm_weight, backend=self.backend)
        loss = api.linear_cross_entropy(h.flatten(0, 1), self.embedding, target, z_loss=1e-3, backend=self.backend)
        logits = h[:, -1] @ self.embedding.T
        last = api.cross_entropy(
            logits, target[: logits.shape[0]], z_loss=1e-3, inplace_backward=True, backend=self.backend
        )
        return loss + last


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


def test_compile_fullgraph_cpu(ops):
    """torch.compile(fullgraph=True) traces through the custom ops, the mutating one included
    (aot_eager keeps it quick on CPU)."""
    torch._dynamo.reset()
    h, target = torch.randn(2, 5, 48, requires_grad=True), _targets(10, 300, 0.2)
    target[:2] = torch.tensor([1, 2])  # the last-position loss counts a token: its mean is not nan
    ours, ref = _compiled_vs_eager_reference(_Head(48, 300, "triton"), h, target, backend="aot_eager")
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _train_losses(backend: str, device: str, steps: int, dtype: torch.dtype, softcap: float = 0.0) -> list[float]:
    """Losses of a few AdamW steps of a small fastpt model on fixed random tokens."""
    from fastpt.config import ModelConfig
    from fastpt.model import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, ffn_dim=192, max_seq_len=64, logit_softcap=softcap)
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


# The logits start at about 0.16 sigma: a cap of 1, the least --logit-softcap allows, bends them.
@pytest.mark.parametrize("softcap", [0.0, 1.0])
def test_tiny_model_trains_like_reference(ops, softcap):
    triton_losses = _train_losses("triton", "cpu", 3, torch.float32, softcap)
    assert triton_losses == pytest.approx(_train_losses("torch", "cpu", 3, torch.float32, softcap), rel=1e-5)
