"""python -m bench plan: fastpt.plan checked against reality on this CPU, and timed.

Accuracy: for CPU runs, the plan (python -m fastpt.train --plan --device cpu ...) against the CPU
allocator's real peak over the same two steps (torch.profiler's memory events: every allocation
and free of torch's CPU allocator, from building the model on). Speed: each plan of PLAN_TIMINGS as
its own `python -m fastpt.train --plan` process, wall time from start to exit (imports included).

    python -m bench plan [--save DIR] [--skip-timings] [--skip-compiled]
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import REPO, env_info, markdown_table
from fastpt import distributed
from fastpt.cli import parse_args
from fastpt.config import resolve
from fastpt.hf import write_json
from fastpt.plan import planner, published
from fastpt.plan.memory import running_peak
from fastpt.step import build_model, train_step

# CPU runs: the plan against the allocator (tiny shapes, so the real steps run in seconds; the
# compiled ones pay Inductor's C++ compile, a minute or more on a loaded 2-core machine)
ACCURACY = {
    "eager fp32": "--preset tiny --vocab-size 512 --micro-batch 8 --seq-len 128 --dtype fp32",
    "eager bf16, accum 2": "--preset tiny --vocab-size 512 --micro-batch 8 --seq-len 128 --dtype bf16 --grad-accum 2",
    "eager bf16, AC full": "--preset tiny --vocab-size 512 --micro-batch 8 --seq-len 128 --dtype bf16 "
    "--activation-checkpointing full --grad-accum 2",
    "eager bf16, muon": "--preset tiny --vocab-size 512 --micro-batch 8 --seq-len 128 --dtype bf16 --optimizer muon",
    "compiled fp32": "--preset tiny --vocab-size 512 --micro-batch 8 --seq-len 128 --dtype fp32 --compile",
    "compiled bf16, accum 2": "--preset tiny --vocab-size 512 --micro-batch 8 --seq-len 128 --dtype bf16 "
    "--grad-accum 2 --compile",
}
# GPU plans timed (the targets: a 1b plan within 30 s, an 8B one within 2 minutes; the 1b
# compiled --micro-batch auto search took 5 minutes before a deep model was planned from two shallow traces)
LLAMA3_8B = next(run for run in published.RUNS if run.name == "torchtitan Llama 3.1 8B")
PLAN_TIMINGS = {
    "0.04b": "--preset 0.04b",
    "0.04b compiled": "--preset 0.04b --compile",
    "1b": "--preset 1b --plan-gpu h100-80",
    "1b compiled, micro-batch auto": "--preset 1b --compile --micro-batch auto --plan-gpu h100-80",
    "1b FSDP x 8, AC full, compiled": "--preset 1b --parallel fsdp --plan-world-size 8 "
    "--activation-checkpointing full --compile",
    "Llama 3.1 8B FSDP x 8, AC selective": " ".join(LLAMA3_8B.argv),
}


def allocator_peak(args: list[str]) -> int:
    """Bytes: the CPU allocator's peak over two real steps of the CPU run these flags describe, built
    and stepped as the plan builds and steps it (step.build_model, step.train_step, at most two
    micro-steps), on random tokens."""

    cli, config_file = parse_args(args)
    cfg = resolve(cli, config_file, "cpu")
    mcfg = planner.planned_model(cfg)
    loader = planner.FakeLoader(cfg.micro_batch, cfg.seq_len or mcfg.max_seq_len, mcfg.vocab_size)
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            net = build_model(cfg, mcfg, torch.device("cpu"), distributed.ONE_PROCESS)
            for _ in range(2):
                train_step(net, loader, planner.step_config(cfg))
    finally:
        gc.enable()
        torch._dynamo.reset()
    cpu = torch._C._autograd.DeviceType.CPU
    memory = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    return running_peak((e.start_ns(), e.nbytes()) for e in memory)[0]


def planned_peak(args: list[str]) -> int:
    """Bytes: the plan's peak for the CPU run these flags describe."""
    cli, config_file = parse_args(args)
    cfg, target = planner.planned_config({**cli, "device": "cpu"}, config_file)
    return planner.trace(cfg, target, 1).peak.bytes


def accuracy_rows(skip_compiled: bool) -> list[dict]:
    rows = []
    for name, flags in ACCURACY.items():
        if skip_compiled and "--compile" in flags:
            continue
        args = flags.split() + ["--device", "cpu"]
        planned, real = planned_peak(args), allocator_peak(args)
        rows.append({"config": name, "flags": flags, "planned": planned, "real": real, "error": planned / real - 1})
        print(f"bench plan: {name}: planned {planned:,} B, real {real:,} B ({rows[-1]['error']:+.2%})", flush=True)
    return rows


def timing_rows() -> list[dict]:
    rows = []
    for name, flags in PLAN_TIMINGS.items():
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "fastpt.train", "--plan", *flags.split()],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        )
        wall = time.perf_counter() - t0
        peak = next((line for line in proc.stdout.splitlines() if line.startswith("peak")), proc.stderr[-300:])
        rows.append({"plan": name, "flags": flags, "wall_s": wall, "rc": proc.returncode, "peak": peak})
        print(f"bench plan: {name}: {wall:.1f} s, {peak}", flush=True)
    return rows


def markdown(accuracy: list[dict], timings: list[dict], info: dict) -> str:
    head = (
        f"fastpt.plan on {info['device_name']} · torch {info['torch']} · commit {info['commit']} · "
        f"load average {info['load']}"
    )
    parts = [head]
    if accuracy:
        table = [
            [r["config"], f"`{r['flags']}`", f"{r['planned']:,}", f"{r['real']:,}", f"{r['error']:+.2%}"]
            for r in accuracy
        ]
        parts.append(markdown_table(["CPU run", "flags", "planned B", "allocator peak B", "plan error"], table))
    if timings:
        table = [[r["plan"], f"`{r['flags']}`", f"{r['wall_s']:.1f}", r["peak"]] for r in timings]
        parts.append(markdown_table(["plan for CUDA", "flags", "wall s", "result"], table))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench plan", description=__doc__)
    ap.add_argument("--save", help="write planner.json and planner.md into this folder")
    ap.add_argument("--skip-timings", action="store_true")
    ap.add_argument("--skip-compiled", action="store_true", help="leave out the compiled accuracy rows (slow)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    info = {**env_info(torch.device("cpu")), "load": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    accuracy = accuracy_rows(args.skip_compiled)
    timings = [] if args.skip_timings else timing_rows()
    info["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    table = markdown(accuracy, timings, info)
    print(table)
    if args.save:
        write_json(Path(args.save) / "planner.json", {"info": info, "accuracy": accuracy, "timings": timings})
        (Path(args.save) / "planner.md").write_text(table + "\n")
    worst = max((abs(r["error"]) for r in accuracy), default=0.0)
    return 0 if worst <= 0.06 and all(r["rc"] == 0 for r in timings) else 1


if __name__ == "__main__":
    sys.exit(main())
