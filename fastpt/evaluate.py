"""Evaluation in the loop: validation loss and bits per byte over the held-out windows, and a
multiple-choice eval (HellaSwag-style JSONL: ctx, endings, label) scored by log-likelihood."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastpt import distributed
from fastpt.config import TrainConfig
from fastpt.data import WindowSet, eval_batches
from fastpt.errors import DataError
from fastpt.tokenizer import load_tokenizer


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
) -> tuple[float, float | None]:
    """(val_loss, val_bpb) over the first eval_tokens of the validation windows. val_bpb = the
    evaluated nats / ln 2 / the UTF-8 bytes of exactly the evaluated target tokens (every target's
    nats count, the document token's too, which has no bytes); None without token_bytes."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # nats, targets, bytes
    for batch in eval_batches(windows, cfg.micro_batch, cfg.eval_tokens, device, d.rank, d.world_size):
        torch.compiler.cudagraph_mark_step_begin()  # each forward a CUDA-graph step of its own; else a no-op
        with autocast:
            loss = model(batch.x, labels=batch.y).cross_entropy  # without the z-loss term
        counted = batch.y != -100  # (B, T)
        n = counted.sum()
        sums[0] += torch.where(n > 0, loss.double() * n, 0.0)  # all padding: its mean is 0 / 0
        sums[1] += n
        if token_bytes is not None:
            sums[2] += (token_bytes[batch.y.clamp(min=0)] * counted).sum()
    model.train()
    nats, count, nbytes = distributed.all_reduce_mean(sums, d).tolist()
    return nats / count, (nats / math.log(2) / nbytes if token_bytes is not None and nbytes else None)


@dataclass
class Choice:
    """One ending of a multiple-choice row, as the model reads it."""

    tokens: list[int]  # the document token, the context, the ending (cropped on the left to fit)
    scored: int  # how many of the last tokens are the ending's, the ones scored
    nbytes: int  # UTF-8 bytes of the ending's text, what the score is normalized by


def read_mc(path: str | Path) -> list[tuple[str, list[str], int]]:
    """(ctx, endings, label) per line of a JSONL file; a malformed line is a DataError naming it."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeError) as e:
        raise DataError(f"'eval_mc' {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{number}: not a JSON line ({e})") from None
        row = row if isinstance(row, dict) else {}
        ctx, endings, label = row.get("ctx"), row.get("endings"), row.get("label")
        if not (
            isinstance(ctx, str)
            and isinstance(endings, list)
            and len(endings) >= 2
            and all(isinstance(e, str) and e for e in endings)
        ):
            raise DataError(f'{path}:{number}: needs "ctx" (text) and "endings" (a list of 2 or more texts)')
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
            raise DataError(f'{path}:{number}: "label" {label!r} is not an index into its {len(endings)} endings')
        rows.append((ctx, endings, label))
    if not rows:
        raise DataError(f"'eval_mc' {path}: no rows")
    return rows


class MultipleChoice:
    """mc_acc: each row's endings scored by their log-likelihood after the context, per UTF-8 byte of
    the ending; the highest score is the model's choice. Rows are striped over ranks; every rank
    runs the same number of fixed-shape forwards (micro_batch x length), so a compiled model
    compiles once for it and FSDP's collectives stay in step."""

    def __init__(self, path: str | Path, data_dir: Path, seq_len: int, micro_batch: int):
        tokenizer_path = Path(data_dir) / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise DataError(f"'eval_mc' needs the data's tokenizer.json to read {path}: {data_dir} has none")
        tok = load_tokenizer(tokenizer_path)
        rows = read_mc(path)
        prefix = [tok.eot_id] if tok.eot_id is not None else []  # every training document starts with it
        self.rows: list[tuple[list[Choice], int]] = []
        for ctx, endings, label in rows:
            try:
                ctx_ids, *ending_ids = tok.encode_batch([ctx, *endings])
            except DataError as e:  # a character the data's char vocabulary lacks
                raise DataError(f"'eval_mc' {path}: {e}") from None
            choices = []
            for text, ids in zip(endings, ending_ids):
                tokens = (prefix + ctx_ids + ids)[-(seq_len + 1) :]
                choices.append(Choice(tokens, min(len(ids), seq_len), len(text.encode("utf-8"))))
            self.rows.append((choices, label))
        self.length = min(seq_len, max(len(c.tokens) for choices, _ in self.rows for c in choices) - 1)
        self.micro_batch = micro_batch

    def _batch(self, choices: list[Choice], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Choices -> inputs and targets (micro_batch, length): right-padded, -100 except on the
        ending's tokens; missing rows are all padding."""
        x = torch.zeros(self.micro_batch, self.length, dtype=torch.int64)
        y = torch.full((self.micro_batch, self.length), -100, dtype=torch.int64)
        for i, c in enumerate(choices):
            t = torch.tensor(c.tokens)
            x[i, : len(t) - 1] = t[:-1]
            y[i, len(t) - 1 - c.scored : len(t) - 1] = t[-c.scored :]
        return x.to(device), y.to(device)

    @torch.no_grad()
    def accuracy(self, model: nn.Module, device: torch.device, autocast: torch.autocast, d: distributed.Dist) -> float:
        mine = self.rows[d.rank :: d.world_size]
        choices = [c for row, _ in mine for c in row]
        per_rank = max(sum(len(row) for row, _ in self.rows[r :: d.world_size]) for r in range(d.world_size))
        nats = []
        model.eval()
        for i in range(0, per_rank, self.micro_batch):
            x, y = self._batch(choices[i : i + self.micro_batch], device)  # (B, T) each
            torch.compiler.cudagraph_mark_step_begin()
            with autocast:
                logits = model(x).logits  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")  # (B*T,)
            nats.extend(loss.view(y.shape).sum(1).tolist()[: max(0, len(choices) - i)])
        model.train()
        correct, at = 0, 0
        for row, label in mine:
            scores = [-n / c.nbytes for n, c in zip(nats[at : at + len(row)], row)]
            correct += int(np.argmax(scores) == label)
            at += len(row)
        stats = torch.tensor([correct, len(mine)], dtype=torch.float64, device=device)
        correct, total = distributed.all_reduce_mean(stats, d).tolist()
        return correct / total


class Evaluator:
    """Everything an eval step reports: val_loss, val_ppl, val_bpb (None without a tokenizer) and,
    with --eval-mc, mc_acc."""

    def __init__(self, windows: WindowSet, cfg: TrainConfig, device: torch.device, data_dir: Path, seq_len: int):
        self.windows, self.cfg, self.device = windows, cfg, device
        self.token_bytes = byte_table(data_dir, device)
        self.mc = MultipleChoice(cfg.eval_mc, data_dir, seq_len, cfg.micro_batch) if cfg.eval_mc else None

    def run(self, model: nn.Module, autocast: torch.autocast, d: distributed.Dist) -> dict:
        val_loss, val_bpb = evaluate(model, self.windows, self.cfg, self.device, autocast, d, self.token_bytes)
        record = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 20.0)), "val_bpb": val_bpb}
        if self.mc:
            record["mc_acc"] = self.mc.accuracy(model, self.device, autocast, d)
        return record


def describe_eval(record: dict) -> str:
    """The validation line after 'Step N/M | '."""
    return (
        f"val loss {record['val_loss']:.4f} | val PPL {record['val_ppl']:.2f}"
        + (f" | val bpb {record['val_bpb']:.4f}" if record["val_bpb"] is not None else "")
        + (f" | mc acc {record['mc_acc']:.3f}" if "mc_acc" in record else "")
    )
