"""fastpt's Triton kernels compiled for an H200 (sm_90) on a machine without a GPU.

python -m bench aot [--sms N] [--markdown PATH]

Each case calls a kernel launcher (kernels.ops) on meta tensors of the real shapes with the SM
count planned for set to the H200's 132, or runs a whole run's model over fake tensors with the
kernels' custom ops running their launchers (`run_launches`: every launch the run makes, as
fastpt.selfcheck records them; `probe_launches`: the self-check's probes of those). Every
`kernel[grid](...)` launch is intercepted (its tensors as meta tensors laid out alike): the
kernel goes through Triton's own JITFunction.run in warm-up mode (its binder decides the
signature, the constexprs and the pointer / divisibility-by-16 specialization, as for a real
launch) under a stand-in driver that reports an sm_90 device, so `triton.compile` builds the PTX
and ptxas the cubin; nothing is launched. ptxas's own -v log gives registers and spill bytes,
`cuobjdump -sass` the width of every global load and store. This proves what the compiler
makes of the kernels (registers, spills, occupancy, vectorization), not how fast they run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.library import CustomOpDef
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import check_outputs, git_commit, markdown_table
from fastpt import selfcheck
from fastpt.cli import parse_args
from fastpt.config import DTYPES, TrainConfig
from fastpt.distributed import Dist, param_dtype
from fastpt.files import write_output
from fastpt.kernels import api as kernels
from fastpt.kernels import functional, selftest
from fastpt.plan.planner import planned_config, planned_model
from fastpt.presets import ModelConfig

H200_SMS = 132
# Per-SM limits of compute capability 9.0 (CUDA programming guide, "Technical Specifications").
REGISTERS_PER_SM, MAX_THREADS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 2048, 32
SHARED_PER_SM, SHARED_PER_PROGRAM, SHARED_RESERVED = 228 * 1024, 227 * 1024, 1024
OPS_MODULES = (
    "fastpt.kernels.ops.cross_entropy",
    "fastpt.kernels.ops.linear_cross_entropy",
    "fastpt.kernels.ops.rms_norm",
)
M = torch.device("meta")


@dataclasses.dataclass
class Compiled:
    """One kernel as compiled for one launch configuration (identical launches counted once)."""

    kernel: str
    grid: tuple
    num_warps: int
    constexprs: dict
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    global_loads: collections.Counter  # access width in bits -> instructions
    global_stores: collections.Counter
    launches: int = 1  # launches that ran this compiled kernel (the chunks of a loop)
    key: str = ""  # Triton's cache key: launches with equal keys share one compile
    signature: str = ""  # the arguments' types ("*bf16 *fp32 i32 ..."): with the constexprs, which launch this is

    @property
    def programs_per_sm(self) -> int:
        """Programs of this kernel resident on one SM at once: registers (allocated per warp in
        units of 256), threads, shared memory and the per-SM program limit, whichever binds first."""
        regs_per_warp = -(-self.registers * 32 // 256) * 256
        by_regs = REGISTERS_PER_SM // regs_per_warp // self.num_warps
        by_threads = MAX_THREADS_PER_SM // (32 * self.num_warps)
        by_shared = SHARED_PER_SM // (self.shared + SHARED_RESERVED)
        return min(by_regs, by_threads, by_shared, MAX_PROGRAMS_PER_SM)


class _SM90Driver:
    """What JITFunction.run asks of the active driver, answered for an sm_90 device."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


_PTXAS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.DOTALL)
_GLOBAL = re.compile(r"\b(LDG|STG)\.E((?:\.[A-Z0-9]+)*)")


def _widths(sass: str, op: str) -> collections.Counter:
    """Global loads (LDG) or stores (STG) of the SASS by access width in bits."""
    out = collections.Counter()
    for kind, suffix in _GLOBAL.findall(sass):
        if kind == op:
            sizes = [int(s) for s in re.findall(r"\.[US]?(8|16|64|128)\b", suffix)]
            out[sizes[0] if sizes else 32] += 1
    return out


