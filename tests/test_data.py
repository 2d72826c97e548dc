"""Bring your own data: every input format and tokenizer kind gives shards that decode to the
source text, the output folder is safe and locked, Ctrl-C cleans up, and every data mistake is
one line that names the file."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conftest import REPO, TINY, assert_one_line_error, run_main
from fastpt import prepare, sample, train
from fastpt.data.dataset import data_vocab, find_shards
from fastpt.data.shards import read_shard, write_shard
from fastpt.data.sources import parse_hub_spec
from fastpt.data.tokenizer import ByteTokenizer, CharTokenizer, HFTokenizer, load_tokenizer, run_tokenizer

DOCS = [
    "First document.\nIt has two lines.",
    "Ünïcödé — 日本語 and emoji 🙂",
    "x",
    "  leading spaces\tand tabs",
    "A longer one: " + "lorem ipsum dolor sit amet " * 40,
]
BYTES_EOT = ByteTokenizer.eot_id


def stream(folder: Path) -> np.ndarray:
    """All tokens of a dataset in order: train shards, then val (the held-out tail)."""
    return np.concatenate([read_shard(p) for p in find_shards(folder, "train") + find_shards(folder, "val")])


def split_docs(tokens: np.ndarray, eot: int) -> list[np.ndarray]:
    """Documents of a token stream where each one starts with the end-of-text token."""
    assert tokens[0] == eot
    return [d[1:] for d in np.split(tokens, np.flatnonzero(tokens == eot))[1:]]


def train_tokenizer(texts: list[str], vocab_size: int = 400) -> Tokenizer:
    """A GPT-2-style byte-level BPE made by `tokenizers` itself, standing in for a downloaded one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


@pytest.mark.parametrize(
    "size, fraction, expected_val",
    [
        (100_000, 0.05, 5000),  # the fraction, over several shards
        (100_000, 0.001, 2049),  # at least one eval window at seq_len 2048
        (8_000, 0.005, 800),  # never more than 10%
    ],
)
def test_single_file_gives_train_and_val_with_val_the_tail(tmp_path, size, fraction, expected_val):
    text = (DOCS[-1] * (size // len(DOCS[-1]) + 1))[:size]
    (tmp_path / "input.txt").write_text(text)
    meta = prepare.prepare(
        [tmp_path / "input.txt"], tmp_path / "out", "bytes", val_fraction=fraction, workers=1, shard_tokens=30_000
    )
    tokens = stream(tmp_path / "out")
    assert bytes(tokens[1:].astype(np.uint8)).decode() == text and tokens[0] == BYTES_EOT
    val = np.concatenate([read_shard(p) for p in find_shards(tmp_path / "out", "val")])
    assert meta["tokens"] == {"train": size + 1 - expected_val, "val": expected_val} and len(val) == expected_val
    np.testing.assert_array_equal(val, tokens[-expected_val:])
    if size == 100_000:
        assert len(find_shards(tmp_path / "out", "train")) == 4  # 100,001 - 5000 tokens in shards of 30k


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> None:
    lines = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)) + "\n"  # a blank line too
    opener = gzip.open if path.suffix == ".gz" else open
    if path.suffix == ".zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        return
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(lines)


def write_parquet(path: Path, docs: list[str], field: str = "text", row_group_size: int = 2) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"id": list(range(len(docs))), field: docs}),
        path,
        row_group_size=row_group_size,
        write_page_checksum=True,
    )


def write_saved_dataset(path: Path, docs: list[str], field: str = "text") -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({field: docs})}).save_to_disk(str(path))


@pytest.mark.parametrize(
    "name, write, field, workers",
    [
        ("docs.jsonl", write_jsonl, "text", 1),
        ("docs.jsonl.gz", write_jsonl, "text", 2),  # through the worker pool: order kept
        ("docs.json.zst", write_jsonl, "body", 1),
        ("docs.parquet", write_parquet, "content", 1),
        ("saved", write_saved_dataset, "text", 1),
    ],
)
def test_record_inputs_decode_to_the_source_documents(tmp_path, name, write, field, workers):
    docs = DOCS + ["", "after an empty record"]
    write(tmp_path / name, docs, field)
    meta = prepare.prepare([tmp_path / name], tmp_path / "out", "bytes", text_field=field, workers=workers)
    got = [bytes(d.astype(np.uint8)).decode() for d in split_docs(stream(tmp_path / "out"), BYTES_EOT)]
    assert got == [d for d in docs if d] and meta["documents"] == len(docs) - 1


