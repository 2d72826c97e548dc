"""The self-check against broken copies of the kernels: each kernel path made wrong on purpose by
one textual change of its source (a copy in a temporary folder, loaded in place of the real module:
the real files are never edited) is caught by the self-check's probes of the run that launches it,
and the real kernels pass them over several seeds. On CPU through Triton's interpreter, in fp32 and
in bf16, the run's dtype on a GPU, where the mistakes below pass unseen when the probe's terms are
smaller than bf16's precision (a cap on logits of size 1, z-loss's 1e-4, RMSNorm's eps) or its
launch has one tile per program and one chunk (`dw =` for `dw +=`).

The interpreter rounds fp32 to bf16 by truncation, a GPU to the nearest: the `interpreted` fixture
rounds to the nearest, so that the real kernels' bf16 probes run as on a GPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import numpy as np
import pytest
import torch
from test_kernels import _interpret, _language_restored

from conftest import REPO
from fastpt import selfcheck
from fastpt.config import TrainConfig
from fastpt.kernels import selftest
from fastpt.presets import ModelConfig

CPU = torch.device("cpu")
KERNEL_MODULES = ("cross_entropy", "rms_norm", "linear_cross_entropy")  # in import order: the last uses the first
# hidden 128 and head size 32 with QK-norm, a vocabulary of two tiles, z-loss
MODEL = ModelConfig(vocab_size=9001, dim=128, n_heads=4, qk_norm=True)


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A kernel made wrong: `old` replaced by `new` in kernels/ops/`module`.py; caught in the runs named."""

    what: str
    module: str
    old: str
    new: str
    runs: tuple[str, ...]


def run_launches(run: str) -> list[selftest.Launch]:
    """The launches of a run named "<dtype>[ cap <softcap>]", with z-loss 1e-4."""
    dtype, _, cap = run.partition(" cap ")
    model = dataclasses.replace(MODEL, logit_softcap=float(cap or 0))
    return selfcheck.launches(TrainConfig(dtype=dtype, z_loss=1e-4), model, torch.float32)


CAPPED, LOSS, NORM = ("bf16 cap 15", "bf16 cap 30", "fp32 cap 15"), ("bf16", "bf16 cap 30", "fp32"), ("bf16", "fp32")
MUTANTS = [
    Mutant(
        "the loss ignores the cap",
        "cross_entropy",
        "return tl.where(x < 0, -cap * t, cap * t), 4.0 * e * r * r",
        "return x, 4.0 * e * r * r",
        CAPPED,
    ),
    Mutant("the gradient drops the cap's slope", "cross_entropy", "g *= slope", "g *= 1.0", CAPPED),
    Mutant(
        "the gradient drops z-loss's", "cross_entropy", "(1.0 + 2.0 * z_loss * lse)", "(1.0 + 0.0 * z_loss * lse)", LOSS
    ),
    Mutant("the gradient halves z-loss's", "cross_entropy", "(1.0 + 2.0 * z_loss * lse)", "(1.0 + z_loss * lse)", LOSS),
    Mutant("the loss leaves z-loss out", "cross_entropy", "lse - x_y + z, 0.0)", "lse - x_y, 0.0)", LOSS),
    Mutant(
        "the loss counts ignored rows",
        "cross_entropy",
        "valid = row_mask & (y != ignore_index)",
        "valid = row_mask",
        LOSS,
    ),
    Mutant(
        "the loss skips the last row", "cross_entropy", "row_mask = rows < n_rows", "row_mask = rows < n_rows - 1", LOSS
    ),
    Mutant(
        "the sweep forgets to rescale its running sum",
        "cross_entropy",
        "d = d * tl.exp(m - shift) + ",
        "d = d + ",
        ("fp32",),  # two tiles of the sweep in fp32 (4096 each); bf16's 9001 fit one tile and a ragged one
    ),
    Mutant("the norm ignores eps", "rms_norm", "/ n_cols + eps).to(", "/ n_cols).to(", NORM),
    Mutant("the norm squares eps", "rms_norm", "/ n_cols + eps).to(", "/ n_cols + eps * eps).to(", NORM),
    Mutant(
        "the norm skips the last column",
        "rms_norm",
        "rows < n_rows, cols < n_cols",
        "rows < n_rows, cols < n_cols - 1",
        NORM,
    ),
    Mutant("the norm's backward overwrites dw", "rms_norm", "dw += tl.sum(", "dw = tl.sum(", NORM),
    Mutant(
        "the norm's backward drops the mean term",
        "rms_norm",
        "dx = (wdy - x_hat * c[:, None]) * rstd[:, None]",
        "dx = wdy * rstd[:, None]",
        NORM,
    ),
    Mutant("the norm's backward skips each program's last row", "rms_norm", "rows < last", "rows < last - 1", NORM),
    Mutant(
        "the fp32 weight gradient keeps the last chunk's only",
        "linear_cross_entropy",
        "acc.addmm_(a, b)",
        "acc.copy_(a @ b)",
        ("fp32",),
    ),
    Mutant(
        "the bf16 product's sum keeps the last chunk's only",
        "linear_cross_entropy",
        "acc += (a @ b).float()",
        "acc.copy_((a @ b).float())",
        ("bf16",),  # on a CPU: addmm there cannot sum a bf16 product into fp32
    ),
]