def _sass(cubin: bytes) -> str:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout


def _inspect(kernel, grid: tuple, log: str, launches: int) -> Compiled:
    regs = _PTXAS.search(log)
    if regs is None:
        raise RuntimeError(f"no ptxas -v report for {kernel.name}:\n{log}")
    sass = _sass(kernel.asm["cubin"])
    constexprs = getattr(kernel.src, "constants", None) or getattr(kernel.src, "constexprs", {})
    return Compiled(
        kernel=kernel.name,
        grid=tuple(grid),
        num_warps=kernel.metadata.num_warps,
        constexprs={kernel.src.fn.arg_names[k[0] if isinstance(k, tuple) else k]: v for k, v in constexprs.items()},
        registers=int(regs[3]),
        spill_stores=int(regs[1]),
        spill_loads=int(regs[2]),
        shared=kernel.metadata.shared,
        global_loads=_widths(sass, "LDG"),
        global_stores=_widths(sass, "STG"),
        launches=launches,
        key=kernel.hash,
        signature=" ".join(t for t in kernel.src.signature.values() if t != "constexpr"),
    )


def _meta(t: object) -> object:
    """A fake or meta tensor as a meta tensor laid out alike (its offset included: Triton specializes
    a pointer on its alignment); anything else as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    with unset_fake_temporarily():
        base = torch.empty(t.storage_offset() + extent, dtype=t.dtype, device=M)
        return base.as_strided(t.shape, t.stride(), t.storage_offset())


class _Intercepted:
    """Stands in for a JITFunction in its module: `kernel[grid](...)` compiles, records, launches nothing."""

    def __init__(self, fn, seen: dict):
        self.fn, self.seen = fn, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            args, kwargs = [_meta(a) for a in args], {k: _meta(v) for k, v in kwargs.items()}
            log = io.StringIO()
            with contextlib.redirect_stdout(log):  # ptxas's -v report, printed by Triton on request
                kernel = self.fn.run(*args, grid=grid, warmup=True, **kwargs)
            if id(kernel) in self.seen:  # identical launches (a chunk loop) compile once
                self.seen[id(kernel)][3] += 1
            else:
                self.seen[id(kernel)] = [kernel, grid, log.getvalue(), 1]

        return launch


@contextlib.contextmanager
def sm90(sms: int = H200_SMS):
    """Inside: launches of the kernels.ops kernels compile for sm_90 with `sms` SMs planned for, and
    are recorded in the yielded list instead of running."""
    import importlib

    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from fastpt.kernels.ops import _launch

    seen: dict = {}
    patches = []
    for name in OPS_MODULES:
        module = importlib.import_module(name)
        for attr, fn in list(vars(module).items()):
            # Kernels only (named *_kernel): a jit helper they call must stay a JITFunction, which
            # Triton hashes into the kernel's cache key (it cannot hash a stand-in).
            if isinstance(fn, JITFunction) and attr.endswith("_kernel"):
                patches.append((module, attr, fn, fn.device_caches))
                fn.device_caches = collections.defaultdict(fn.create_binder)  # keep the real device's cache apart
                setattr(module, attr, _Intercepted(fn, seen))
    before, active = _launch.SM_COUNT, driver._active  # None: Triton picks its default driver when asked
    compiled: list[Compiled] = []
    try:
        with knobs.compilation.scope(), knobs.nvidia.scope():
            knobs.compilation.always_compile = True  # a cache hit would print no ptxas report
            knobs.nvidia.dump_ptxas_log = True
            driver.set_active(_SM90Driver())
            _launch.SM_COUNT = sms
            yield compiled
            compiled += [_inspect(*launch) for launch in seen.values()]
    finally:
        _launch.SM_COUNT = before
        driver.set_active(active)
        for module, attr, fn, caches in patches:
            fn.device_caches = caches
            setattr(module, attr, fn)


class _RunBodies(TorchDispatchMode):
    """fastpt's custom ops run their bodies (the launchers) on fake tensors instead of their fakes, so
    that inside `sm90` every kernel a call would launch is intercepted; every other op as before."""

    def __init__(self):
        super().__init__()
        ops = (op for op in vars(functional).values() if isinstance(op, CustomOpDef))
        self.bodies = {op._qualname: op._init_fn for op in ops}  # torch's own names for them (private)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.bodies.get(func._schema.name, func)(*args, **(kwargs or {}))


def planned(*flags: str) -> tuple[TrainConfig, ModelConfig]:
    """The config and model of a GPU run of these fastpt.train flags, as --plan resolves them."""
    cfg, _ = planned_config(parse_args(list(flags))[0], None)
    return cfg, planned_model(cfg)


def run_launches(cfg: TrainConfig, mcfg: ModelConfig) -> None:
    """The kernels a run of `cfg` launches at its own shapes: its model's training step (one block:
    each launches alike) and evaluation's forward, as fastpt.selfcheck exercises them."""
    params = param_dtype(Dist(world_size=cfg.plan_world_size), cfg.parallel, DTYPES[cfg.dtype])
    seq_len = cfg.seq_len or mcfg.max_seq_len
    with kernels.tracing_only():
        selfcheck.exercise(cfg, mcfg, params, "triton", (cfg.micro_batch, seq_len), within=_RunBodies(), backward=True)