def compress(data: bytes, suffix: str, frames: int = 1) -> bytes:
    """gzip members or zstd frames (with the checksum the zstd tool writes), one after another."""
    import zstandard

    cut = [len(data) * i // frames for i in range(frames + 1)]
    parts = [data[a:b] for a, b in zip(cut, cut[1:])]
    pack = gzip.compress if suffix == ".gz" else zstandard.ZstdCompressor(write_checksum=True).compress
    return b"".join(map(pack, parts))


MANY_DOCS = [f"document {i}: " + "words " * (i % 97) for i in range(3000)]


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_compressed_input_of_several_frames_is_read_whole(tmp_path, suffix):
    lines = "".join(json.dumps({"text": d}) + "\n" for d in MANY_DOCS).encode()
    (tmp_path / f"docs.jsonl{suffix}").write_bytes(compress(lines, suffix, frames=3))
    meta = prepare.prepare([tmp_path / f"docs.jsonl{suffix}"], tmp_path / "out", "bytes", workers=1)
    got = [bytes(d.astype(np.uint8)).decode() for d in split_docs(stream(tmp_path / "out"), BYTES_EOT)]
    assert got == MANY_DOCS and meta["documents"] == len(MANY_DOCS)


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(range(64))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, named", [(cut_in_half, "truncated"), (garble, "corrupt")], ids=["cut", "corrupt"])
@pytest.mark.parametrize("name", ["docs.jsonl.gz", "docs.jsonl.zst", "docs.txt.gz", "docs.parquet"])
def test_a_damaged_input_is_an_error_naming_it_never_a_shorter_corpus(tmp_path, capsys, name, damage, named):
    """`prepare good.jsonl damaged.zst`: one line naming the damaged file (and where it broke), exit 2,
    no dataset: a cut-off download must not become a silently smaller corpus."""
    write_jsonl(tmp_path / "good.jsonl", DOCS)
    damaged = tmp_path / name
    if name.endswith(".parquet"):
        write_parquet(damaged, MANY_DOCS, row_group_size=500)  # with page checksums, as Spark and DuckDB write
    else:
        text = "".join(json.dumps({"text": d}) + "\n" for d in MANY_DOCS) if ".jsonl" in name else "\n".join(MANY_DOCS)
        damaged.write_bytes(compress(text.encode(), damaged.suffix))
    damage(damaged)
    for inputs in ([tmp_path / "good.jsonl", damaged], [damaged]):
        argv = [*map(str, inputs), "--tokenizer", "bytes", "--workers", "1", "--out", str(tmp_path / "out")]
        code, _, err = run_main(prepare.main, argv, capsys)
        assert_one_line_error(code, err, str(damaged), named)
        assert not (tmp_path / "out").exists() and not (tmp_path / ".out.prepare-tmp").exists()


def test_a_pretrained_tokenizer_json_gives_its_own_ids_and_trains(tmp_path, capsys):
    tok = train_tokenizer(DOCS * 3)
    (tmp_path / "gpt2ish").mkdir()
    tok.save(str(tmp_path / "gpt2ish" / "tokenizer.json"))
    docs = [f"{DOCS[i % len(DOCS)]} {i}" for i in range(300)]
    write_jsonl(tmp_path / "web.jsonl", docs)
    meta = prepare.prepare([tmp_path / "web.jsonl"], tmp_path / "data", str(tmp_path / "gpt2ish"), workers=1)
    eot = tok.token_to_id("<|endoftext|>")
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["eot_id"] == eot
    headers = [np.fromfile(p, "<i4", 4) for p in find_shards(tmp_path / "data", "train")]
    assert all(h[3] == tok.get_vocab_size() for h in headers)  # the header records the true vocab
    got = [d.tolist() for d in split_docs(stream(tmp_path / "data"), eot)]
    assert got == [e.ids for e in tok.encode_batch(docs)]

    code, _, err = run_main(
        train.main,
        ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), *TINY, "--max-steps", "3"],
        capsys,
    )
    assert code == 0, err
    ours = load_tokenizer(tmp_path / "run" / "tokenizer.json")  # what fastpt.sample decodes with
    assert ours.vocab_size == tok.get_vocab_size() and ours.decode(got[7]) == docs[7]