def _rounded_to_nearest(monkeypatch) -> None:
    """Triton's interpreter casting fp32 to bf16 to the nearest even, as a GPU does (it truncates)."""
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter.InterpreterBuilder.cast_impl

    def cast(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return truncating(self, src, dst_type)
        rounded = torch.from_numpy(np.asarray(src.data, np.float32)).bfloat16()
        return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast)


@pytest.fixture
def interpreted(monkeypatch):
    """The Triton kernels run through the interpreter, rounding as a GPU does."""
    _interpret(monkeypatch)
    _rounded_to_nearest(monkeypatch)
    with _language_restored():
        yield


def install(mutant: Mutant | None, tmp_path, monkeypatch) -> None:
    """The kernel modules loaded from copies in `tmp_path`, `mutant`'s changed (none for None), in
    place of the real ones (in sys.modules and as the package's attributes, where the ops import
    them from)."""
    package = sys.modules["fastpt.kernels.ops"]
    for name in KERNEL_MODULES:
        source = (REPO / "kernels" / "ops" / f"{name}.py").read_text()
        if mutant and name == mutant.module:
            assert source.count(mutant.old) == 1, f"{mutant.what}: {mutant.old!r} is not in {name}.py once"
            source = source.replace(mutant.old, mutant.new)
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"{package.__name__}.{name}", path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)
        monkeypatch.setattr(package, name, module)
        spec.loader.exec_module(module)


@pytest.mark.parametrize(
    "mutant, run", [(m, run) for m in MUTANTS for run in m.runs], ids=lambda x: getattr(x, "what", x)
)
def test_a_broken_kernel_is_caught(interpreted, tmp_path, monkeypatch, mutant, run):
    install(mutant, tmp_path, monkeypatch)
    # The model's loss is linear + cross-entropy, whose launches run the cross-entropy kernel.
    op = "rms_norm" if mutant.module == "rms_norm" else "linear_cross_entropy"
    found = selftest.failures([x for x in run_launches(run) if x.op == op], CPU)
    assert list(found) == [op], f"{mutant.what} passed the probes of a {run} run"


@pytest.mark.parametrize("run", ["fp32", "fp32 cap 15", "bf16", "bf16 cap 15", "bf16 cap 30"])
def test_the_real_kernels_pass_over_seeds(interpreted, tmp_path, monkeypatch, run):
    """No false alarm: the real kernels, copied and loaded as the mutants are, pass every probe of
    the run over several seeds."""
    install(None, tmp_path, monkeypatch)
    for seed in range(3):
        assert selftest.failures(run_launches(run), CPU, seed) == {}, seed
