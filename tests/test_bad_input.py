"""One clear line for every bad input: a damaged shard, a flag or config value out of range, a
missing or unusable folder, a resume of another model; each is one `fastpt: error:` line naming
what is wrong, exit 2, no traceback, and the disk left as it was found."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, base_args, run_args, train_refuses
from fastpt.config import FIELD_TYPES, FIELDS
from fastpt.data.shards import write_shard
from fastpt.errors import ELSEWHERE

# ---- bad input: one line on stderr, exit code 2, no traceback


def set_header(index: int, value: int):
    def edit(shard: Path) -> None:
        with open(shard, "r+b") as f:
            f.seek(4 * index)
            f.write(np.int32(value).tobytes())

    return edit


BAD_SHARDS = {
    "bad magic": (set_header(0, 12345), "bad magic 12345"),
    "bad version": (set_header(1, 3), "version 3 does not match magic 20240520"),
    "truncated": (lambda p: os.truncate(p, p.stat().st_size - 2), "header says"),
    "dangling symlink (beside meta.json)": (
        lambda p: (p.unlink(), p.symlink_to(p.with_name("gone.bin"))),
        "a dangling symlink",
    ),
    "token id out of range": (
        lambda p: write_shard(p, np.arange(301)),
        "token id 300 is out of range for vocab size 257",
    ),
}

BAD_ARGS = {
    "unknown flag": (
        ["--max-stpes", "5"],
        "command line: unrecognized argument '--max-stpes' (did you mean '--max-steps'?)",
    ),
    "bad flag value": (["--lr", "fast"], "command line: argument --lr: invalid float value: 'fast'"),
    "zero lr": (["--lr", "0"], "'lr' must be in (0, 10], got 0.0"),
    "negative lr": (["--lr", "-0.001"], "'lr' must be in (0, 10], got -0.001"),
    "warmup > max_steps": (["--warmup-steps", "20"], "'warmup_steps' (20) is larger than 'max_steps' (10)"),
    "zero micro-batch": (["--micro-batch", "0"], "'micro_batch' must be in [1, 65_536], got 0"),
    "fp16 on cpu": (["--dtype", "fp16"], "'dtype' = 'fp16' needs a CUDA device (got cpu)"),
    "seq_len > data": (["--seq-len", "100000"], "seq_len 100000 is longer than the data"),
    "nan lr": (["--lr", "nan"], "'lr' must be in (0, 10] (a finite number), got nan"),
    "inf lr": (["--lr", "inf"], "'lr' must be in (0, 10] (a finite number), got inf"),
    "beta1 1.5": (["--beta1", "1.5"], "'beta1' must be in [0, 1), got 1.5"),
    "negative seed": (["--seed", "-1"], "'seed' must be in [0, 4_294_967_295], got -1"),
    "floor above peak": (["--min-lr-ratio", "2"], "'min_lr_ratio' must be in [0, 1], got 2.0"),
    "zero eps": (["--eps", "0"], "'eps' must be in (0, 1], got 0.0"),
    "negative clip": (["--max-grad-norm", "-1"], "'max_grad_norm' must be in [0, 1_000_000], got -1.0"),
    "zero eval tokens": (["--eval-tokens", "0"], "'eval_tokens' must be in [1, 1_000_000_000_000], got 0"),
    # values past a flag's range that overflowed fp32, a float or the machine once accepted
    "a softcap past fp32 (NaN losses)": (
        ["--logit-softcap", "1e39"],
        "'logit_softcap' must be 0 (off) or in [1, 1000], got 1e+39",
    ),
    "a softcap that rounds to 0 in fp32": (["--logit-softcap", "1e-50"], "'logit_softcap' must be 0 (off) or in"),
    "a Muon LR past fp32 (a traceback)": (
        ["--optimizer", "muon", "--muon-lr", "1e39"],
        "'muon_lr' must be in (0, 10], got 1e+39",
    ),
    "a weight decay past fp32": (["--weight-decay", "1e39"], "'weight_decay' must be in [0, 10], got 1e+39"),
    "a z-loss past fp32": (["--z-loss", "1e39"], "'z_loss' must be in [0, 1], got 1e+39"),
    "steps past a float (a traceback)": (
        ["--max-steps", "1" + "0" * 400],
        "'max_steps' must be in [1, 1_000_000_000_000]",
    ),
    "a count past a float (a traceback)": (["--keep-checkpoints", "1" + "0" * 400], "'keep_checkpoints' must be in"),
    "a micro-batch that filled the memory": (
        ["--micro-batch", "100000000"],
        "'micro_batch' must be in [1, 65_536], got 100000000",
    ),
    "a sequence past max_seq_len's bound": (["--seq-len", "1" + "0" * 400], "'seq_len' must be in [0, 1_048_576]"),
    "threads past a C int": (["--threads", str(2**31)], "'threads' must be in [0, 2_147_483_647], got 2147483648"),
    "bad choice": (["--decay-rule", "all"], "'decay_rule' = 'all' is not one of 'ndim', 'strict'"),
    "another trainer's dtype": (
        ["--dtype", "bfloat16"],
        "'dtype' = 'bfloat16' is not one of 'bf16', 'fp16', 'fp32' (did you mean 'bf16'?)",
    ),
    "float32": (["--dtype", "float32"], "(did you mean 'fp32'?)"),
    "another command's flag": (
        ["--tokenizer", "bpe"],
        "unrecognized argument '--tokenizer' (a flag of python -m fastpt.prepare, which makes the folder that --data",
    ),
    "another trainer's flag": (
        ["--learning-rate", "1e-3"],
        "unrecognized argument '--learning-rate' (did you mean '--lr'?)",
    ),
    "heads do not divide dim": (["--n-heads", "3"], "'dim' = 128 is not divisible by 'n_heads' = 3"),
    "kv heads do not divide heads": (["--n-kv-heads", "3"], "'n_heads' = 4 is not divisible by 'n_kv_heads' = 3"),
    "odd head dim": (["--dim", "100"], "head dim 25 (dim 100 / n_heads 4) must be even for RoPE"),
    "no layers": (["--n-layers", "0"], "'n_layers' must be > 0, got 0"),
    "an empty out (unset variable)": (["--out", ""], "'out' is empty"),
    "a dim with zeros too many": (["--dim", "1000000000"], "parameters, beyond fastpt's 100,000,000,000"),
    "a sequence table too long": (["--max-seq-len", "10000000000"], "'max_seq_len' = 10,000,000,000 is beyond"),
    "vocab below the data's": (["--vocab-size", "100"], "'vocab_size' = 100 is smaller than the data's vocab (257)"),
    "seq_len > max_seq_len": (["--max-seq-len", "16"], "'seq_len' = 32 is longer than 'max_seq_len' = 16"),
    "nan norm eps": (["--norm-eps", "nan"], "'norm_eps' must be in (0, 0.01] (a finite number), got nan"),
}


@pytest.mark.parametrize("case", BAD_SHARDS)
def test_bad_shard_is_reported_with_its_file(case, tiny_data, tmp_path, capsys):
    edit, expected = BAD_SHARDS[case]
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data, ignore=shutil.ignore_patterns(".*"))  # without the token-id caches
    edit(data / "train_000000.bin")
    train_refuses(capsys, base_args(data, tmp_path / "run"), f"{data / 'train_000000.bin'}: {expected}")


@pytest.mark.parametrize("case", BAD_ARGS)
def test_bad_argument_is_one_line(case, tiny_data, tmp_path, capsys):
    extra, expected = BAD_ARGS[case]
    train_refuses(capsys, base_args(tiny_data, tmp_path) + extra, expected)


def test_every_numeric_setting_has_a_finite_range():
    """A flag without a ceiling took 1e39 (a NaN loss, a traceback) or a 400-digit number (a
    traceback). The shape keys' bounds are ModelConfig.check's (MAX_PARAMS, MAX_SEQ_LEN), which
    --init-from's and a checkpoint's shapes meet too."""
    unbounded = [
        name
        for name, f in FIELDS.items()
        if FIELD_TYPES[name] in (int, float)
        and f.default is not None
        and not (f.metadata["domain"] and math.isfinite(f.metadata["domain"].high))
    ]
    assert unbounded == []


def test_another_commands_flags_are_its_own(capsys):
    """Each flag fastpt.train sends to another command (errors.ELSEWHERE) is that command's, not train's."""
    for key, command in ELSEWHERE.items():
        module = importlib.import_module(re.search(r"fastpt\.\w+", command)[0])
        with pytest.raises(SystemExit):
            module.parse_args(["--help"])
        assert f"--{key.replace('_', '-')} " in capsys.readouterr().out and key not in FIELDS, key


def test_a_missing_data_folder_names_the_nearest_one(tiny_data, tmp_path, capsys):
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    (tmp_path / "data" / "bpe").mkdir()
    for typo in ("data/tny", "dta/tiny", "data/bpee"):
        want = tmp_path / typo.replace("tny", "tiny").replace("dta", "data").replace("bpee", "bpe")
        train_refuses(capsys, base_args(tmp_path / typo, tmp_path / "run"), f"does not exist (did you mean '{want}'?)")
    train_refuses(capsys, base_args(tmp_path / "data" / "zzzzzz", tmp_path / "run"), "does not exist")
    mixture = f"{tiny_data}:1,{tmp_path / 'data' / 'tny'}:1"
    train_refuses(
        capsys,
        [*TINY, "--out", str(tmp_path / "run"), "--data", mixture],
        f"(did you mean '{tmp_path / 'data' / 'tiny'}'?)",
    )


def test_triton_kernels_without_a_gpu_or_the_interpreter(tiny_data, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    train_refuses(
        capsys, base_args(tiny_data, tmp_path) + ["--kernels", "triton"], "'kernels' = 'triton' cannot run here"
    )


BAD_TOML = {
    "wrong type": ('lr = "fast"\n', "'lr' must be float, got 'fast'"),
    "not TOML": ("lr = = 1\n", "not valid TOML"),
    "binary": ("\x00\xff\xfe garbage", "not valid TOML"),
    "another command's key": (
        'tokenizer = "bpe"\n',
        "unknown config key 'tokenizer' (a flag of python -m fastpt.prepare",
    ),
    "unknown key": (
        "max_steps = 10\nwarmup_step = 2\n",
        "unknown config key 'warmup_step' (did you mean 'warmup_steps'?)",
    ),
    "another trainer's key": ("learning_rate = 1e-3\n", "unknown config key 'learning_rate' (did you mean 'lr'?)"),
    "another trainer's steps": ("max_iters = 5\n", "unknown config key 'max_iters' (did you mean 'max_steps'?)"),
    "bad shape": ("n_layers = 0\n", "'n_layers' must be > 0, got 0"),
}


@pytest.mark.parametrize("case", BAD_TOML)
def test_bad_config_file_is_one_line(case, tiny_data, tmp_path, capsys):
    text, expected = BAD_TOML[case]
    config = tmp_path / "run.toml"
    config.write_bytes(text.encode("latin-1"))
    train_refuses(capsys, base_args(tiny_data, tmp_path / "run") + ["--config", str(config)], expected)
    train_refuses(
        capsys,
        base_args(tiny_data, tmp_path / "run") + ["--config", str(tmp_path / "missing.toml")],
        f"config file not found: {tmp_path / 'missing.toml'}",
    )


def test_missing_or_empty_data_folder(tmp_path, capsys):
    train_refuses(
        capsys, base_args(tmp_path / "nope", tmp_path / "run"), f"data folder {tmp_path / 'nope'} does not exist"
    )
    (tmp_path / "empty").mkdir()
    train_refuses(
        capsys,
        base_args(tmp_path / "empty", tmp_path / "run"),
        f"data folder {tmp_path / 'empty'} has no *train_*.bin files",
    )


def test_unusable_run_folder(tiny_data, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    train_refuses(
        capsys,
        base_args(tiny_data, tmp_path / "file" / "run"),
        f"'out' = '{tmp_path / 'file' / 'run'}': cannot write the run folder (Not a directory)",
    )
    (tmp_path / "notes").write_text("mine")
    train_refuses(capsys, base_args(tiny_data, tmp_path / "notes"), f"'out' = '{tmp_path / 'notes'}' is a file")
    assert (tmp_path / "notes").read_text() == "mine"
    (tmp_path / "ckpt_00000004.pt").write_bytes(b"not a checkpoint")
    train_refuses(
        capsys,
        base_args(tiny_data, tmp_path),
        "already holds a run (newest checkpoint ckpt_00000004.pt): add --resume to continue it",
    )
    train_refuses(
        capsys,
        base_args(tiny_data, tmp_path) + ["--resume"],
        f"no checkpoint in {tmp_path} loads (ckpt_00000004.pt); newest: could not read checkpoint",
        f"checkpoint {tmp_path / 'ckpt_00000004.pt'}",
    )


def test_resume_with_another_model_names_the_difference(reference, tiny_data, capsys):
    train_refuses(
        capsys,
        base_args(tiny_data, reference) + ["--resume", "--n-layers", "3", "--no-tie-embeddings"],
        "ckpt_00000010.pt was written for another model (n_layers 2 != 3, tie_embeddings True != False)",
    )


# ---- a refused run leaves the disk as it found it


class RunsAShell:
    """What a crafted meta.pkl carries: unpickling it would call os.system."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def refusal_data(tiny_data, bpe_data, tmp_path_factory) -> dict[str, Path]:
    """Data folders for refused runs: shards with no document token and no tokenizer; nanoGPT bins
    with a meta.pkl that would run a shell command; MC files with every mistake."""
    import pickle

    root = tmp_path_factory.mktemp("refusals")
    bare = root / "bare"
    bare.mkdir()
    write_shard(bare / "train_000000.bin", np.arange(2000) % 250, 257)
    write_shard(bare / "val_000000.bin", np.arange(500) % 250, 257)
    crafted = root / "crafted"
    crafted.mkdir()
    for split in ("train", "val"):
        (np.arange(3000) % 60).astype(np.uint16).tofile(crafted / f"{split}.bin")
    (crafted / "meta.pkl").write_bytes(pickle.dumps(RunsAShell(f"touch {root / 'payload-ran'}")))
    row = {"ctx": "a", "endings": ["b", "c"], "label": 0}
    mc = {
        "empty": "",
        "malformed": json.dumps(row) + "\n{oops\n",
        "label-out-of-range": json.dumps({**row, "label": 2}),
        "label-a-string": json.dumps({**row, "label": "0"}),
        "one-ending": json.dumps({**row, "endings": ["b"]}),
        "empty-ending": json.dumps({**row, "endings": ["b", ""]}),
        "good": json.dumps(row),
    }
    for name, text in mc.items():
        (root / f"{name}.jsonl").write_text(text)
    (root / "latin1.jsonl").write_bytes(json.dumps(row).replace("a", "\xe9").encode("latin-1"))
    (root / "a-folder.jsonl").mkdir()
    return {"tiny": tiny_data, "bpe": bpe_data, "root": root, "bare": bare, "crafted": crafted}


