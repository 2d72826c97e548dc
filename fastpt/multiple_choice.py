"""The multiple-choice eval in the loop (--eval-mc): tasks of JSONL rows {"ctx", "endings", "label"},
each ending scored by its log-likelihood after its context, tokenized as lm-eval tokenizes it.

lm-eval's rule (lm_eval/api/model.py, TemplateLM._encode_pair and loglikelihood): whitespace at the
end of the context moves to the front of the ending; the context is encoded alone, the context and
ending together, and the ending's tokens are those of the whole after as many tokens as the
context's own encoding has. The model reads the context's tokens, then the ending's. An ending
encoded alone would start a word afresh (a SentencePiece / Metaspace tokenizer adds its word-start
mark to every text it encodes); in context it is tokenized as running text. An ending left with no
tokens of its own (the tokenizer merged it into the context's last token) is refused, as lm-eval
refuses it (an assertion there).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from fastpt import distributed
from fastpt.data.tokenizer import load_tokenizer
from fastpt.errors import ConfigError, DataError

TASK_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class Row:
    ctx: str
    endings: list[str]
    label: int
    line: int  # in its file, for errors


@dataclass
class Task:
    name: str  # '' for --eval-mc FILE: logged as mc_acc alone
    path: Path
    rows: list[Row]


def parse_spec(spec: str) -> list[tuple[str, Path]]:
    """--eval-mc: FILE -> [('', FILE)]; NAME=FILE,NAME=FILE -> each task's name and file."""
    if "=" not in spec or Path(spec).is_file():
        if "," in spec and not Path(spec).is_file():
            raise ConfigError(f"'eval_mc' = {spec!r}: several files need a name each: NAME=FILE,NAME=FILE")
        return [("", Path(spec))]
    tasks: dict[str, Path] = {}
    for item in spec.split(","):
        name, sep, file = (part.strip() for part in item.partition("="))
        if not (sep and TASK_NAME.fullmatch(name) and file):
            raise ConfigError(
                f"'eval_mc' = {spec!r}: {item.strip()!r} is not NAME=FILE (a name of letters, digits, _.-)"
            )
        if name in tasks:
            raise ConfigError(f"'eval_mc' = {spec!r}: the task name {name!r} is given twice")
        tasks[name] = Path(file)
    return list(tasks.items())


def _row(line: str, where: str, number: int) -> Row:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: not a JSON line ({e})") from None
    row = row if isinstance(row, dict) else {}
    ctx, endings = row.get("ctx"), row.get("endings")
    if not (
        isinstance(ctx, str)
        and isinstance(endings, list)
        and len(endings) >= 2
        and all(isinstance(e, str) and e.strip() for e in endings)
    ):
        raise DataError(f'{where}: needs "ctx" (text) and "endings" (a list of 2 or more texts, none blank)')
    if "label" not in row:
        raise DataError(f'{where}: "label" is missing (the index of the right ending, 0 to {len(endings) - 1})')
    label = row["label"]
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise DataError(f'{where}: "label" {label!r} is not an index into its {len(endings)} endings')
    return Row(ctx, endings, label, number)


def read_rows(path: str | Path) -> list[Row]:
    """The rows of one JSONL file; a malformed line is a DataError naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeError) as e:
        raise DataError(f"'eval_mc' {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    rows = [_row(line, f"{path}:{number}", number) for number, line in enumerate(lines, 1) if line.strip()]
    if not rows:
        raise DataError(f"'eval_mc' {path}: no rows")
    return rows


def read_tasks(spec: str) -> list[Task]:
    """Every task of --eval-mc, read and checked (the spec, each file, every row); needs no model
    or tokenizer, so a run can call it before it makes anything."""
    return [Task(name, path, read_rows(path)) for name, path in parse_spec(spec)]


def encode_in_context(tok, ctx: str, endings: list[str]) -> tuple[list[int], list[list[int]]]:
    """lm-eval's tokenization of a context and its endings: (the context's ids, each ending's ids)."""
    stripped = ctx.rstrip()
    moved = ctx[len(stripped) :]  # the context's trailing whitespace starts every ending
    ctx_ids, *wholes = tok.encode_batch([stripped, *(stripped + moved + e for e in endings)])
    return ctx_ids, [whole[len(ctx_ids) :] for whole in wholes]


@dataclass
class Choice:
    """One ending of a row, as the model reads it."""

    tokens: list[int]  # the document token, the context, the ending (cropped on the left to fit)
    scored: int  # how many of the last tokens are the ending's, the ones scored
    length: float  # what the log-likelihood is divided by (--eval-mc-norm)


