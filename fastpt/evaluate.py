"""Evaluation in the loop: validation loss (per source of a mixture too) and bits per byte over the
held-out windows, and the multiple-choice eval of fastpt/multiple_choice.py."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn

from fastpt import distributed
from fastpt.config import TrainConfig, begin_cuda_graph_step, uses_cuda_graphs
from fastpt.data.dataset import Source, WindowSet, source_names
from fastpt.data.loader import eval_batches
from fastpt.data.tokenizer import load_tokenizer
from fastpt.multiple_choice import MultipleChoice, read_tasks


def byte_table(data_dir: Path, device: torch.device) -> torch.Tensor | None:
    """UTF-8 bytes of each token id's text (0 for special ids), from the data's tokenizer.json;
    None for data without one (its val_bpb is logged as none)."""
    path = Path(data_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return torch.tensor(load_tokenizer(path).token_bytes(), dtype=torch.float64, device=device)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: WindowSet,
    cfg: TrainConfig,
    device: torch.device,
    autocast: torch.autocast,
    d: distributed.Dist,
    token_bytes: torch.Tensor | None = None,
    sources: list[str] | None = None,
) -> dict:
    """{'val_loss', 'val_bpb'} over the first eval_tokens of the validation windows, and with
    several `sources` (a mixture's names) 'val_loss/NAME' for each (None where none of its
    windows is among them). val_loss is the mean nats of every target; val_bpb as nanochat's
    evaluate_bpb: the nats of the targets that have bytes / ln 2 / their UTF-8 bytes (a target
    without bytes, the document token, is in neither sum); None without token_bytes."""
    model.eval()
    parts = len(sources or [None])
    sums = torch.zeros(parts, 4, dtype=torch.float64, device=device)  # per source: nats, targets, bpb nats, bytes
    for batch in eval_batches(windows, cfg.micro_batch, cfg.eval_tokens, device, d.rank, d.world_size):
        begin_cuda_graph_step(cfg)  # each forward a CUDA-graph step of its own
        with autocast:
            nats = model(batch.x, labels=batch.y, reduction="none").cross_entropy  # (B*T,), without the z-loss term
        nats = nats.view(batch.y.shape).double()  # (B, T), 0 where the target is -100
        counted = batch.y != -100
        nbytes = token_bytes[batch.y.clamp(min=0)] * counted if token_bytes is not None else torch.zeros_like(nats)
        rows = torch.stack((nats, counted.double(), nats * (nbytes > 0), nbytes), 1).sum(2)  # (B, 4)
        sums.index_add_(0, batch.source, rows)  # into each row's source
    model.train()
    per_source = distributed.all_reduce_mean(sums, d)
    nats, count, bpb_nats, nbytes = per_source.sum(0).tolist()
    record = {"val_loss": nats / count, "val_bpb": bpb_nats / math.log(2) / nbytes if nbytes else None}
    if parts > 1:
        for name, (n, c, _, _) in zip(sources, per_source.tolist()):
            record[f"val_loss/{name}"] = n / c if c else None
    return record


class Evaluator:
    """Everything an eval step reports: val_loss, val_ppl, val_bpb (None without a tokenizer), a
    mixture's val_loss/SOURCE and, with --eval-mc, mc_acc (and mc_acc/TASK)."""

    def __init__(self, windows: WindowSet, cfg: TrainConfig, device: torch.device, sources: list[Source]):
        """sources: the data's (the first one's tokenizer is the run's)."""
        self.windows, self.cfg, self.device, self.sources = windows, cfg, device, source_names(sources)
        data_dir = sources[0].folder
        self.token_bytes = byte_table(data_dir, device)
        self.mc = None
        if cfg.eval_mc:
            tasks = read_tasks(cfg.eval_mc)
            self.mc = MultipleChoice(
                tasks, data_dir, windows.seq_len, cfg.micro_batch, cfg.eval_mc_norm, uses_cuda_graphs(cfg)
            )

    def run(self, model: nn.Module, autocast: torch.autocast, d: distributed.Dist) -> dict:
        record = evaluate(model, self.windows, self.cfg, self.device, autocast, d, self.token_bytes, self.sources)
        record = {"val_loss": record["val_loss"], "val_ppl": math.exp(min(record["val_loss"], 20.0)), **record}
        if self.mc:
            record.update(self.mc.accuracy(model, self.device, autocast, d))
        return record


def _parts(record: dict, key: str, fmt: str) -> str:
    """' (a 1.23, b 4.56)': the record's KEY/NAME entries, or ''."""
    named = {k.split("/", 1)[1]: v for k, v in record.items() if k.startswith(key + "/")}
    parts = [f"{name} {'n/a' if v is None else format(v, fmt)}" for name, v in named.items()]
    return f" ({', '.join(parts)})" if parts else ""


def describe_eval(record: dict) -> str:
    """The validation line after 'Step N/M | '."""
    return (
        f"val loss {record['val_loss']:.4f}{_parts(record, 'val_loss', '.4f')} | val PPL {record['val_ppl']:.2f}"
        + (f" | val bpb {record['val_bpb']:.4f}" if record["val_bpb"] is not None else "")
        + (f" | mc acc {record['mc_acc']:.3f}{_parts(record, 'mc_acc', '.3f')}" if "mc_acc" in record else "")
    )