REFUSALS = {  # name -> (flags, with {tiny}, {bpe}, {root}, {bare}, {crafted} filled in; what the error names)
    "weight negative": (["--data", "{tiny}:1,{tiny}:-1"], "'-1'"),
    "weight zero": (["--data", "{tiny}:1,{tiny}:0"], "'0'"),
    "weight inf": (["--data", "{tiny}:1,{tiny}:inf"], "'inf'"),
    "weight nan": (["--data", "{tiny}:1,{tiny}:nan"], "'nan'"),
    "weight text": (["--data", "{tiny}:1,{tiny}:lots"], "'lots'"),
    "weight a TOML string": (["--config", "{root}/string-weight.toml"], "'0.5x'"),
    "a missing folder": (["--data", "{tiny}:1,{root}/nothing:1"], "{root}/nothing"),
    "two tokenizers": (["--data", "{tiny}:1,{bpe}:1"], "{bpe}"),
    "eval-mc missing": (["--eval-mc", "{root}/missing.jsonl"], "{root}/missing.jsonl"),
    "eval-mc empty": (["--eval-mc", "{root}/empty.jsonl"], "no rows"),
    "eval-mc malformed line": (["--eval-mc", "{root}/malformed.jsonl"], "{root}/malformed.jsonl:2"),
    "eval-mc label out of range": (["--eval-mc", "{root}/label-out-of-range.jsonl"], '"label" 2'),
    "eval-mc label a string": (["--eval-mc", "{root}/label-a-string.jsonl"], "\"label\" '0'"),
    "eval-mc one ending": (["--eval-mc", "{root}/one-ending.jsonl"], "{root}/one-ending.jsonl:1"),
    "eval-mc empty ending": (["--eval-mc", "{root}/empty-ending.jsonl"], "{root}/empty-ending.jsonl:1"),
    "eval-mc not UTF-8": (["--eval-mc", "{root}/latin1.jsonl"], "{root}/latin1.jsonl"),
    "eval-mc a folder": (["--eval-mc", "{root}/a-folder.jsonl"], "{root}/a-folder.jsonl"),
    "eval-mc on data without a tokenizer": (["--data", "{bare}", "--eval-mc", "{root}/good.jsonl"], "tokenizer.json"),
    "packing bos without a document token": (["--data", "{bare}", "--packing", "bos"], "'packing' = 'bos' needs"),
    "attention document without a document token": (
        ["--data", "{bare}", "--attention", "document"],
        "'attention' = 'document' needs",
    ),
    "a crafted nanoGPT meta.pkl": (["--data", "{crafted}", "--data-format", "nanogpt"], "{crafted}/meta.pkl"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_run_leaves_no_run_folder_behind(case, refusal_data, tmp_path, capsys):
    """Each refusal: one line naming it, exit 2, and --out as it was: a new one (two folders deep) not
    made, an empty one still empty (no .lock)."""
    flags, named = REFUSALS[case]
    names = {k: str(v) for k, v in refusal_data.items()}
    (refusal_data["root"] / "string-weight.toml").write_text(f'[data]\n"{names["tiny"]}" = "0.5x"\n')
    flags = [f.format(**names) for f in flags]
    flags = flags if "--data" in flags or "--config" in flags else ["--data", names["tiny"], *flags]
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new" / "run", tmp_path / "empty"):
        train_refuses(capsys, [*TINY, "--out", str(out), "--max-steps", "1", *flags], named.format(**names))
    assert os.listdir(tmp_path) == ["empty"] and os.listdir(tmp_path / "empty") == []
    assert not (refusal_data["root"] / "payload-ran").exists()


def test_a_refused_resume_keeps_the_run_folder_and_its_lock_file(reference, tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = sorted(os.listdir(run_dir))
    train_refuses(capsys, [*run_args(tiny_data, run_dir, "--resume"), "--data", "/nothing"], "/nothing")
    assert sorted(os.listdir(run_dir)) == before
