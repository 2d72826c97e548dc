"""The PyTorch loss path (--kernels torch, the self-check's fallback, CPUs): linear + cross-entropy
chunked over rows (kernels.chunked), against the unchunked float64 reference, forward and backward,
and what it holds in memory: never the (N, V) logits or their fp32 gradient."""

import pytest
import torch

from fastpt.kernels import api, chunked, reference, scratch
from fastpt.plan.memory import MemoryTrace

SOFTCAP = 5.0
SLOW = pytest.mark.slow  # a float64 oracle of 123 x 760 x 50,257 takes tens of seconds on two cores


def _targets(rows: int, vocab: int) -> torch.Tensor:
    target = torch.randint(0, vocab, (rows,))
    target[torch.rand(rows) < 0.2] = -100
    return target


def _loss_and_grads(fn, x, w, target, upstream, **kwargs):
    x, w = (t.detach().requires_grad_() for t in (x, w))
    loss, z = fn(x, w, target, -100, kwargs.pop("reduction"), return_z_loss=True, **kwargs)
    loss.backward(upstream.to(loss.dtype))
    return [loss.detach(), z, x.grad, w.grad]


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Within rtol of the float64 reference's largest magnitude, nan where it has nan."""
    assert actual.shape == expected.shape
    assert torch.equal(actual.isnan(), expected.isnan())
    actual, expected = actual.double().nan_to_num(), expected.nan_to_num()
    atol = rtol * expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "rows, hidden, vocab, reduction, options, dtype",
    [
        (1, 760, 50257, "mean", {}, torch.float32),
        pytest.param(123, 760, 50257, "sum", {"z_loss": 1e-2, "softcap": SOFTCAP}, torch.float32, marks=SLOW),
        (199, 760, 4099, "none", {"z_loss": 1e-2}, torch.float32),
        (199, 64, 1000, "mean", {"softcap": SOFTCAP}, torch.float32),
        pytest.param(123, 760, 50257, "mean", {"z_loss": 1e-2, "softcap": SOFTCAP}, torch.bfloat16, marks=SLOW),
        (199, 760, 4099, "none", {"softcap": SOFTCAP}, torch.bfloat16),
        (123, 64, 1000, "mean", {"z_loss": 1e-2}, torch.float64),  # the self-check's oracle dtype
    ],
)
def test_chunked_loss_matches_the_reference(monkeypatch, rows, hidden, vocab, reduction, options, dtype):
    """Loss, z-loss term and both gradients against the float64 reference, in several chunks of rows
    (7 or more): fp32 (and fp64) to 1e-5, bf16 (inputs and weight) to 1e-2, ignored targets included."""
    monkeypatch.setattr(scratch, "CHUNK_BYTES", max(1, rows // 7) * vocab * 4)
    torch.manual_seed(rows)
    x, w = torch.randn(rows, hidden), 4 * torch.randn(vocab, hidden) / hidden**0.5
    target = _targets(rows, vocab)
    upstream = torch.randn(rows) if reduction == "none" else torch.tensor(0.7)
    kwargs = dict(reduction=reduction, **options)
    ours = _loss_and_grads(chunked.linear_cross_entropy, x.to(dtype), w.to(dtype), target, upstream, **kwargs)
    want = _loss_and_grads(reference.linear_cross_entropy, x.double(), w.double(), target, upstream, **kwargs)
    loss_dtype = torch.promote_types(dtype, torch.float32)
    assert [t.dtype for t in ours] == [loss_dtype, loss_dtype, dtype, dtype]
    for actual, expected in zip(ours, want):
        _close(actual, expected, 1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_chunked_loss_under_autocast_matches_the_reference():
    """fp32 parameters under bf16 autocast, as a training step runs it: matmuls in bf16 as F.linear
    would, fp32 gradients for fp32 leaves; the eval forward without gradients gives the same rows."""
    torch.manual_seed(0)
    x, w, target = torch.randn(123, 96), torch.randn(1000, 96) / 10, _targets(123, 1000)
    upstream = torch.tensor(1.0)
    with torch.autocast("cpu", torch.bfloat16):
        ours = _loss_and_grads(chunked.linear_cross_entropy, x, w, target, upstream, reduction="mean", z_loss=1e-3)
        want = _loss_and_grads(reference.linear_cross_entropy, x, w, target, upstream, reduction="mean", z_loss=1e-3)
        with torch.no_grad():
            rows = api.linear_cross_entropy(x, w, target, reduction="none", backend="torch")
    assert ours[2].dtype == ours[3].dtype == torch.float32
    for actual, expected in zip(ours, want):
        _close(actual, expected.double(), 1e-2)
    _close(rows, reference.linear_cross_entropy(x.bfloat16(), w.bfloat16(), target, reduction="none").double(), 1e-2)


def test_the_torch_loss_path_never_holds_the_logits():
    """A step of the torch backend's loss at 16K rows x a 50,257 vocabulary, traced over fake tensors:
    no storage as large as the fp32 logits (3.3 GB) is ever made, and at its peak the loss holds at
    most a quarter of them beyond its inputs and gradients (the reference: the logits, their fp32
    copy and fp32 gradient at once, 2.5 times them)."""
    rows, hidden, vocab = 16384, 256, 50257
    logits_bytes = rows * vocab * 4
    with torch._subclasses.fake_tensor.FakeTensorMode(), MemoryTrace() as mem:
        x = torch.randn(rows, hidden, requires_grad=True)
        w = torch.randn(vocab, hidden, requires_grad=True)
        target = torch.randint(0, vocab, (rows,))
        with torch.autocast("cpu", torch.bfloat16):
            loss = api.linear_cross_entropy(x, w, target, softcap=SOFTCAP, z_loss=1e-4, backend="torch")
        loss.backward()
    assert max(life.nbytes for life in mem.lives) < logits_bytes
    kept = sum(t.numel() * t.element_size() for t in (x, w, x.grad, w.grad))
    peak = max(sum(life.nbytes for life in mem.lives if life.alive_at(e)) for e in range(mem.event))
    assert peak - kept < logits_bytes / 4, (peak - kept) / logits_bytes


@pytest.mark.slow
def test_the_chunked_loss_compiles_into_one_graph():
    """torch.compile traces the chunks into one graph (fullgraph: no break), and the compiled loss and
    gradients equal the eager ones."""
    torch.manual_seed(0)
    x, w, target = torch.randn(199, 64), torch.randn(300, 64) / 8, _targets(199, 300)

    def loss_of(x, w):
        return chunked.linear_cross_entropy(x, w, target, softcap=SOFTCAP, z_loss=1e-3)

    results = []
    for fn in (loss_of, torch.compile(loss_of, fullgraph=True)):
        xl, wl = (t.detach().requires_grad_() for t in (x, w))
        loss = fn(xl, wl)
        loss.backward()
        results.append((loss.detach(), xl.grad, wl.grad))
    for compiled, eager in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