def probe_launches(launches: list[selftest.Launch]) -> None:
    """The kernels the self-check's probes of `launches` launch on a GPU (its rows and chunks)."""
    with FakeTensorMode(), kernels.tracing_only(), _RunBodies():
        for launch in launches:
            selftest.run(launch, selftest.probe_inputs(launch, torch.device("cpu"), gpu=True), "triton", [])


def _rms_norm(n: int, d: int, dtype: torch.dtype) -> None:
    from fastpt.kernels.ops import rms_norm

    x, w = torch.empty(n, d, device=M, dtype=dtype), torch.empty(d, device=M, dtype=dtype)
    _, rstd = rms_norm.rms_norm_forward(x, w, 1e-6)
    rms_norm.rms_norm_backward(torch.empty_like(x), x, w, rstd)


def _cross_entropy(n: int, v: int, with_grad: bool, z_loss: float, inplace: bool, softcap: float) -> None:
    from fastpt.kernels.ops import cross_entropy

    logits, target = torch.empty(n, v, device=M, dtype=torch.bfloat16), torch.empty(n, dtype=torch.long, device=M)
    _, _, lse = cross_entropy.cross_entropy_forward(logits, target, -100, z_loss, softcap=softcap)
    if with_grad:
        grad = logits if inplace else torch.empty_like(logits)
        ones = torch.ones((), device=M)
        cross_entropy.cross_entropy_backward(logits, target, lse, ones, -100, z_loss, grad, softcap)


def _linear_cross_entropy(n: int, d: int, v: int, softcap: float) -> None:
    from fastpt.kernels.ops import linear_cross_entropy

    x, w = torch.empty(n, d, device=M, dtype=torch.bfloat16), torch.empty(v, d, device=M, dtype=torch.bfloat16)
    target = torch.empty(n, dtype=torch.long, device=M)
    ones = torch.ones((), device=M)
    linear_cross_entropy.linear_cross_entropy_forward(x, w, target, -100, torch.bfloat16, 1e-4, ones, softcap)