def test_char_tokenizer_round_trips(tmp_path):
    text = "".join(DOCS)
    (tmp_path / "input.txt").write_text(text)
    meta = prepare.prepare([tmp_path / "input.txt"], tmp_path / "out", "char", workers=1)
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert isinstance(tok, CharTokenizer) and meta["vocab_size"] == len(set(text)) + 1 == tok.vocab_size
    assert tok.decode(stream(tmp_path / "out").tolist()) == text


def test_decode_never_fails_on_ids_outside_the_vocab():
    hf = HFTokenizer(train_tokenizer(DOCS))
    for tok in (ByteTokenizer(), CharTokenizer("abc"), CharTokenizer("abc", eot=False), hf):
        ids = tok.encode_batch(["abc"])[0]
        assert tok.decode(ids + [tok.vocab_size, tok.vocab_size + 1000, -1]) == "abc"


def test_nanogpt_char_data_with_meta_pkl_trains_and_decodes(tmp_path, capsys):
    text = "".join(DOCS) * 20
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    data = tmp_path / "shakespeare_char"
    data.mkdir()
    ids[: len(ids) * 9 // 10].tofile(data / "train.bin")
    ids[len(ids) * 9 // 10 :].tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    shards = find_shards(data, "train", "nanogpt") + find_shards(data, "val", "nanogpt")
    assert data_vocab(data, shards, headerless=True) == len(chars)

    code, _, err = run_main(
        train.main,
        ["--data", str(data), "--data-format", "nanogpt", "--out", str(tmp_path / "run"), *TINY, "--max-steps", "3"],
        capsys,
    )
    assert code == 0, err
    tok = load_tokenizer(tmp_path / "run" / "tokenizer.json")  # what the trainer wrote for fastpt.sample
    assert tok.vocab_size == len(chars) and tok.eot_id is None and tok.decode(ids.tolist()) == text
    code, out, err = run_main(
        sample.main,
        ["--ckpt", str(tmp_path / "run"), "--device", "cpu", "--prompt", "a", "--max-new-tokens", "8"],
        capsys,
    )
    assert code == 0 and set(out.strip()) <= set(chars), err


def test_headerless_data_without_meta_is_gpt2(tmp_path):
    """nanoGPT's own rule: no meta.pkl means GPT-2 tokens, so the end-of-text id 50256 is in the vocab
    even when the data never uses it, and the run folder names GPT-2's tokenizer."""
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    assert data_vocab(tmp_path, [tmp_path / "train.bin"], headerless=True) == 50257
    assert json.loads(run_tokenizer(tmp_path)) == {"type": "tiktoken", "name": "gpt2"}


def test_out_is_never_a_users_folder_and_replacing_a_dataset_needs_overwrite(tmp_path, capsys):
    (tmp_path / "input.txt").write_text(DOCS[-1])
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("my notes")
    argv = [str(tmp_path / "input.txt"), "--tokenizer", "bytes", "--workers", "1", "--out"]
    code, _, err = run_main(prepare.main, argv + [str(notes)], capsys)
    assert code == 2 and (notes / "todo.txt").read_text() == "my notes" and os.listdir(notes) == ["todo.txt"]
    assert_one_line_error(code, err, str(notes), "nothing deleted")

    assert run_main(prepare.main, argv + [str(tmp_path / "data")], capsys)[0] == 0
    code, _, err = run_main(prepare.main, argv + [str(tmp_path / "data"), "--tokenizer", "char"], capsys)
    assert code == 2 and load_tokenizer(tmp_path / "data").vocab_size == 257
    assert_one_line_error(code, err, str(tmp_path / "data"), "--overwrite")
    assert run_main(prepare.main, argv + [str(tmp_path / "data"), "--tokenizer", "char", "--overwrite"], capsys)[0] == 0
    assert isinstance(load_tokenizer(tmp_path / "data"), CharTokenizer)
    assert sorted(os.listdir(tmp_path)) == ["data", "input.txt", "notes"]  # no temporary folder left


@pytest.fixture(scope="module")
def slow_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A corpus that takes a BPE tokenizer seconds to get through, and that tokenizer."""
    folder = tmp_path_factory.mktemp("slow")
    text = (REPO / "fastpt" / "train.py").read_text()
    (folder / "big.txt").write_text(text * (16 * 2**20 // len(text)))
    train_tokenizer([text]).save(str(folder / "tokenizer.json"))
    return folder / "big.txt", folder / "tokenizer.json"


def start_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int) -> subprocess.Popen:
    """fastpt.prepare in a real process, returned once it is writing shards into its temporary folder."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastpt.prepare",
            str(corpus),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(out),
            "--workers",
            str(workers),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    tmp = out.with_name(f".{out.name}.prepare-tmp")
    deadline = time.monotonic() + 60
    while not (tmp / "train_000000.bin").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    return proc


def test_ctrl_c_exits_130_with_one_line_and_leaves_no_temporary_folder(tmp_path, slow_corpus):
    proc = start_prepare(*slow_corpus, tmp_path / "data", workers=2)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the workers too
    _, err = proc.communicate(timeout=60)
    assert_one_line_error(proc.returncode, err, "interrupted", expected_code=130)
    assert os.listdir(tmp_path) == []


def test_a_second_prepare_on_the_same_out_is_refused_and_a_killed_one_leaves_no_lock(tmp_path, slow_corpus, capsys):
    out = tmp_path / "data"
    first = start_prepare(*slow_corpus, out, workers=1)
    try:
        code, _, err = run_main(prepare.main, [str(slow_corpus[0]), "--out", str(out), "--tokenizer", "bytes"], capsys)
        assert_one_line_error(code, err, str(out), "another fastpt.prepare")
    finally:
        first.kill()
        first.communicate()
    (tmp_path / "small.txt").write_text(DOCS[-1])
    code, _, _ = run_main(
        prepare.main, [str(tmp_path / "small.txt"), "--out", str(out), "--tokenizer", "bytes"], capsys
    )
    assert code == 0 and sorted(os.listdir(tmp_path)) == ["data", "small.txt"]  # the killed one's leftovers gone
    assert find_shards(out, "val")


def test_hub_dataset_spec():
    assert parse_hub_spec("HuggingFaceFW/fineweb-edu:sample-10BT") == (
        "HuggingFaceFW/fineweb-edu",
        "sample-10BT",
        "train",
    )
    assert parse_hub_spec("roneneldan/TinyStories::validation") == ("roneneldan/TinyStories", None, "validation")


def make_shards(folder: Path) -> Path:
    folder.mkdir()
    write_shard(folder / "train_000000.bin", np.arange(2000) % 250, 257)
    write_shard(folder / "val_000000.bin", np.arange(500) % 250, 257)
    return folder


def unreadable(path: Path) -> None:
    """A file the OS refuses to open, even for root: a socket."""
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))


