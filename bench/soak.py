"""A long CPU run watched from outside: python -m bench soak [--steps 20000] [--out bench/results/DIR]

fastpt.train (tiny preset) logs every step and evaluates and checkpoints often, while this
process samples the trainer's resident memory and open file descriptors and checks that
metrics.jsonl only ever ends at a whole record. Afterwards the newest checkpoint is set aside
and the run resumed from the one before: its per-step losses must equal the long run's exactly.
Growth is measured from the end of warm-up (the first `--warmup` steps) to the end of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, env_info, markdown_table
from fastpt import checkpoint
from fastpt.hf import write_json
from fastpt.prepare import prepare


class Watcher:
    """Samples the trainer's RSS (MiB) and open fds, and reads metrics.jsonl's new bytes: they must
    end at a record's end (one write per record), and every record parses."""

    def __init__(self, pid: int, metrics: Path):
        self.pid, self.metrics, self.offset, self.steps, self.samples = pid, metrics, 0, 0, []

    def sample(self) -> None:
        status = Path(f"/proc/{self.pid}/status").read_text()
        rss_kib = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
        fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        new = b""
        if self.metrics.is_file():
            with open(self.metrics, "rb") as f:
                f.seek(self.offset)
                new = f.read()
        whole = not new or new.endswith(b"\n")
        if whole:
            records = [json.loads(line) for line in new.splitlines()]
            self.steps += sum("loss" in r for r in records)
            self.offset += len(new)
        self.samples.append(
            {"t": time.monotonic(), "rss_mib": rss_kib / 1024, "fds": fds, "whole": whole, "steps": self.steps}
        )


