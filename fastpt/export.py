"""Write a Hugging Face Llama folder (Qwen3 with QK-norm) from a fastpt checkpoint:
python -m fastpt.export RUN_DIR_OR_CKPT --out DIR

The folder (config.json, generation_config.json, safetensors weights, tokenizer files) loads with
transformers' AutoModelForCausalLM / AutoTokenizer, vLLM and lm-evaluation-harness, and computes
the same logits as the checkpoint. It is written into a locked temporary folder and renamed when
complete; a full disk is one line, with nothing published.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from fastpt import checkpoint, files, hf
from fastpt.config import DTYPES
from fastpt.data.tokenizer import load_tokenizer, pick_tokenizer_path
from fastpt.errors import ArgumentParser, ConfigError, DataError, run_command


def check_out(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse an --out that would lose something: a file, a folder that holds the checkpoint being
    exported, one holding any file an export does not write (named), and an earlier export (without
    --overwrite)."""
    if out.is_dir() and source.resolve().is_relative_to(out.resolve()):
        raise ConfigError(f"--out {out} holds the checkpoint being exported; choose another folder")
    files.check_out(out, hf.EXPORT_FILES, "config.json", "fastpt.export", overwrite)


def export_tokenizer(path: Path | None, vocab_size: int, ckpt_path: Path):
    """The `tokenizers` Tokenizer to export beside the model and the id fastpt starts documents
    with; (None, None), with a warning, when there is none that AutoTokenizer could load."""

    def weights_only(why: str):
        print(
            f"fastpt: warning: {why}: exporting the weights only (pass --tokenizer FILE to include one)",
            file=sys.stderr,
        )
        return None, None

    if path is None:
        return weights_only(f"no tokenizer.json beside {ckpt_path} or in its data folder")
    doc_id = load_tokenizer(path).eot_id  # one line if the file is no tokenizer at all
    tok = hf.hf_tokenizer(path)
    if tok is None:
        return weights_only(f"{path} is a kind of tokenizer with no Hugging Face equivalent")
    if tok.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise DataError(
            f"{path} has {tok.get_vocab_size(with_added_tokens=True)} tokens, more than the model's "
            f"vocab of {vocab_size}: not this model's tokenizer"
        )
    return tok, doc_id


def export(
    source: str | Path,
    out: str | Path,
    dtype: str = "fp32",
    max_shard_size: str = "5GB",
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Export the checkpoint at `source` (a file, an FSDP directory, or a run folder's newest) to
    the Hugging Face folder `out`; returns the checkpoint's path."""
    out, shard_bytes = Path(os.path.abspath(out)), hf.parse_size(max_shard_size)  # `.` has a name: its own
    ckpt_path = checkpoint.find(Path(source))
    check_out(out, ckpt_path, overwrite)
    model, ckpt = checkpoint.load_model(ckpt_path, torch.device("cpu"))
    tokenizer_json = pick_tokenizer_path(tokenizer, checkpoint.tokenizer_of(ckpt_path, ckpt))
    tok, doc_id = export_tokenizer(tokenizer_json, model.cfg.vocab_size, ckpt_path)
    with files.staged(out, "fastpt.export") as tmp:
        hf.save_hf(tmp, model.cfg, model.state_dict(), DTYPES[dtype], tok, doc_id, shard_bytes)
    return ckpt_path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m fastpt.export", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "source",
        metavar="RUN_DIR_OR_CKPT",
        help="a run folder (its newest checkpoint), a checkpoint file or an FSDP checkpoint directory",
    )
    ap.add_argument("--out", required=True, help="the Hugging Face folder to write")
    ap.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="fp32",
        help="weight precision (default: %(default)r: the checkpoint's own, exactly)",
    )
    ap.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file before the weights are split into shards (default: %(default)r)",
    )
    ap.add_argument(
        "--tokenizer",
        default="",
        help="a tokenizer.json; '' = the run's, else its data folder's (default: %(default)r)",
    )
    ap.add_argument(
        "--overwrite", action="store_true", help="replace an --out folder that is not empty (default: %(default)r)"
    )
    return ap.parse_args(argv)


def describe_export(out: Path) -> str:
    """What the folder holds, for the line export prints: the architecture transformers loads, the
    files, and the BOS its tokenizer puts before a text."""
    config = hf.read_json(out / "config.json")
    tokenizer = hf.read_json(out / "tokenizer_config.json") if (out / "tokenizer_config.json").is_file() else {}
    bos = f"; its tokenizer starts every text with {tokenizer['bos_token']}" if tokenizer.get("add_bos_token") else ""
    names = ", ".join(sorted(p.name for p in out.iterdir()))
    return f"{config['architectures'][0]} ({config['torch_dtype']}): {names}{bos}"


def run(args: argparse.Namespace) -> None:
    ckpt_path = export(args.source, args.out, args.dtype, args.max_shard_size, args.tokenizer or None, args.overwrite)
    print(f"exported {ckpt_path} to {args.out}: {describe_export(Path(args.out))}")


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    run_command(main)