PREPARE_MISTAKES = {  # name -> (set up tmp_path, argv; FILE is tmp_path / "f"), what the error names
    "unreadable input": (lambda f: unreadable(f), ["FILE"], "FILE"),
    "dangling symlink input": (lambda f: f.symlink_to(f.with_name("gone.txt")), ["FILE"], "FILE"),
    "parquet given as text": (lambda f: write_parquet(f, DOCS), ["FILE"], "FILE"),
    "NUL bytes": (lambda f: f.write_bytes(b"text\0\1\2binary"), ["FILE"], "FILE"),
    "--out names a file": (lambda f: f.write_text("text"), ["FILE", "--out", "FILE"], "FILE"),
    "not a JSON line": (
        lambda f: f.with_suffix(".jsonl").write_text('{"text": "ok"}\n{oops\n'),
        ["FILE.jsonl"],
        "FILE.jsonl:2",
    ),
    "no text field": (lambda f: write_jsonl(f.with_suffix(".jsonl"), DOCS, "content"), ["FILE.jsonl"], "FILE.jsonl:1"),
    "missing tokenizer": (lambda f: f.write_text("text"), ["FILE", "--tokenizer", "missing.json"], "missing.json"),
    "corrupt tokenizer": (
        lambda f: f.with_suffix(".json").write_text("{oops"),
        [str(REPO / "README.md"), "--tokenizer", "FILE.json"],
        "FILE.json",
    ),
    "no such input": (lambda f: None, ["FILE"], "FILE"),
    "parquet ints": (
        lambda f: write_parquet(f.with_suffix(".parquet"), DOCS),
        ["FILE.parquet", "--text-field", "id"],
        "FILE.parquet: column 'id' holds int64, not text",
    ),
    "dataset lists": (
        lambda f: write_saved_dataset(f, [[d] for d in DOCS]),
        ["FILE"],
        "FILE: column 'text' holds ",  # then the feature's type: List (datasets 4), list (2.16)
    ),
    "--out in /proc": (lambda f: f.write_text("text"), ["FILE", "--out", "/proc/fastpt-out"], "/proc/fastpt-out"),
}