def train_args(data: Path, run: Path, steps: int, every: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fastpt.train",
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--dtype",
        "fp32",
        "--data",
        str(data),
        "--out",
        str(run),
        "--seq-len",
        "64",
        "--micro-batch",
        "8",
        "--max-steps",
        str(steps),
        "--warmup-steps",
        str(min(100, steps // 2)),
        "--log-every",
        "1",
        "--eval-every",
        str(every),
        "--eval-tokens",
        "4096",
        "--ckpt-every",
        str(every),
        "--keep-checkpoints",
        "3",
    ]


def watch(cmd: list[str], run: Path, log: Path, interval: float) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        watcher = Watcher(proc.pid, run / "metrics.jsonl")
        while proc.poll() is None:
            try:
                watcher.sample()
            except (OSError, StopIteration):  # the process ended between poll and read
                pass
            time.sleep(interval)
    if proc.returncode:
        raise SystemExit(f"bench soak: the trainer exited {proc.returncode}; see {log}")
    return watcher.samples


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def step_ms(run: Path, tokens_per_step: int) -> list[float]:
    """Each logged step's training time (evals and checkpoints left out, as the trainer times it)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [1e3 * tokens_per_step / r["tok_s"] for r in records if "loss" in r]


def check_resume(data: Path, run: Path, every: int, steps: int, log: Path) -> dict:
    """Resume a copy of the run from its second-newest checkpoint; compare the redone steps' losses."""
    copy = run.with_name(run.name + "-resume")
    shutil.copytree(run, copy)
    newest = checkpoint.latest(copy)
    newest.unlink()
    start = checkpoint.latest(copy)
    cmd = train_args(data, copy, steps, every) + ["--resume"]
    with open(log, "w") as out:
        subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    first, again = losses(run), losses(copy)
    redone = range(checkpoint.step_of(checkpoint.load(start)) + 1, steps + 1)
    return {
        "resumed_from": start.name,
        "steps_redone": len(redone),
        "identical": all(again[s] == first[s] for s in redone) and sorted(again) == sorted(first),
    }


def growth(samples: list[dict], key: str, warm_steps: int) -> tuple[float, float, float]:
    """(value just after warm-up, value at the end, growth in %), each a median of 5 samples."""
    warm = [s for s in samples if s["steps"] >= warm_steps] or samples
    first = statistics.median(s[key] for s in warm[:5])
    last = statistics.median(s[key] for s in warm[-5:])
    return first, last, 100 * (last - first) / first


def summarize(samples: list[dict], ms: list[float], warm_steps: int, resume: dict, seconds: float) -> dict:
    rss, fds = growth(samples, "rss_mib", warm_steps), growth(samples, "fds", warm_steps)
    window = max(100, len(ms) // 20)
    first, last = ms[warm_steps : warm_steps + window], ms[-window:]
    steady, end = statistics.median(first), statistics.median(last)
    # On a shared machine the median follows the other users' load; a window's fastest step is
    # what the step itself costs, the figure a leak (a growing graph, a list) would move.
    floor, floor_end = min(first), min(last)
    return {
        "steps": len(ms),
        "warmup": warm_steps,
        "seconds": round(seconds, 1),
        "samples": len(samples),
        "rss_mib": {
            "after_warmup": round(rss[0], 1),
            "end": round(rss[1], 1),
            "growth_pct": round(rss[2], 2),
            "max": round(max(s["rss_mib"] for s in samples), 1),
        },
        "open_fds": {"after_warmup": fds[0], "end": fds[1], "max": max(s["fds"] for s in samples)},
        "step_ms": {
            "after_warmup": round(steady, 3),
            "end": round(end, 3),
            "growth_pct": round(100 * (end - steady) / steady, 2),
            "window_steps": window,
            "fastest_after_warmup": round(floor, 3),
            "fastest_end": round(floor_end, 3),
            "fastest_growth_pct": round(100 * (floor_end - floor) / floor, 2),
        },
        "metrics_partial_samples": sum(not s["whole"] for s in samples),
        "resume": resume,
        "load_before": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20000, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--every", type=int, default=500, help="eval and checkpoint interval (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=1000, help="steps before growth is measured (default: %(default)s)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between samples (default: %(default)s)")
    ap.add_argument("--out", default="", help="folder for soak.json / soak.md (default: print only)")
    ap.add_argument("--work", default="", help="folder for the data and the run (default: a temporary one)")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="fastpt-soak-"))
    data, run = work / "data", work / "run"
    if not data.is_dir():
        prepare(sorted((REPO / "fastpt").glob("*.py")), data, "bytes", workers=1)
    load = os.getloadavg()
    t0 = time.monotonic()
    samples = watch(train_args(data, run, args.steps, args.every), run, work / "train.log", args.interval)
    seconds = time.monotonic() - t0
    resume = check_resume(data, run, args.every, args.steps, work / "resume.log")
    result = summarize(samples, step_ms(run, 8 * 64), args.warmup, resume, seconds)
    result.update(load_before=load, load_after=os.getloadavg(), env=env_info_cpu())
    print(json.dumps(result, indent=2))
    if args.out:
        write_json(Path(args.out) / "soak.json", {**result, "samples_raw": samples})
        (Path(args.out) / "soak.md").write_text(to_markdown(result) + "\n")
    return 0 if resume["identical"] and not result["metrics_partial_samples"] else 1


def env_info_cpu() -> dict:
    import torch

    return env_info(torch.device("cpu"))


def to_markdown(r: dict) -> str:
    rows = [
        [
            "resident memory (MiB)",
            str(r["rss_mib"]["after_warmup"]),
            str(r["rss_mib"]["end"]),
            f"{r['rss_mib']['growth_pct']:+.2f}%",
        ],
        [
            "open file descriptors",
            str(r["open_fds"]["after_warmup"]),
            str(r["open_fds"]["end"]),
            f"{r['open_fds']['end'] - r['open_fds']['after_warmup']:+d}",
        ],
        [
            "step time (ms, median of the window)",
            str(r["step_ms"]["after_warmup"]),
            str(r["step_ms"]["end"]),
            f"{r['step_ms']['growth_pct']:+.2f}%",
        ],
        [
            "step time (ms, fastest of the window)",
            str(r["step_ms"]["fastest_after_warmup"]),
            str(r["step_ms"]["fastest_end"]),
            f"{r['step_ms']['fastest_growth_pct']:+.2f}%",
        ],
    ]
    return (
        f"Soak: {r['steps']:,} steps in {r['seconds']:,.0f} s, {r['samples']} samples; load average "
        f"{r['load_before'][0]:.2f} before, {r['load_after'][0]:.2f} after (shared 2-core CPU).\n\n"
        + markdown_table(["", f"after warm-up (steps {r['warmup']:,}+)", "end (last window)", "growth"], rows)
        + f"\n\nmetrics.jsonl seen ending mid-record: {r['metrics_partial_samples']} of {r['samples']} samples. "
        f"Resume from {r['resume']['resumed_from']}: {r['resume']['steps_redone']} steps redone, per-step losses "
        f"{'identical' if r['resume']['identical'] else 'DIFFERENT'}."
    )


if __name__ == "__main__":
    sys.exit(main())
