"""The sm_90 compile gate, no GPU needed: every kernel compiled for an H200 at the launch the
launchers pick at the real shapes (bench/aot.py), and what the compiler made of it checked. The
launches of a whole run, and of its self-check's probes, come from the run's model as
fastpt.selfcheck records them, not from a list written here.

It runs under whatever Triton is installed (3.9 in CI; 3.6, the GPU machine's, in a scratch venv:
`pip install torch==2.13.0 triton==3.6.0`). `pytest -s tests/test_aot.py -m slow` prints the table.
"""

import functools

import pytest
import torch

from bench import aot
from fastpt import selfcheck

pytest.importorskip("triton.backends.nvidia")  # the compiler and its ptxas / cuobjdump

# Triton 3.9's notice that its FP-fusion default changes in 3.10: the kernels compile with today's
# default (fusion on), as a real launch would.
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
SHARED_LIMIT = 227 * 1024


@functools.cache
def _compiled(name: str) -> list[aot.Compiled]:
    call, _ = aot.cases()[name]
    return aot.compile_case(call)


def _check(name: str) -> None:
    """Compiles, no spill, shared memory within the per-program limit, enough programs per SM,
    and 128-bit global accesses where the rows allow them."""
    _, vectorizable = aot.cases()[name]
    compiled = _compiled(name)
    assert compiled, f"{name}: no launch intercepted"
    for c in compiled:
        what = f"{name}: {c}"
        assert c.spill_stores == 0 and c.spill_loads == 0, what
        assert c.shared <= SHARED_LIMIT, what
        if c.kernel == "_rms_norm_bwd_kernel":  # 4+ programs, or 2 of 16 warps at hidden 4096: half the SM
            assert c.programs_per_sm >= 4 or c.programs_per_sm * c.num_warps >= 32, what
        else:
            assert c.programs_per_sm >= 2, what
        if vectorizable:
            # Row data moves in 128-bit accesses; at most one narrower scalar, the target logit.
            assert max(c.global_loads) == 128 and max(c.global_stores, default=128) in (32, 128), what
            narrow = sum(n for width, n in (c.global_loads + c.global_stores).items() if width < 32)
            assert narrow <= 1, what
            if any(w == 128 for w in c.global_stores) or "GRAD=True" in str(c.constexprs):
                assert max(c.global_stores) == 128, what


def test_cross_entropy_compiles_for_sm90():
    """The default run's share: the training loss's kernel, loss and gradient in one launch."""
    _check("linear_cross_entropy 32768x512->32000 bf16")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(aot.cases()))
def test_every_kernel_compiles_for_sm90(name):
    _check(name)


@pytest.mark.slow
def test_print_table():
    results = {name: _compiled(name) for name in aot.cases()}
    print("\n" + aot.table(results))
    assert len(results) == len(aot.cases())


@pytest.mark.slow
def test_launch_plans_for_h200():
    """The launchers' choices as intercepted: the standalone cross-entropy one 32k row per program
    in blocks of 8192 at 8 warps, loss pass and gradient pass; the RMSNorm backward over at most
    4 x 132 programs, its forward over many more."""
    loss, grad = _compiled("cross_entropy 32768x32000 bf16 +grad")
    for c, passes in ((loss, (True, False)), (grad, (False, True))):
        assert c.grid == (32768,) and c.num_warps == 8
        assert (c.constexprs["WITH_LOSS"], c.constexprs["WITH_GRAD"], c.constexprs["ROWS"], c.constexprs["BLOCK"]) == (
            *passes,
            1,
            8192,
        )
    rms_fwd, rms_bwd = _compiled("rms_norm 65536x512 bfloat16")
    assert rms_bwd.grid[0] <= 4 * aot.H200_SMS < rms_fwd.grid[0]


def test_weight_gradient_traffic_at_the_0_04b_shape():
    """At most ~1.1 GB of fp32 weight-gradient reads + writes per step at 32768 x 512 ->
    32000, and about +0.3 GiB for one chunk of logits and that gradient."""
    (c,) = _compiled("linear_cross_entropy 32768x512->32000 bf16")
    chunks = -(-32768 // c.grid[0])
    assert chunks * 2 * 32000 * 512 * 4 <= 1.1e9
    assert (c.grid[0] * 32000 * 2 + 32000 * 512 * 4) / 2**30 <= 0.31


def test_sm_count_override_is_restored():
    from fastpt.kernels.ops import _launch

    with aot.sm90(7):
        assert _launch.max_programs(torch.device("meta")) == 4 * 7
    assert _launch.SM_COUNT is None and _launch.max_programs(torch.device("cpu")) == 4


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["seed", "modern", "modern-softcap"])
def test_the_kernel_probe_compiles_what_the_run_compiles(recipe):
    """On a GPU the self-check's compiles are the run's own (equal cache keys) for every launch its
    model makes, QK-norm's over the head size under modern included and the capped loss's under
    modern-softcap (--logit-softcap 15), but for the RMSNorm backward's over the hidden size, whose
    rows per program differ: the planned cost in docs/kernels.md. Both lists come from the run's
    model: the probe's as fastpt.selfcheck records it, the run's compiled at its own shapes."""
    cfg, mcfg = aot.planned("--preset", "0.04b", "--recipe", recipe, "--dtype", "bf16", "--micro-batch", "16")
    launches = selfcheck.launches(cfg, mcfg, torch.float32)
    keys, caps = {}, set()
    for name, call in (("probe", lambda: aot.probe_launches(launches)), ("run", lambda: aot.run_launches(cfg, mcfg))):
        compiled = aot.compile_case(call)
        keys[name] = {(c.kernel, c.signature, str(c.constexprs)): c.key for c in compiled}
        caps |= {c.constexprs["SOFTCAP"] for c in compiled if c.kernel == "_cross_entropy_kernel"}
    assert caps == {15.0 if recipe == "modern-softcap" else 0.0}, caps
    norms = 2 if recipe.startswith("modern") else 1  # the hidden size's, and QK-norm's (bf16 x, fp32 weight)
    assert keys["probe"].keys() == keys["run"].keys() and len(keys["run"]) == 2 + 2 * norms, keys
    qk_norm = [
        k for k in keys["run"] if k[0] == "_rms_norm_fwd_kernel" and k[1].startswith("*bf16 i32 *bf16 i32 *fp32")
    ]
    assert len(qk_norm) == norms - 1, keys
    differ = [kernel for kernel, key in keys["probe"].items() if keys["run"][kernel] != key]
    assert [(kernel, signature[:5]) for kernel, signature, _ in differ] == [("_rms_norm_bwd_kernel", "*fp32")], differ
