"""Evaluation: val_bpb against a hand computation, each tokenizer's byte table, and --eval-mc (a
model that has learned some text picks its real continuations over character-shuffled ones)."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import TINY, assert_one_line_error, inductor_compiler_imported, run_main, run_train
from fastpt import distributed, train
from fastpt.config import PRESETS, TrainConfig, resolve
from fastpt.data.dataset import Windows, find_shards
from fastpt.data.tokenizer import PROBE, ByteTokenizer, CharTokenizer, load_tokenizer
from fastpt.errors import DataError
from fastpt.evaluate import byte_table, evaluate
from fastpt.model import Transformer
from fastpt.multiple_choice import MultipleChoice, encode_in_context, parse_spec, read_tasks
from fastpt.prepare import prepare
from torchrun_cases import launch


def test_token_bytes_add_up_to_the_texts_utf8_bytes(bpe_data):
    text = PROBE + "naïve café — 🙂 x\u2581y"
    for tok in (ByteTokenizer(), CharTokenizer.train([text]), load_tokenizer(bpe_data)):
        table = tok.token_bytes()
        ids = tok.encode_batch([text])[0]
        assert len(table) == tok.vocab_size and table[tok.eot_id] == 0
        assert sum(table[i] for i in ids) == len(text.encode("utf-8")), type(tok).__name__


def test_val_bpb_leaves_the_targets_without_bytes_out_of_both_sums(tmp_path):
    """nanochat's evaluate_bpb: the document tokens (no bytes) are in neither sum; val_loss keeps them."""
    docs = tmp_path / "docs.jsonl"  # short documents: a document token every ~20 targets
    docs.write_text("".join(json.dumps({"text": f"document {i} says {i * 7}."}) + "\n" for i in range(300)))
    prepare([docs], tmp_path / "data", "bytes", workers=1, val_fraction=0.1)
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=257))
    windows = Windows(find_shards(tmp_path / "data", "val"), 32)
    cfg = TrainConfig(micro_batch=4, eval_tokens=32 * 10)  # 10 windows: the first three batches, the last short
    autocast = torch.autocast("cpu", enabled=False)
    got = evaluate(
        model,
        windows,
        cfg,
        torch.device("cpu"),
        autocast,
        distributed.Dist(),
        byte_table(tmp_path / "data", torch.device("cpu")),
    )
    # by hand: every target of the first 10 windows; a byte token (id < 256) is one byte, the document token none
    w = windows.gather(np.arange(10))  # (10, 33)
    with torch.no_grad():
        logits = model(w[:, :-1])[0]  # (10, 32, V)
    nats = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="none")  # (320,)
    has_bytes = w[:, 1:].flatten() < 256
    assert (~has_bytes).sum() >= 10  # document tokens among the targets
    assert got["val_loss"] == pytest.approx(nats.mean().item(), rel=1e-5)
    assert got["val_bpb"] == pytest.approx(
        nats[has_bytes].sum().item() / math.log(2) / has_bytes.sum().item(), rel=1e-5
    )
    every_target = nats.sum().item() / math.log(2) / has_bytes.sum().item()  # the document tokens' nats counted
    assert abs(got["val_bpb"] - every_target) > 1e-3
    assert byte_table(tmp_path / "missing", torch.device("cpu")) is None


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
    """Two named tasks in one run (mc_acc/NAME and their mean), then one FILE alone (mc_acc)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES * 30))
    prepare([corpus], tmp_path / "data", "bytes", workers=1, val_fraction=0.1)
    mc, wrong = tmp_path / "mc.jsonl", tmp_path / "wrong.jsonl"
    rows = mc_rows()
    mc.write_text("\n".join(map(json.dumps, rows)) + "\n")
    # the same rows with every label moved to another ending: the model's choices are wrong there
    wrong.write_text("\n".join(json.dumps({**r, "label": (r["label"] + 1) % 4}) for r in rows[:3]))
    run = tmp_path / "run"
    common = [*TINY, "--seq-len", "64", "--micro-batch", "8", "--data", str(tmp_path / "data"), "--out", str(run)]
    schedule = ["--max-steps", "150", "--warmup-steps", "10", "--lr", "3e-3", "--eval-every", "150"]
    code, out, err = run_main(
        train.main, [*common, "--eval-mc", f"right={mc},wrong={wrong}", *schedule, "--log-every", "50"], capsys
    )
    assert code == 0, err
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    last = evals[-1]
    assert last["mc_acc/right"] >= 0.9 and last["mc_acc/wrong"] == 0.0, evals  # chance is 0.25
    assert last["mc_acc"] == pytest.approx((last["mc_acc/right"] + last["mc_acc/wrong"]) / 2)
    assert f"mc acc {last['mc_acc']:.3f} (right {last['mc_acc/right']:.3f}, wrong 0.000)" in out
    assert last["val_bpb"] > 0 and "val bpb" in out
    code, out, err = run_main(
        train.main, [*common, "--resume", "--eval-mc", str(wrong), "--max-steps", "151", "--eval-every", "150"], capsys
    )
    assert code == 0, err
    last = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r][-1]
    assert last["step"] == 151 and last["mc_acc"] == 0.0 and not any(k.startswith("mc_acc/") for k in last)


@pytest.mark.slow  # a training process of its own
def test_an_eager_runs_evaluation_imports_no_inductor_compiler(tiny_data, tmp_path):
    """Marking a CUDA-graph step imports Inductor's compiler (some 1.8 CPU s of a short run): an eager
    run evaluates (the validation loss and --eval-mc) without it, as it trains without it."""
    args = [*TINY, "--data", str(tiny_data), "--out", str(tmp_path / "run"), "--max-steps", "2"]
    args += ["--eval-every", "2", "--eval-mc", write_mc(tmp_path / "mc.jsonl", mc_rows()[:2])]
    assert inductor_compiler_imported(f"from fastpt import train\nassert train.main({args!r}) == 0") == []
    assert "mc_acc" in (tmp_path / "run" / "metrics.jsonl").read_text()


def metaspace_data(folder: Path) -> Path:
    """A data folder's tokenizer.json: a SentencePiece-style BPE trained here (the Metaspace
    pre-tokenizer: a space is U+2581, and every text encoded starts a word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(SENTENCES * 20, trainers.BpeTrainer(vocab_size=200, special_tokens=["<s>", "<unk>"]))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def write_mc(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mc_endings_are_tokenized_in_their_context_as_lm_eval_does(tmp_path):
    data = metaspace_data(tmp_path / "data")
    tok = load_tokenizer(data)
    ctx, ending = "the cat sees the ", "ball."  # the space on the context's side
    ctx_ids, (ids,) = encode_in_context(tok, ctx, [ending])
    whole = tok.encode_batch([ctx + ending])[0]
    assert [*ctx_ids, *ids] == whole  # as running text: the space moved to the ending
    apart = tok.encode_batch([ctx, ending])  # each alone: a word-start token after the context, another on the ending
    assert apart[0] != ctx_ids and [*apart[0], *apart[1]] != whole
    assert encode_in_context(tok, "the cat sees the", [" ball."]) == (ctx_ids, [ids])  # the space on either side
    rows = [{"ctx": ctx, "endings": [ending, " moon."], "label": 0}]
    mc = MultipleChoice(read_tasks(write_mc(tmp_path / "mc.jsonl", rows)), data, 64, 4, "char")
    first = mc.tasks[0][0][0]
    assert first.tokens == [tok.eot_id, *ctx_ids, *ids] and first.scored == len(ids)
    # per character of the continuation less the one separating space: "ball.", " moon." (lm-eval's choices)
    assert [c.length for c in mc.tasks[0][0]] == [5, 6]


def test_an_ending_merged_into_the_contexts_last_token_is_refused_naming_it(tmp_path):
    data = metaspace_data(tmp_path / "data")
    tok = load_tokenizer(data)
    whole, ctx = tok.encode_batch(["the cat sees the ball.", "the cat sees the ball"])
    assert len(whole) <= len(ctx)  # "ball." is one token, "ball" alone two: nothing of the whole is left after ctx's
    rows = [{"ctx": "the dog likes the", "endings": [" ball.", " tree."], "label": 0}]
    rows.append({"ctx": "the cat sees the ball", "endings": [" now", "."], "label": 1})  # "ball" + "." is one token
    tasks = read_tasks(write_mc(tmp_path / "mc.jsonl", rows))
    with pytest.raises(DataError, match=f"{tmp_path / 'mc.jsonl'}:2: ending 1 has no tokens of its own"):
        MultipleChoice(tasks, data, 64, 4, "byte")


@torch.no_grad()
def test_each_mc_norm_picks_the_best_ending_by_its_formula(tmp_path):
    """byte, char, token, none: the argmax of the log-likelihood of the ending's tokens (computed
    here from the logits) per UTF-8 byte, per character, per token, and as it is; byte and char
    count the ending without the space before it, as lm-eval counts a choice."""
    data = metaspace_data(tmp_path / "data")
    tok = load_tokenizer(data)
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=tok.vocab_size)).eval()
    contexts = ["the cat sees", "the owl likes the", "the dog chases", "a fox", "the moon", "the river likes"]
    endings = [" the ball.", " éé", " owl.", " the tree by the river."]
    rows = [{"ctx": c, "endings": endings, "label": 0} for c in contexts]
    nats, tokens = torch.zeros(len(rows), len(endings)), torch.zeros(len(rows), len(endings))  # by hand
    for r, ctx in enumerate(contexts):
        ctx_ids, ending_ids = encode_in_context(tok, ctx, endings)
        for e, ids in enumerate(ending_ids):
            seq = torch.tensor([tok.eot_id, *ctx_ids, *ids])
            logp = model(seq[None, :-1]).logits[0].log_softmax(-1)  # (T, V)
            nats[r, e], tokens[r, e] = -logp[-len(ids) :].gather(1, seq[-len(ids) :, None]).sum(), len(ids)
    lengths = {
        "byte": torch.tensor([9.0, 4, 4, 22]).expand_as(nats),  # " éé": 2 characters, 4 bytes
        "char": torch.tensor([9.0, 2, 4, 22]).expand_as(nats),
        "token": tokens,
        "none": torch.ones_like(nats),
    }
    picks = {}
    for norm, length in lengths.items():
        picks[norm] = (-nats / length).argmax(1).tolist()
        labelled = [{**row, "label": pick} for row, pick in zip(rows, picks[norm])]
        mc = MultipleChoice(read_tasks(write_mc(tmp_path / f"{norm}.jsonl", labelled)), data, 64, 3, norm)
        assert [[c.length for c in row] for row in mc.tasks[0]] == length.tolist(), norm
        accuracy = mc.accuracy(model, torch.device("cpu"), torch.autocast("cpu", enabled=False), distributed.Dist())
        assert accuracy == {"mc_acc": 1.0}, norm
    assert len({tuple(p) for p in picks.values()}) >= 3, picks  # the norms disagree on these rows


