"""Kernel table: fastpt's kernels vs torch eager, torch.compile and peers, forward + backward.

python -m bench kernels [--device cuda|cpu] [--ops LIST] [--providers LIST] [--json PATH] [--markdown PATH]

On CUDA: bf16 at the 0.04b model's shapes (32k tokens x dim 512, vocab 32000),
triton.testing.do_bench medians and the extra memory one call allocates (max_memory_allocated
minus what was allocated before; the input gradients are part of it). On CPU: fp32 at small
shapes, wall-clock medians, memory shown as "–"; there fastpt dispatches to its reference unless
TRITON_INTERPRET=1, so the table only checks the harness. Each row also has a floor: the bytes
the op must move over the copy bandwidth measured at the start of the run, or its matmul FLOPs
over a matmul measured then, whichever is longer, and the provider's time as a % of it.
Liger and torch's chunked F.linear_cross_entropy join when importable / present.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import check_outputs, env_info, fmt, kernel_rows_note, markdown_table, matmul_tflops, sync
from fastpt.files import write_output
from fastpt.hf import write_json
from fastpt.kernels import api as kernels
from fastpt.kernels import reference

EPS = 1e-6
# op -> (CUDA shape, CPU shape); linear_cross_entropy is (N, D, V), the others (N, D) / (N, V)
SHAPES = {
    "rms_norm": ((65536, 512), (1024, 512)),
    "cross_entropy": ((32768, 32000), (512, 4096)),
    "linear_cross_entropy": ((32768, 512, 32000), (512, 128, 4096)),
}
IGNORED = 0.05  # fraction of targets set to ignore_index, as in real padded batches


def make_inputs(op: str, shape: tuple, device: torch.device, dtype: torch.dtype, seed: int = 0) -> list:
    """The op's arguments, drawn on the device; floating tensors are leaves that require grad."""
    g = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *size: torch.randn(*size, generator=g, device=device)
    if op == "rms_norm":
        n, d = shape
        args = [randn(n, d), 1 + 0.1 * randn(d)]
    else:
        n, v = shape[0], shape[-1]
        target = torch.randint(0, v, (n,), generator=g, device=device)
        target[torch.rand(n, generator=g, device=device) < IGNORED] = -100
        args = (
            [2 * randn(n, v), target]
            if op == "cross_entropy"
            else [randn(n, shape[1]), 0.02 * randn(v, shape[1]), target]
        )
    return [a.to(dtype).requires_grad_() if a.is_floating_point() else a for a in args]


def liger_providers(op: str) -> dict[str, Callable]:
    """Liger's kernels when the package is installed (none otherwise)."""
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
        from liger_kernel.transformers.functional import liger_rms_norm
    except ImportError:
        return {}
    if op == "rms_norm":
        return {"liger": lambda x, w: liger_rms_norm(x, w, EPS)}
    if op == "cross_entropy":
        return {"liger": LigerCrossEntropyLoss()}
    flce = LigerFusedLinearCrossEntropyLoss()
    return {"liger": lambda x, w, t: flce(w, x, t)}  # Liger takes the weight first


def reference_fn(op: str) -> Callable:
    """The pure-PyTorch op (what the model runs with --kernels torch), taking the table's arguments."""
    ref = getattr(reference, op)
    return (lambda x, w: ref(x, w, EPS)) if op == "rms_norm" else ref


def providers(op: str, device: torch.device) -> dict[str, Callable]:
    """Every implementation of `op` available here, by name; "torch" is the eager reference."""
    backend = "triton" if device.type == "cuda" else "auto"
    fastpt_op = getattr(kernels, op)
    out = {"torch": reference_fn(op), "torch.compile": torch.compile(reference_fn(op))}
    if op == "rms_norm":
        out["F.rms_norm"] = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS)
        out["fastpt"] = lambda x, w: fastpt_op(x, w, EPS, backend=backend)
    else:
        out["fastpt"] = lambda *args: fastpt_op(*args, backend=backend)
    if op == "cross_entropy":  # the gradient overwrites the logits: one (N, V) buffer, not two
        out["fastpt-inplace"] = lambda logits, t: fastpt_op(logits, t, inplace_backward=True, backend=backend)
    if op == "linear_cross_entropy" and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        options = torch.nn.LinearCrossEntropyOptions()  # opts in to torch's chunked path
        out["F.linear_cross_entropy"] = lambda x, w, t: F.linear_cross_entropy(
            x, w, t, ignore_index=-100, options=options
        )
    return {**out, **liger_providers(op)}