@pytest.mark.parametrize("case", PREPARE_MISTAKES)
def test_prepare_mistakes_are_one_line_naming_the_file(case, tmp_path, capsys):
    setup, argv, named = PREPARE_MISTAKES[case]
    setup(tmp_path / "f")
    argv = [a.replace("FILE", str(tmp_path / "f")) for a in argv]
    code, _, err = run_main(prepare.main, argv + ([] if "--out" in argv else ["--out", str(tmp_path / "out")]), capsys)
    assert_one_line_error(code, err, named.replace("FILE", str(tmp_path / "f")))
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.prepare-tmp").exists()


def set_vocab(path: Path, vocab: int) -> None:
    header = np.fromfile(path, "<i4", 256)
    header[3] = vocab
    with open(path, "r+b") as f:
        f.write(header.tobytes())


def replace_with_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def dangle(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.with_name("gone.bin"))


def nanogpt(folder: Path) -> None:
    for split in ("train", "val"):
        (folder / f"{split}_000000.bin").unlink()
    np.arange(3000, dtype=np.uint16).tofile(folder / "train.bin")
    (folder / "val.bin").write_bytes(b"")


TRAIN_MISTAKES = {  # name -> (edit a shard folder d, --data, extra flags, what the error names)
    "a text file": (
        lambda d: (d / "notes.txt").write_text("text"),
        "{d}/notes.txt",
        [],
        "python -m fastpt.prepare {d}/notes.txt --out DIR",
    ),
    "a folder of text": (
        lambda d: [p.unlink() for p in d.glob("*.bin")] + [(d / "a.txt").write_text("x")],
        "{d}",
        [],
        "python -m fastpt.prepare {d} --out DIR",
    ),
    "unreadable shard": (lambda d: replace_with_dir(d / "val_000000.bin"), "{d}", [], "{d}/val_000000.bin"),
    "dangling symlink shard": (lambda d: dangle(d / "train_000000.bin"), "{d}", [], "{d}/train_000000.bin"),
    "corrupt meta.json": (lambda d: (d / "meta.json").write_text("{oops"), "{d}", [], "{d}/meta.json"),
    "meta.json vocab not a number": (
        lambda d: (d / "meta.json").write_text('{"vocab_size": "x"}'),
        "{d}",
        [],
        "{d}/meta.json",
    ),
    "header vocab 2^31-1": (lambda d: set_vocab(d / "train_000000.bin", 2**31 - 1), "{d}", [], "{d}/train_000000.bin"),
    "empty headerless val.bin": (nanogpt, "{d}", ["--data-format", "nanogpt"], "{d}/val.bin"),
    "corrupt meta.pkl": (
        lambda d: nanogpt(d) or (d / "meta.pkl").write_bytes(b"\x80\x04junk"),
        "{d}",
        ["--data-format", "nanogpt"],
        "{d}/meta.pkl",
    ),
    **{  # bytes the unpickler fails on with OverflowError (38) and MemoryError (215), not UnpicklingError
        f"meta.pkl of random bytes (seed {seed})": (
            lambda d, seed=seed: nanogpt(d) or (d / "meta.pkl").write_bytes(np.random.default_rng(seed).bytes(64)),
            "{d}",
            ["--data-format", "nanogpt"],
            "{d}/meta.pkl: not a nanoGPT meta.pkl",
        )
        for seed in (38, 215)
    },
    "meta.pkl that runs code": (
        lambda d: nanogpt(d) or (d / "meta.pkl").write_bytes(pickle.dumps(os.getcwd)),
        "{d}",
        ["--data-format", "nanogpt"],
        "{d}/meta.pkl",
    ),
    "interrupted prepare": (lambda d: (d / ".incomplete").touch(), "{d}", [], "{d} is an unfinished fastpt.prepare"),
    "nanoGPT data as llmc": (nanogpt, "{d}", [], "--data-format nanogpt"),
}


