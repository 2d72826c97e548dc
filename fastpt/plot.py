"""Plot a run's curves: python -m fastpt.plot RUN_DIR writes RUN_DIR/loss.png from metrics.jsonl.

Panels: train and val loss vs step, the same vs tokens seen, learning rate, throughput (tok/s).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fastpt.errors import ArgumentParser, DataError, require, run_command


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """Train and eval records, by step. After a resume a step is logged again: the last record wins."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{path} not found (is {run_dir} a run folder written by fastpt.train?)")
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            continue
        if "loss" in record:
            train[record["step"]] = record
        elif "val_loss" in record:
            val[record["step"]] = record
    if not train:
        raise DataError(f"{path} has no train records yet")
    return [train[s] for s in sorted(train)], [val[s] for s in sorted(val)]


def plot(run_dir: str | Path) -> Path:
    """Write run_dir/loss.png and return its path."""
    matplotlib = require("matplotlib", "fastpt.plot")
    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    train, val = read_metrics(run_dir)
    steps = np.array([r["step"] for r in train])
    tokens = np.array([r["tokens"] for r in train])
    val_steps = np.array([r["step"] for r in val])
    val_loss = [r["val_loss"] for r in val]
    val_tokens = np.interp(val_steps, steps, tokens)  # eval lines carry no token count

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for ax, x, vx, label in ((axes[0, 0], steps, val_steps, "step"), (axes[0, 1], tokens, val_tokens, "tokens")):
        ax.plot(x, [r["loss"] for r in train], label="train")
        if val:
            ax.plot(vx, val_loss, "o-", label="val")
        ax.set(xlabel=label, ylabel="loss")
        ax.legend()
    axes[1, 0].plot(steps, [r["lr"] for r in train])
    axes[1, 0].set(xlabel="step", ylabel="learning rate")
    axes[1, 1].plot(steps, [r["tok_s"] for r in train])
    axes[1, 1].set(xlabel="step", ylabel="tokens / s")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    out = run_dir / "loss.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m fastpt.plot", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", metavar="RUN_DIR", help="run folder with metrics.jsonl (the --out of fastpt.train)")
    print(f"wrote {plot(ap.parse_args(argv).run_dir)}")


if __name__ == "__main__":
    run_command(main)
