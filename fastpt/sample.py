"""Generate text from a fastpt model: python -m fastpt.sample --ckpt RUN_DIR|CKPT|HF_DIR [--prompt TEXT]

The prompt is prefilled into the model's KV cache in one forward pass, then tokens are decoded
one at a time, each step attending to the cached keys and values instead of the whole text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fastpt import checkpoint, hf
from fastpt.data.shards import MAX_VOCAB
from fastpt.data.tokenizer import load_tokenizer, pick_tokenizer_path
from fastpt.errors import ArgumentParser, ConfigError, DataError, run_command
from fastpt.model import Transformer
from fastpt.settings import COUNT, SEED, Interval


def pick(logits: torch.Tensor, temperature: float, top_k: int) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / temperature) over the top_k (0 = all)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1))


@torch.no_grad()
def generate(
    model: Transformer,
    ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 200,
    vocab: int | None = None,
) -> list[int]:
    """Return ids followed by max_new_tokens generated tokens (model may be torch.compile'd); ids
    from `vocab` up (a preset's embedding rows beyond the tokenizer's) are never drawn."""
    device = model.output_weight.device
    window = model.cfg.max_seq_len
    out = list(ids)
    cache = None
    for _ in range(max_new_tokens):
        if cache is None or cache[0][0].shape[2] == window:
            # RoPE positions are absolute, so a full cache cannot slide: refill it from the last half window.
            context = out[-(window if cache is None else window // 2) :]
            step = model(torch.tensor([context], device=device), kv_cache=[])
        else:
            step = model(torch.tensor([out[-1:]], device=device), kv_cache=cache)
        cache = step.cache
        out.append(pick(step.logits[0, -1, :vocab], temperature, top_k))
    return out


def load_hf_model(hf_dir: Path, device: torch.device) -> Transformer:
    """The model of a Hugging Face Llama or Qwen3 folder (one that fastpt.export wrote, or any it can import)."""
    cfg, state = hf.load_hf(hf_dir)
    model = Transformer(cfg)
    model.load_state_dict(state)
    return model.to(device).eval()


def open_model(path: Path, device: torch.device) -> tuple[Transformer, Path | None, str]:
    """The model at `path` (a Hugging Face folder, a checkpoint, or a run folder's newest), the
    tokenizer.json found beside it (None if none), and a line that says what was loaded."""
    if hf.is_hf_dir(path):
        model = load_hf_model(path, device)
        architecture = hf.ARCHITECTURES[model.cfg.qk_norm][1]
        return model, hf.hf_tokenizer_path(path), f"{path}: Hugging Face {architecture}, {model.num_params():,} params"
    ckpt_path = checkpoint.find(path)
    model, ckpt = checkpoint.load_model(ckpt_path, device)
    about = f"{ckpt_path}: step {checkpoint.step_of(ckpt)}, {model.num_params():,} params"
    return model, checkpoint.tokenizer_of(ckpt_path, ckpt), about


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m fastpt.sample", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ckpt",
        required=True,
        metavar="PATH",
        help="a run folder (its newest checkpoint), a checkpoint file or FSDP directory, "
        "or a Hugging Face Llama / Qwen3 folder",
    )
    ap.add_argument("--prompt", default="", help="text to continue; '' = start a new document (default: %(default)r)")
    ap.add_argument("--num-samples", type=int, default=1, help="samples to draw (default: %(default)r)")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default: %(default)r)")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="softmax temperature, in [0.01, 100]; 0 = greedy (default: %(default)r)",
    )
    ap.add_argument(
        "--top-k", type=int, default=200, help="sample among the k most likely tokens; 0 = all (default: %(default)r)"
    )
    ap.add_argument(
        "--tokenizer",
        default="",
        help="a tokenizer.json; '' = the one beside the model, else the run's data folder's (default: %(default)r)",
    )
    ap.add_argument(
        "--device",
        choices=("", "cpu", "cuda"),
        default="",
        help="'' = cuda if available, else cpu (default: %(default)r)",
    )
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (default: %(default)r)")
    ap.add_argument("--seed", type=int, default=1337, help="random seed for sampling (default: %(default)r)")
    args = ap.parse_args(argv)
    limits = {
        "num_samples": COUNT,
        "max_new_tokens": COUNT,
        # logits / 1e-300 overflow fp32 into a traceback; below 0.01 a draw is greedy, past 100 uniform
        "temperature": Interval(0.01, 100, or_off=True),
        "top_k": Interval(0, MAX_VOCAB),
        "seed": SEED,
    }
    for name, domain in limits.items():
        if getattr(args, name) not in domain:
            raise ConfigError(f"'--{name.replace('_', '-')}' must be {domain}, got {getattr(args, name)!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'--device' = 'cuda', but torch sees no CUDA device")
    return args


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, found, about = open_model(Path(args.ckpt), device)
    tokenizer_path = pick_tokenizer_path(args.tokenizer, found)
    if tokenizer_path is None:
        raise DataError(
            f"no tokenizer.json beside {args.ckpt} or in its data folder; pass --tokenizer FILE "
            "(a tokenizer.json from fastpt.prepare or Hugging Face)"
        )
    tokenizer = load_tokenizer(tokenizer_path)
    print(f"{about}, on {device}", file=sys.stderr)

    # Every training document starts with the tokenizer's document token (eot_id), so a prompt does too.
    ids = ([tokenizer.eot_id] if tokenizer.eot_id is not None else []) + tokenizer.encode_batch([args.prompt])[0]
    if not ids:
        raise DataError(f"{tokenizer_path} has no token to start a document with; give --prompt")
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise DataError(
            f"{tokenizer_path} has {tokenizer.vocab_size} tokens, more than the model's vocab of "
            f"{model.cfg.vocab_size}: not this model's tokenizer"
        )
    torch.manual_seed(args.seed)
    # Every decode step has a new cache length: dynamic shapes compile once instead of once per length.
    forward = torch.compile(model, dynamic=True) if args.compile else model
    for i in range(args.num_samples):
        if i:
            print("-" * 40)
        print(
            tokenizer.decode(
                generate(forward, ids, args.max_new_tokens, args.temperature, args.top_k, tokenizer.vocab_size)
            )
        )


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    run_command(main)