@pytest.mark.parametrize("case", TRAIN_MISTAKES)
def test_train_data_mistakes_are_one_line_naming_the_file(case, tmp_path, capsys):
    edit, data, extra, named = TRAIN_MISTAKES[case]
    folder = make_shards(tmp_path / "data")
    edit(folder)
    code, _, err = run_main(
        train.main,
        [*TINY, "--data", data.format(d=folder), "--out", str(tmp_path / "run"), "--max-steps", "1", *extra],
        capsys,
    )
    assert_one_line_error(code, err, named.format(d=folder))


def few_stdlib_files(count: int = 12) -> list[Path]:
    import sysconfig

    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]


def test_without_data_the_default_corpus_is_prepared_once(tmp_path, monkeypatch, capsys):
    """No --data (the README's first command): the stdlib corpus (here a few of its files) is
    prepared into the cache with a local BPE by the first run, and found there by the next."""
    monkeypatch.setenv("FASTPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prepare, "stdlib_sources", few_stdlib_files)
    args = [*TINY, "--max-steps", "2", "--out"]
    code, out, err = run_main(train.main, args + [str(tmp_path / "first")], capsys)
    assert code == 0 and "preparing the default corpus" in out, err
    code, out, err = run_main(train.main, args + [str(tmp_path / "second")], capsys)
    assert code == 0 and "preparing the default corpus" not in out, err
    (corpus,) = (tmp_path / "cache").iterdir()
    assert json.loads((corpus / "meta.json").read_text())["vocab_size"] == 4096
    assert (tmp_path / "second" / "tokenizer.json").read_bytes() == (corpus / "tokenizer.json").read_bytes()


def test_a_shape_that_cannot_work_is_refused_before_the_default_corpus_is_prepared(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTPT_CACHE", str(tmp_path / "cache"))
    code, _, err = run_main(train.main, [*TINY, "--n-heads", "3", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and not (tmp_path / "cache").exists()
    assert_one_line_error(code, err, "'dim' = 128 is not divisible by 'n_heads' = 3")


def test_a_dataset_inside_its_input_folder_is_not_read_as_input(tmp_path, capsys):
    """prepare corpus --out corpus/data, then again with --overwrite: the first dataset's shards are
    not input the second time (nor under a glob), so both runs give the same tokens."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(DOCS[-1])
    out = tmp_path / "corpus" / "data"
    for inputs in ([str(tmp_path / "corpus")], [str(tmp_path / "corpus" / "**")]):
        code, _, err = run_main(
            prepare.main, inputs + ["--out", str(out), "--tokenizer", "bytes", "--workers", "1", "--overwrite"], capsys
        )
        assert code == 0, err
        assert len(stream(out)) == len(DOCS[-1].encode()) + 1  # the document and its end-of-text token


def test_prepare_says_when_the_vocab_is_large_for_the_corpus(tmp_path, capsys):
    """~1 MB of stdlib code with a 6000-entry BPE: the vocab is most of a tiny model; 4096 is not flagged."""
    corpus = sorted(Path(os.__file__).parent.glob("*.py"))[:12]
    argv = [*map(str, corpus), "--workers", "1"]
    code, out, _ = run_main(prepare.main, argv + ["--out", str(tmp_path / "big"), "--vocab-size", "6000"], capsys)
    assert code == 0
    meta = json.loads((tmp_path / "big" / "meta.json").read_text())
    assert meta["vocab_size"] == 6000 and meta["tokens"]["train"] < 1000 * 6000
    note = [line for line in out.splitlines() if line.startswith("note: vocab 6,000")]
    assert len(note) == 1 and "--vocab-size 4096" in note[0] and "% of the parameters" in note[0]
    code, out, _ = run_main(prepare.main, argv + ["--out", str(tmp_path / "small"), "--vocab-size", "4096"], capsys)
    assert code == 0 and "note: vocab" not in out
