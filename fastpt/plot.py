"""Plot a run's curves: python -m fastpt.plot RUN_DIR writes RUN_DIR/loss.png from metrics.jsonl.

Panels: train and val loss vs step, the same vs tokens seen, learning rate, throughput (tok/s).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from fastpt.errors import ArgumentParser, DataError, DiskError, require, run_command
from fastpt.files import check_output, os_reason, write_output

NUMBER = (int, float)
TRAIN_FIELDS, VAL_FIELDS = ("loss", "tokens", "lr", "tok_s"), ("val_loss",)


def parse_record(line: bytes) -> dict | None:
    """A train or eval record of fastpt.train, or None for anything else: a line cut short by a
    crash, bytes that are not UTF-8 or not JSON, JSON that is not such a record."""
    try:
        record = json.loads(line.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError is one too
        return None
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        return None
    fields = TRAIN_FIELDS if "loss" in record else VAL_FIELDS
    numbers = all(isinstance(record.get(k), NUMBER) and not isinstance(record.get(k), bool) for k in fields)
    return record if numbers else None


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict], list[int]]:
    """Train and eval records by step, and the numbers of the lines skipped as damaged. After a
    resume a step is logged again: the last record wins."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{path} not found (is {run_dir} a run folder written by fastpt.train?)")
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise DataError(f"cannot read {path} ({os_reason(e)})") from None
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}
    skipped = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = parse_record(line)
        if record is None:
            skipped.append(number)
        elif "loss" in record:
            train[record["step"]] = record
        else:
            val[record["step"]] = record
    if not train:
        damaged = f" ({len(skipped)} damaged lines, the first line {skipped[0]})" if skipped else " yet"
        raise DataError(f"{path} has no train records{damaged}")
    return [train[s] for s in sorted(train)], [val[s] for s in sorted(val)], skipped


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write run_dir/loss.png (or `out`) and return its path; damaged lines of metrics.jsonl are
    skipped, with a warning that counts them."""
    matplotlib = require("matplotlib", "fastpt.plot", extra="plot")
    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "loss.png"
    check_output(out, "--out")  # before any work: a folder, the run's own metrics.jsonl, a read-only file
    train, val, skipped = read_metrics(run_dir)
    if skipped:
        print(
            f"fastpt: warning: {run_dir / 'metrics.jsonl'}: skipped {len(skipped)} damaged line"
            f"{'s' if len(skipped) > 1 else ''} (line {', '.join(map(str, skipped[:3]))}"
            f"{', ...' if len(skipped) > 3 else ''}); plotted {len(train)} train and {len(val)} eval records",
            file=sys.stderr,
        )
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
    try:
        write_output(out, lambda f: fig.savefig(f, format="png", dpi=120), "--out")
    except BrokenPipeError:  # `--out /dev/stdout | head`: the reader has what it wanted (run_command)
        raise
    except OSError as e:
        raise DiskError(f"cannot write {out}: {os_reason(e)} (choose another file with --out)") from None
    finally:
        plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m fastpt.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", metavar="RUN_DIR", help="run folder with metrics.jsonl (the --out of fastpt.train)")
    ap.add_argument("--out", default="", help="the PNG to write (default: RUN_DIR/loss.png)")
    args = ap.parse_args(argv)
    print(f"wrote {plot(args.run_dir, args.out or None)}")


if __name__ == "__main__":
    run_command(main)