def fwd_bwd(fn: Callable, args: list) -> torch.Tensor:
    """One forward + backward from fresh gradients; returns the forward output."""
    for a in args:
        a.grad = None
    out = fn(*args)
    out.backward(torch.ones_like(out) if out.dim() else None)
    return out


def grads(out: torch.Tensor, args: list) -> list[torch.Tensor]:
    return [out.detach(), *(a.grad for a in args if a.requires_grad)]


def oracle(op: str, args: list, dtype: torch.dtype) -> list[torch.Tensor]:
    """Output and input gradients of the reference in a wider dtype (fp64 for fp32, fp32 for bf16)."""
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    wide_args = [a.detach().to(wide).requires_grad_() if a.is_floating_point() else a for a in args]
    return grads(fwd_bwd(reference_fn(op), wide_args), wide_args)


def max_rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Worst over output and gradients of max |got - want| / max |want|."""
    return max(
        ((g.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)).item()
        for g, w in zip(got, want)
    )


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds per call (do_bench on CUDA, a wall clock on CPU)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median")
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + 1.0
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 100):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def extra_gib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Memory one call allocates beyond what existed before it, outputs and gradients included."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def min_work(op: str, shape: tuple, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes, FLOPs) a forward + backward of `op` cannot do without."""
    size = dtype.itemsize
    if op == "rms_norm":
        n, d = shape
        return 5 * n * d * size, 0  # read x, write y; read dy and x, write dx
    if op == "cross_entropy":
        n, v = shape
        return 2 * n * v * size, 0  # read the logits, write their gradient
    n, d, v = shape
    return 2 * (n * d + v * d) * size, 6 * n * d * v  # inputs in, their gradients out; 3 (N, D) x (D, V) matmuls


def copy_gbps(device: torch.device) -> float:
    """Device-memory copy bandwidth measured now, GB/s (bytes read + written per second)."""
    x = torch.empty((2**30 if device.type == "cuda" else 2**26) // 4, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), device)
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e9


def matmul_gflops(device: torch.device, dtype: torch.dtype) -> float:
    """A square matmul's GFLOP/s measured now (bf16 8192^3 on CUDA, 1024^3 in dtype on a CPU)."""
    if device.type == "cuda":
        return 1e3 * matmul_tflops(device)
    a, b = (torch.randn(1024, 1024, dtype=dtype) for _ in range(2))
    return 2 * 1024**3 / (time_ms(lambda: a @ b, device) * 1e-3) / 1e9


def floor_ms(op: str, shape: tuple, dtype: torch.dtype, ceilings: dict) -> float:
    """The least time the op can take at the measured bandwidth and matmul speed."""
    nbytes, flops = min_work(op, shape, dtype)
    return 1e3 * max(nbytes / (ceilings["copy_gbps"] * 1e9), flops / (ceilings["matmul_gflops"] * 1e9))


def bench_op(
    op: str, device: torch.device, dtype: torch.dtype, names: list[str] | None = None, ceilings: dict | None = None
) -> list[dict]:
    """One row per provider of `op`; a provider that raises gets a row with its error instead."""
    shape = SHAPES[op][device.type != "cuda"]
    want = oracle(op, make_inputs(op, shape, device, dtype), dtype)
    floor = floor_ms(op, shape, dtype, ceilings) if ceilings else None
    rows = []
    for name, fn in providers(op, device).items():
        if names and name not in names:
            continue
        args = make_inputs(op, shape, device, dtype)  # fresh: Liger and fastpt-inplace overwrite the logits
        row = {"op": op, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "provider": name}
        try:
            row["rel_err"] = max_rel_err(grads(fwd_bwd(fn, args), args), want)
            row["ms"] = time_ms(lambda: fwd_bwd(fn, args), device)
            row["extra_gib"] = extra_gib(lambda: fwd_bwd(fn, args), device)
            row["floor_ms"] = floor
        except Exception as e:  # a peer that fails (say, under compile) is a result, not a crash
            row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:200]
        rows.append(row)
    return rows


