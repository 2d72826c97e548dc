"""bench train_step's report: the markdown table (a header line with what was measured, one row per
mode: tok/s and its ratios, planned vs measured peak and tok/s, MFU) and the figures it adds to the
rows (MFU, each loss's difference to the first measured one)."""

from __future__ import annotations

import torch

from bench.common import fmt, kernel_rows_note, markdown_table
from fastpt.plan import gpus


def losses_agree(rows: list[dict], rtol: float) -> bool:
    """Annotate each measured row with its loss's relative difference to the first measured row's;
    some mode measured, none errored and all within rtol? (A skipped row is neither.)"""
    ok = [r for r in rows if "loss" in r]
    for r in ok:
        r["loss_rel_diff"] = abs(r["loss"] - ok[0]["loss"]) / abs(ok[0]["loss"])
    return bool(ok) and not any("error" in r for r in rows) and all(r["loss_rel_diff"] <= rtol for r in ok)


def ratio(row: dict, rows: list[dict], name: str) -> str:
    ref = next((r for r in rows if r["mode"] == name and "tok_s" in r), None)
    return f"{row['tok_s'] / ref['tok_s']:.2f}x" if ref and "tok_s" in row else "–"


def markdown(rows: list[dict], info: dict, planned_on: str) -> str:
    """A header line with what was measured, then one table row per mode (planned tok/s on the card
    named `planned_on`)."""
    device = info["device_name"] + (f", threads {info['cpu_threads']}" if info["device"] == "cpu" else "")
    head = (
        f"train step · preset {info['preset']} ({info['params']:,} params) · {device} · "
        f"{info['dtype']} · {info['micro_batch']} x {info['seq_len']} x {info['grad_accum']} accum = "
        f"{info['tokens_per_step']:,} tok/step · {info['steps']} steps after {info['warmup']} warm-up · "
        f"data: {info['data']} · torch {info['torch']} · triton {info['triton']} · commit {info['commit']}"
    )
    if info["matmul_tflops"]:
        head += f" · bf16 matmul ceiling {info['matmul_tflops']:.0f} TFLOP/s"
    if info.get("cuda_context_gib") is not None:
        head += f" · CUDA context {info['cuda_context_gib']:.2f} GiB (planned {gpus.CUDA_CONTEXT / 2**30:.2f})"
    header = [
        "mode",
        "tok/s",
        "vs eager",
        "vs baseline",
        "step ms",
        "peak GiB",
        "planned GPU peak",
        "planned tok/s",
        "MFU",
        "MFU vs matmul",
        "loss",
        "compile s",
        "data wait %",
        "new graphs",
    ]
    table = []
    for r in rows:
        if "tok_s" not in r:
            why = f"error: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            table.append([r["mode"], why] + [""] * (len(header) - 2))
            continue
        table.append(
            [
                r["mode"],
                f"{r['tok_s']:,.0f}",
                ratio(r, rows, "eager"),
                ratio(r, rows, "baseline"),
                f"{r['step_ms']:.1f}",
                f"{r['peak_mem_gib']:.2f}",
                planned_vs_measured(r, info["device"]),
                planned_vs_measured(r, info["device"], "planned_tok_s", "tok_s"),
                fmt(r["mfu"], ".2f"),
                fmt(r["mfu_matmul"], ".2f"),
                f"{r['loss']:.5f}",
                f"{r['compile_s']:.1f}",
                f"{r['data_wait_pct']:.1f}",
                str(r["graphs_after_warmup"]),
            ]
        )
    mem = "CUDA max_memory_allocated" if info["device"] == "cuda" else "peak RSS growth of the mode's process"
    mem += "; planned GPU peak = fastpt.plan's max_memory_allocated for the step on a GPU, traced on the CPU"
    mem += f"; planned tok/s = fastpt.plan.timing's for the step on {planned_on}"
    with_kernels = any("+kernels" in r["mode"] for r in rows)
    note = kernel_rows_note(torch.device(info["device"]), "+kernels rows") if with_kernels else ""
    return f"{head}\n\n{markdown_table(header, table)}\n\npeak GiB = {mem}; new graphs = compiles after warm-up" + (
        f"; {note}." if note else "."
    )


def planned_vs_measured(row: dict, device: str, key: str = "planned_gib", measured: str = "peak_mem_gib") -> str:
    """The planned GiB (or tok/s); on a GPU also its difference from the measured one."""
    planned = row.get(key)
    if planned is None:
        return "–"
    text = f"{planned:.2f}" if key == "planned_gib" else f"{planned:,.0f}"
    if device != "cuda":
        return text
    return f"{text} ({100 * (planned / row[measured] - 1):+.1f}%)"


def add_mfu(rows: list[dict], peak: float | None, ceiling_tflops: float | None) -> None:
    """Model FLOPs utilization against the device's peak table and against the measured matmul."""
    for r in rows:
        if "tok_s" in r:
            flops = r["flops_per_token"] * r["tok_s"]
            r["mfu"] = flops / peak if peak else None
            r["mfu_matmul"] = flops / (ceiling_tflops * 1e12) if ceiling_tflops else None