def cases() -> dict[str, tuple[Callable[[], None], bool]]:
    """name -> (the launcher call, whether its rows allow 128-bit accesses), at the 0.04b and 1b
    models' shapes (and a 4096-wide one)."""
    out = {}
    for n, d in ((65536, 512), (32768, 2048), (8192, 4096)):
        for dtype in (torch.bfloat16, torch.float32):
            out[f"rms_norm {n}x{d} {str(dtype)[6:]}"] = (lambda n=n, d=d, dt=dtype: _rms_norm(n, d, dt), True)
    for n, v in ((32768, 32000), (16384, 50257), (32768, 128256)):
        for grad, z, inplace, cap, what in (
            (False, 0.0, False, 0.0, "loss"),
            (True, 0.0, False, 0.0, "+grad"),
            (True, 1e-4, False, 0.0, "+grad z-loss"),
            (True, 0.0, True, 0.0, "+grad in place"),
            (True, 0.0, False, 15.0, "+grad softcap 15"),
        ):
            out[f"cross_entropy {n}x{v} bf16 {what}"] = (
                lambda n=n, v=v, g=grad, z=z, i=inplace, c=cap: _cross_entropy(n, v, g, z, i, c),
                v % 8 == 0,
            )
    for d in (512, 2048):
        for v in (32000, 50257):
            for cap, what in ((0.0, ""), (15.0, " softcap 15")):  # --logit-softcap's kernel
                out[f"linear_cross_entropy 32768x{d}->{v} bf16{what}"] = (
                    lambda d=d, v=v, c=cap: _linear_cross_entropy(32768, d, v, c),
                    True,
                )
    # Every launch of a whole run, as its model makes them: QK-norm's over the head size among them;
    # modern-softcap's loss is the capped kernel's (--logit-softcap 15).
    for recipe in ("modern", "modern-softcap"):
        flags = ("--preset", "0.04b", "--recipe", recipe, "--dtype", "bf16", "--micro-batch", "16")
        out[f"0.04b {recipe} run 16x1024 bf16"] = (lambda flags=flags: run_launches(*planned(*flags)), True)
    return out


def compile_case(call: Callable[[], None], sms: int = H200_SMS) -> list[Compiled]:
    with sm90(sms) as compiled:
        call()
    return compiled


def _fmt_widths(c: collections.Counter) -> str:
    return " ".join(f"{w}b x{n}" for w, n in sorted(c.items(), reverse=True)) or "-"


def table(results: dict[str, list[Compiled]]) -> str:
    header = [
        "case",
        "kernel",
        "launches",
        "grid (first)",
        "warps",
        "constexprs",
        "regs",
        "spill st/ld B",
        "smem B",
        "programs/SM",
        "global loads",
        "global stores",
    ]
    rows = []
    for name, compiled in results.items():
        for c in compiled:
            rows.append(
                [
                    name,
                    c.kernel.removeprefix("_"),
                    str(c.launches),
                    "x".join(map(str, c.grid)),
                    str(c.num_warps),
                    " ".join(f"{k}={v}" for k, v in c.constexprs.items()),
                    str(c.registers),
                    f"{c.spill_stores}/{c.spill_loads}",
                    str(c.shared),
                    str(c.programs_per_sm),
                    _fmt_widths(c.global_loads),
                    _fmt_widths(c.global_stores),
                ]
            )
    import triton

    head = (
        f"sm_90 AOT compile (compiled on this machine, nothing run) · triton {triton.__version__} · "
        f"torch {torch.__version__} · commit {git_commit()}"
    )
    return f"{head}\n\n{markdown_table(header, rows)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench aot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=H200_SMS, help="SMs the launchers plan for (default: an H200's 132)")
    ap.add_argument("--cases", default="", help="only cases whose name contains this")
    ap.add_argument("--markdown", help="write the table here")
    args = ap.parse_args(argv)
    check_outputs(ap, args, "markdown")
    results = {}
    for name, (call, _) in cases().items():
        if args.cases in name:
            print(f"bench aot: {name} ...", file=sys.stderr, flush=True)
            results[name] = compile_case(call, args.sms)
    text = table(results)
    print(text)
    if args.markdown:
        write_output(args.markdown, lambda f: f.write((text + "\n").encode()))
    return 0