def speedup(row: dict, rows: list[dict], provider: str) -> str:
    ref = next((r for r in rows if r["op"] == row["op"] and r["provider"] == provider and "ms" in r), None)
    return f"{ref['ms'] / row['ms']:.2f}x" if ref and "ms" in row else "–"


def _floor(row: dict) -> list[str]:
    floor = row.get("floor_ms")
    return ["–", "–"] if floor is None else [f"{floor:.3f}", f"{100 * floor / row['ms']:.0f}%"]


def markdown(rows: list[dict], env: dict) -> str:
    head = (
        f"kernels, forward + backward · {env['device_name']} · torch {env['torch']} · triton {env['triton']} "
        f"· liger {env['liger_kernel'] or 'not installed'} · commit {env['commit']}"
    )
    if env.get("copy_gbps"):
        head += f" · copy {env['copy_gbps']:.0f} GB/s, matmul {env['matmul_gflops'] / 1e3:.3g} TFLOP/s measured now"
    note = kernel_rows_note(torch.device(env["device"]), "fastpt rows")
    if note:
        head += f"\n\n{note[0].upper()}{note[1:]}."
    header = [
        "op",
        "shape",
        "dtype",
        "provider",
        "ms",
        "floor ms",
        "% of floor",
        "vs torch",
        "vs torch.compile",
        "extra GiB",
        "max rel err",
    ]
    table = []
    for r in rows:
        first = [r["op"], " x ".join(map(str, r["shape"])), r["dtype"], r["provider"]]
        if "error" in r:
            table.append(first + [f"error: {r['error']}"] + [""] * (len(header) - len(first) - 1))
        else:
            table.append(
                first
                + [
                    f"{r['ms']:.3f}",
                    *_floor(r),
                    speedup(r, rows, "torch"),
                    speedup(r, rows, "torch.compile"),
                    fmt(r["extra_gib"], ".3f"),
                    f"{r['rel_err']:.1e}",
                ]
            )
    legend = (
        "speedups are the provider's ms over the torch / torch.compile ms of the same op (higher is faster); "
        "floor ms = max(bytes the op must move / copy bandwidth, matmul FLOPs / matmul speed), "
        "% of floor = floor ms / ms (100% = at the floor)"
    )
    return f"{head}\n\n{markdown_table(header, table)}\n\n{legend}."


def main(argv: list[str] | None = None) -> int:
    """Print the kernel table; non-zero only when fastpt's own kernels fail (peers may)."""
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="python -m bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu")
    ap.add_argument("--ops", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    ap.add_argument("--providers", default="", help="comma-separated subset (default: every one available)")
    ap.add_argument("--json", help="write every row (and the table) here")
    ap.add_argument("--markdown", help="write the table here")
    args = ap.parse_args(argv)
    check_outputs(ap, args, "json", "markdown")
    if args.device == "cuda" and not cuda:
        ap.error("--device cuda but torch sees no CUDA device")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = args.providers.split(",") if args.providers else None
    env = env_info(device)
    env.update(copy_gbps=copy_gbps(device), matmul_gflops=matmul_gflops(device, dtype))
    ceilings = {k: env[k] for k in ("copy_gbps", "matmul_gflops")}
    rows = []
    for op in args.ops.split(","):
        if op not in SHAPES:
            ap.error(f"unknown op {op!r}: choose from {', '.join(SHAPES)}")
        print(f"bench kernels: {op} ...", file=sys.stderr, flush=True)
        rows += [{**env, **r} for r in bench_op(op, device, dtype, names, ceilings)]
    table = markdown(rows, env)
    print(table)
    if args.json:
        write_json(args.json, {"kind": "kernels", "markdown": table, "rows": rows})
    if args.markdown:
        write_output(args.markdown, lambda f: f.write((table + "\n").encode()))
    return 1 if any("error" in r and r["provider"] == "fastpt" for r in rows) else 0
