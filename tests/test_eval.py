"""Evaluation: val_bpb against a hand computation, each tokenizer's byte table, and --eval-mc (a
model that has learned some text picks its real continuations over character-shuffled ones)."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import TINY, assert_one_line_error, run_main, run_train
from fastpt import distributed, train
from fastpt.config import PRESETS, TrainConfig
from fastpt.data import Windows, find_shards
from fastpt.evaluate import byte_table, evaluate
from fastpt.model import Transformer
from fastpt.prepare import prepare
from fastpt.tokenizer import PROBE, ByteTokenizer, CharTokenizer, load_tokenizer


def test_token_bytes_add_up_to_the_texts_utf8_bytes(bpe_data):
    text = PROBE + "naïve café — 🙂 x\u2581y"
    for tok in (ByteTokenizer(), CharTokenizer.train([text]), load_tokenizer(bpe_data)):
        table = tok.token_bytes()
        ids = tok.encode_batch([text])[0]
        assert len(table) == tok.vocab_size and table[tok.eot_id] == 0
        assert sum(table[i] for i in ids) == len(text.encode("utf-8")), type(tok).__name__


def test_val_bpb_is_the_evaluated_nats_over_the_targets_bytes(tiny_data):
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=257))
    windows = Windows(find_shards(tiny_data, "val"), 32)
    cfg = TrainConfig(micro_batch=4, eval_tokens=32 * 10)  # 10 windows: the first three batches, the last short
    autocast = torch.autocast("cpu", enabled=False)
    loss, bpb = evaluate(
        model,
        windows,
        cfg,
        torch.device("cpu"),
        autocast,
        distributed.Dist(),
        byte_table(tiny_data, torch.device("cpu")),
    )
    # by hand: every target of the first 10 windows; a byte token (id < 256) is one byte, the document token none
    w = windows.gather(np.arange(10))  # (10, 33)
    with torch.no_grad():
        logits = model(w[:, :-1])[0]  # (10, 32, V)
    nats = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
    nbytes = int((w[:, 1:] < 256).sum())
    assert (w[:, 1:] == 256).any() or nbytes == w[:, 1:].numel()
    assert loss == pytest.approx(nats / w[:, 1:].numel(), rel=1e-5)
    assert bpb == pytest.approx(nats / math.log(2) / nbytes, rel=1e-5)
    assert byte_table(tiny_data / "missing", torch.device("cpu")) is None


SENTENCES = [
    f"the {a} {v} the {o}."
    for a in ("cat", "dog", "fox", "owl")
    for v in ("sees", "chases", "likes")
    for o in ("ball", "tree", "moon", "river")
]


def mc_rows(seed: int = 0) -> list[dict]:
    """Contexts from the corpus, each with its real ending and three character shuffles of it."""
    rng = random.Random(seed)
    rows = []
    for sentence in SENTENCES[::3]:
        cut = sentence.index(" the ", 4)
        ctx, real = sentence[:cut], sentence[cut:]
        fakes = ["".join(rng.sample(real, len(real))) for _ in range(3)]
        endings = [*fakes]
        label = rng.randrange(4)
        endings.insert(label, real)
        rows.append({"ctx": ctx, "endings": endings, "label": label})
    return rows


def test_mc_eval_picks_the_real_continuations_of_learned_text(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES * 30))
    prepare([corpus], tmp_path / "data", "bytes", workers=1, val_fraction=0.1)
    mc = tmp_path / "mc.jsonl"
    rows = mc_rows()
    mc.write_text("\n".join(map(json.dumps, rows)) + "\n")
    run = tmp_path / "run"
    common = [*TINY, "--seq-len", "64", "--micro-batch", "8", "--data", str(tmp_path / "data"), "--out", str(run)]
    code, out, err = run_main(
        train.main,
        [
            *common,
            "--eval-mc",
            str(mc),
            "--max-steps",
            "150",
            "--warmup-steps",
            "10",
            "--lr",
            "3e-3",
            "--eval-every",
            "150",
            "--log-every",
            "50",
        ],
        capsys,
    )
    assert code == 0, err
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert evals[-1]["mc_acc"] >= 0.9, evals  # chance is 0.25
    assert evals[-1]["val_bpb"] > 0 and "mc acc" in out and "val bpb" in out
    # the same rows with every label moved to another ending: the model's choices are now wrong
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("\n".join(json.dumps({**r, "label": (r["label"] + 1) % 4}) for r in rows))
    code, out, err = run_main(
        train.main,
        [
            *common,
            "--resume",
            "--eval-mc",
            str(wrong),
            "--max-steps",
            "151",
            "--eval-every",
            "150",
        ],
        capsys,
    )
    assert code == 0, err
    last = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r][-1]
    assert last["step"] == 151 and last["mc_acc"] <= 0.1


MC_MISTAKES = {
    "not JSON": ('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n{oops\n', ":2:"),
    "label out of range": ('{"ctx": "a", "endings": ["b", "c"], "label": 2}\n', ":1:"),
    "endings not a list": ('\n{"ctx": "a", "endings": "bc", "label": 0}\n', ":2:"),
    "no rows": ("\n", "no rows"),
    "no such file": (None, "cannot read it"),
}


@pytest.mark.parametrize("case", MC_MISTAKES)
def test_a_malformed_mc_file_is_one_line_naming_file_and_line(case, tiny_data, tmp_path, capsys):
    text, named = MC_MISTAKES[case]
    mc = tmp_path / "mc.jsonl"
    if text is not None:
        mc.write_text(text)
    code, _, err = run_main(
        train.main,
        [*TINY, "--data", str(tiny_data), "--out", str(tmp_path / "run"), "--eval-mc", str(mc), "--max-steps", "1"],
        capsys,
    )
    assert_one_line_error(code, err, str(mc), named)


def test_data_without_a_tokenizer_logs_no_bpb_and_refuses_mc(tmp_path, capsys):
    folder = tmp_path / "nanogpt"
    folder.mkdir()
    for split in ("train", "val"):
        (folder / f"{split}.bin").write_bytes((np.arange(3000) % 60).astype(np.uint16).tobytes())
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 64}))  # a vocab, no tokenizer
    args = [*TINY, "--data", str(folder), "--data-format", "nanogpt", "--max-steps", "2", "--eval-every", "2"]
    code, out, err = run_main(train.main, [*args, "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    evals = [
        r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r
    ]
    assert evals and evals[-1]["val_bpb"] is None and "val bpb" not in out
    mc = tmp_path / "mc.jsonl"
    mc.write_text(json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 0}))
    code, _, err = run_main(train.main, [*args, "--out", str(tmp_path / "run2"), "--eval-mc", str(mc)], capsys)
    assert_one_line_error(code, err, str(folder), "tokenizer.json")


@pytest.mark.slow
def test_bos_mixture_and_mc_under_torchrun_follow_one_process(tiny_data, tmp_path):
    """Two processes (DDP, FSDP) on a bos-packed mixture see the batches, val_bpb and mc_acc of one
    process; 5 MC rows over 2 ranks leave one rank a row short (its forwards padded)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES * 30))
    prepare([corpus], tmp_path / "sentences", "bytes", workers=1, val_fraction=0.1)
    mc = tmp_path / "mc.jsonl"
    mc.write_text("\n".join(map(json.dumps, mc_rows()[:5])))
    common = [
        *TINY,
        "--data",
        f"{tmp_path / 'sentences'}:0.7,{tiny_data}:0.3",
        "--packing",
        "bos",
        "--eval-mc",
        str(mc),
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--log-every",
        "1",
        "--eval-tokens",
        "512",
        "--grad-accum",
        "2",
    ]
    records = {}
    for name, nproc, extra in (
        ("one", 0, ["--micro-batch", "4"]),
        ("ddp", 2, ["--micro-batch", "2"]),
        ("fsdp", 2, ["--micro-batch", "2", "--parallel", "fsdp"]),
    ):
        result = run_train(*common, *extra, "--out", str(tmp_path / name), nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        records[name] = [r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())]
    for name in ("ddp", "fsdp"):
        for got, want in zip(records[name], records["one"], strict=True):
            for key in ("loss", "val_loss", "val_bpb", "mc_acc"):
                assert (key in got) == (key in want)
                if key in want:
                    assert got[key] == pytest.approx(want[key], rel=1e-3), (name, key, got, want)


@pytest.mark.slow
def test_mc_eval_under_compile_matches_eager_and_training_does_not_recompile(tiny_data, tmp_path):
    mc = tmp_path / "mc.jsonl"
    mc.write_text("\n".join(map(json.dumps, mc_rows())))
    args = [
        *TINY,
        "--data",
        str(tiny_data),
        "--eval-mc",
        str(mc),
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--log-every",
        "1",
        "--eval-tokens",
        "256",
    ]
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        result = run_train(*args, *extra, "--out", str(tmp_path / name))
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    evals = {name: [r for r in records if "mc_acc" in r] for name, records in runs.items()}
    assert [r["step"] for r in evals["compiled"]] == [2, 4]
    for got, want in zip(evals["compiled"], evals["eager"], strict=True):
        assert got["mc_acc"] == want["mc_acc"] and got["val_bpb"] == pytest.approx(want["val_bpb"], rel=1e-4)
    assert [r["recompiles"] for r in runs["compiled"] if "loss" in r and r["step"] > 1] == [0, 0, 0]