MC_MISTAKES = {
    "not JSON": ('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n{oops\n', ":2:"),
    "no label": ('{"ctx": "a", "endings": ["b", "c"]}\n', ':1: "label" is missing'),
    "a blank ending": ('{"ctx": "a", "endings": ["b", " "], "label": 0}\n', ":1:"),
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


MC_SPEC_MISTAKES = {
    "two files without names": ("{a},{b}", "several files need a name each"),
    "a name twice": ("x={a},x={b}", "'x' is given twice"),
    "a file without a name": ("x={a},{b}", "is not NAME=FILE"),
    "a name with a space": ("my task={a}", "'my task="),
    "a named file missing": ("x={a},y={a}.gone", ".gone: cannot read it"),
}


@pytest.mark.parametrize("case", MC_SPEC_MISTAKES)
def test_a_wrong_eval_mc_spec_is_one_line_naming_it(case, tiny_data, tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for f in (a, b):
        f.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n')
    spec, named = (v.format(a=a, b=b) for v in MC_SPEC_MISTAKES[case])
    code, _, err = run_main(
        train.main, [*TINY, "--data", str(tiny_data), "--out", str(tmp_path / "run"), "--eval-mc", spec], capsys
    )
    assert_one_line_error(code, err, named)


def test_eval_mc_as_a_toml_table_names_the_tasks(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[eval_mc]\nhellaswag = "h.jsonl"\narc_easy = "a.jsonl"\n')
    cfg = resolve({}, str(config), "cpu")
    assert cfg.eval_mc == "hellaswag=h.jsonl,arc_easy=a.jsonl"
    assert parse_spec(cfg.eval_mc) == [("hellaswag", Path("h.jsonl")), ("arc_easy", Path("a.jsonl"))]
    assert parse_spec("data/mc.jsonl") == [("", Path("data/mc.jsonl"))]


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
    """Two processes (DDP, FSDP, in one torchrun launch) on a bos-packed mixture see the batches,
    val_bpb, each source's val_loss and each MC task's mc_acc of one process; two tasks of 5 and 3
    rows striped over 2 ranks leave one rank a row short in each (its forwards padded)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES * 30))
    prepare([corpus], tmp_path / "sentences", "bytes", workers=1, val_fraction=0.1)
    five, three = tmp_path / "five.jsonl", tmp_path / "three.jsonl"
    five.write_text("\n".join(map(json.dumps, mc_rows()[:5])))
    three.write_text("\n".join(map(json.dumps, mc_rows(seed=1)[:3])))
    common = [
        *TINY,
        "--data",
        f"{tmp_path / 'sentences'}:0.7,{tiny_data}:0.3",
        "--packing",
        "bos",
        "--eval-mc",
        f"five={five},three={three}",
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
    one = run_train(*common, "--micro-batch", "4", "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = {"ddp": ["--micro-batch", "2"], "fsdp": ["--micro-batch", "2", "--parallel", "fsdp"]}
    results = launch({name: [*common, *extra, "--out", str(tmp_path / name)] for name, extra in two.items()}, tmp_path)
    for name, result in results.items():
        assert result["code"] == 0, (name, result["stderr"][-3000:])
    records = {
        name: [r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())]
        for name in ("one", *two)
    }
    keys = (
        "loss",
        "val_loss",
        "val_loss/sentences",
        "val_loss/tiny",
        "val_bpb",
        "mc_acc",
        "mc_acc/five",
        "mc_acc/three",
    )
    assert all(key in records["one"][-1] for key in keys[1:])
    for name in ("ddp", "fsdp"):
        for got, want in zip(records[name], records["one"], strict=True):
            for key in keys:
                assert (key in got) == (key in want)
                if key in want:
                    assert got[key] == pytest.approx(want[key], rel=1e-3), (name, key, got, want)


@pytest.mark.slow
def test_mc_eval_under_compile_matches_eager_and_training_does_not_recompile(tiny_data, tmp_path):
    mc = tmp_path / "mc.jsonl"
    mc.write_text("\n".join(map(json.dumps, mc_rows())))
    args = [
        *TINY,
        "--n-layers",  # one block: the eval's graphs do not depend on the depth
        "1",
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
