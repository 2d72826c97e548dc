"""Trace each published row once; pickle its Plan's kernel log; print the step with this checkout's timing."""

import dataclasses
import pickle
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from rows import ROWS

from fastpt.cli import parse_args
from fastpt.plan import gpus, planner

only = sys.argv[2:]
out = sys.argv[1]
for name, card, world, flags in ROWS:
    if only and name not in only:
        continue
    t0 = time.time()
    argv = flags.split() + ["--plan-gpu", card, "--plan-world-size", str(world)]
    cli, cf = parse_args(argv)
    cfg, target = planner.planned_config(cli, cf)
    plan = planner.trace(cfg, target, cfg.plan_world_size)
    plan = dataclasses.replace(plan, card=gpus.card(card))
    st = plan.step_time()
    with open(f"{out}/{name}.pkl", "wb") as f:
        pickle.dump((name, card, plan.kernels), f)
    ms = {k: round(v * 1e3, 1) for k, v in st.parts.items()}
    print(f"{name}: {st.seconds * 1e3:.1f} ms parts {ms} cpu {st.cpu_seconds * 1e3:.1f} bound {st.bound}", end=" ")
    print(f"launches {st.launches} fits {plan.fits()} ({time.time() - t0:.0f}s)", flush=True)