def norm_length(norm: str, ctx: str, ending: str, scored: int) -> float:
    """What --eval-mc-norm divides the ending's log-likelihood by before the argmax: its UTF-8 bytes
    (byte: lm-eval's acc_bytes), characters (char: acc_norm), scored tokens (token: nanochat's CORE)
    or 1 (none: acc). byte and char count the continuation (the context's trailing whitespace, then
    the ending) less one leading whitespace character, the separator: lm-eval counts a choice
    without its target delimiter (" ")."""
    text = ctx[len(ctx.rstrip()) :] + ending  # what follows the context's last non-space
    text = text[1:] if text[:1].isspace() else text
    return {"byte": len(text.encode("utf-8")), "char": len(text), "token": scored, "none": 1}[norm]


class MultipleChoice:
    """mc_acc: per task, the share of rows whose best-scored ending is the label, and their mean.
    Rows are striped over ranks; every rank runs the same number of forwards of one shape
    (micro_batch x the longest row of any task), so a compiled model compiles one graph for every
    task, once, and FSDP's collectives stay in step. cuda_graphs: the model records CUDA graphs
    (config.uses_cuda_graphs), so each forward marks a step of its own."""

    def __init__(
        self, tasks: list[Task], data_dir: Path, seq_len: int, micro_batch: int, norm: str, cuda_graphs: bool = False
    ):
        tokenizer_path = Path(data_dir) / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise DataError(f"'eval_mc' needs the data's tokenizer.json to read {tasks[0].path}: {data_dir} has none")
        tok = load_tokenizer(tokenizer_path)
        prefix = [tok.eot_id] if tok.eot_id is not None else []  # every training document starts with it
        self.names = [t.name for t in tasks]
        self.tasks = [[self._choices(tok, t.path, row, prefix, seq_len, norm) for row in t.rows] for t in tasks]
        self.labels = [[row.label for row in t.rows] for t in tasks]
        longest = max(len(c.tokens) for rows in self.tasks for choices in rows for c in choices)
        self.length = min(seq_len, longest - 1)
        self.micro_batch, self.cuda_graphs = micro_batch, cuda_graphs

    @staticmethod
    def _choices(tok, path: Path, row: Row, prefix: list[int], seq_len: int, norm: str) -> list[Choice]:
        try:
            ctx_ids, ending_ids = encode_in_context(tok, row.ctx, row.endings)
        except DataError as e:  # a character the data's char vocabulary lacks
            raise DataError(f"'eval_mc' {path}:{row.line}: {e}") from None
        choices = []
        for i, (text, ids) in enumerate(zip(row.endings, ending_ids)):
            if not ids:
                raise DataError(
                    f"'eval_mc' {path}:{row.line}: ending {i} has no tokens of its own after the context's "
                    "(the tokenizer merges it into the context's last token): put a space between them"
                )
            scored = min(len(ids), seq_len)
            length = norm_length(norm, row.ctx, text, scored)
            choices.append(Choice((prefix + ctx_ids + ids)[-(seq_len + 1) :], scored, length))
        return choices

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

    def _nats(self, choices: list[Choice], forwards: int, model: nn.Module, device, autocast) -> list[float]:
        """Each choice's negative log-likelihood, in `forwards` forwards (the rank with the most
        choices sets it; the others pad)."""
        nats = []
        for i in range(0, forwards * self.micro_batch, self.micro_batch):
            x, y = self._batch(choices[i : i + self.micro_batch], device)  # (B, T) each
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with autocast:
                per_target = model(x, labels=y, reduction="none").cross_entropy  # (B*T,), 0 off the endings
            nats.extend(per_target.view(y.shape).double().sum(1).tolist()[: max(0, len(choices) - i)])
        return nats

    @torch.no_grad()
    def accuracy(self, model: nn.Module, device: torch.device, autocast: torch.autocast, d: distributed.Dist) -> dict:
        """{'mc_acc': the mean over tasks} and, for named tasks, {'mc_acc/NAME': each task's}."""
        stats = torch.zeros(len(self.tasks), 2, dtype=torch.float64, device=device)  # correct, rows
        model.eval()
        for k, (rows, labels) in enumerate(zip(self.tasks, self.labels)):
            mine = rows[d.rank :: d.world_size]
            most = max(sum(map(len, rows[r :: d.world_size])) for r in range(d.world_size))
            nats = self._nats([c for row in mine for c in row], -(-most // self.micro_batch), model, device, autocast)
            at = 0
            for row, label in zip(mine, labels[d.rank :: d.world_size]):
                scores = [-n / c.length for n, c in zip(nats[at : at + len(row)], row)]
                stats[k, 0] += int(np.argmax(scores) == label)
                at += len(row)
            stats[k, 1] = len(mine)
        model.train()
        correct, total = distributed.all_reduce_mean(stats, d).unbind(1)
        accuracies = (correct / total).tolist()
        named = {f"mc_acc/{name}": acc for name, acc in zip(self.names, accuracies) if name}
        return {"mc_acc": sum(accuracies) / len(accuracies), **named}
